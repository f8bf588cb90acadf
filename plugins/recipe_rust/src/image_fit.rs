//! How large an image is once preprocessed for DeepSeek V4.1, and how many prompt
//! tokens it then takes: the official adapter's image token specification.
//!
//! V4.1's vision encoder cuts an image into 14-pixel patches and merges 3×3 patches
//! into one token. Each row of tokens ends with a newline token, and a start and an
//! end token enclose the image, so an image of ``rows × columns`` tokens takes
//! ``rows * (columns + 1) + 2`` prompt positions, at most 1024. Before that:
//! - an image under 544×544 pixels of area is scaled up to about that area;
//! - both sides are rounded up to whole patches;
//! - an image over the budget is scaled down to the largest aspect-preserving size
//!   within it;
//! - the three steps repeat until the size no longer changes (at most ten times; an
//!   image that still moves is refused, as the official adapter refuses it);
//! - a side over WebP's 16,383-pixel limit (the official adapter re-encodes images as
//!   WebP) is brought within it and the fit is done again, at most six times;
//! - at ``detail: low``, the image is first shrunk so that its long side is at most
//!   512 pixels.
//!
//! Only sizes are computed here: no model served has a vision encoder, so the pixels
//! would not be used. The differential test in ``tests/test_official_image_fit.py``
//! checks every size and count against ``deepseek-recipe``.

use serde::{Deserialize, Serialize};

const PATCH: usize = 14;
const MERGE: usize = 3;
/// One token's side in pixels.
const TOKEN_SIDE: usize = PATCH * MERGE;
const MAX_TOKENS: usize = 1024;
const MIN_AREA: usize = 544 * 544;
const MAX_FIT_STEPS: usize = 10;
const WEBP_MAX_SIDE: usize = 16_383;
const MAX_WEBP_ROUNDS: usize = 6;
/// The long side an image is shrunk to at ``detail: low``.
pub const LOW_DETAIL_SIDE: u32 = 512;

/// The detail a client asked for. Only ``low`` changes the preprocessing; ``high``
/// (the default), ``auto`` and ``original`` are the same, as in the official adapter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageDetail {
    Low,
    #[default]
    High,
    Auto,
    Original,
}

impl ImageDetail {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "low" => Self::Low,
            "high" => Self::High,
            "auto" => Self::Auto,
            "original" => Self::Original,
            _ => return None,
        })
    }
}

/// An image's preprocessed size and the token grid it becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageFit {
    pub width: usize,
    pub height: usize,
    pub rows: usize,
    pub columns: usize,
    /// Prompt positions the image takes once its placeholder is expanded.
    pub tokens: usize,
}

impl ImageFit {
    /// The grid of a size already aligned to patches.
    fn of_aligned(width: usize, height: usize) -> Self {
        let rows = (height / PATCH).div_ceil(MERGE);
        let columns = (width / PATCH).div_ceil(MERGE);
        ImageFit {
            width,
            height,
            rows,
            columns,
            tokens: rows * (columns + 1) + 2,
        }
    }
}

/// The V4.1 fit of an image of ``width × height`` pixels; ``Err`` names why the
/// official adapter would refuse it.
pub fn fit(width: usize, height: usize) -> Result<ImageFit, String> {
    let mut current = fit_step(width, height);
    for _ in 1..MAX_FIT_STEPS {
        let next = fit_step(current.width, current.height);
        if next == current {
            return Ok(current);
        }
        current = next;
    }
    Err(format!(
        "fitting a {width}x{height} image to the image token budget did not settle \
         after {MAX_FIT_STEPS} steps"
    ))
}

/// One pass: scale up to the minimum area, align to patches, keep within the budget.
fn fit_step(width: usize, height: usize) -> ImageFit {
    let (mut width, mut height) = (width, height);
    let area = width * height;
    if area > 0 && area < MIN_AREA {
        let scale = (MIN_AREA as f64 / area as f64).sqrt();
        width = (width as f64 * scale) as usize;
        height = (height as f64 * scale) as usize;
    }
    let aligned = ImageFit::of_aligned(
        width.div_ceil(PATCH) * PATCH,
        height.div_ceil(PATCH) * PATCH,
    );
    if aligned.tokens <= MAX_TOKENS {
        aligned
    } else {
        largest_within_budget(width, height)
    }
}

/// The largest size of this aspect ratio whose grid fits the budget. With ``ratio =
/// rows / columns``, ``rows * (columns + 1) = budget`` gives ``columns² + columns =
/// budget / ratio``; a grid too thin for that keeps one row or one column.
fn largest_within_budget(width: usize, height: usize) -> ImageFit {
    let budget = (MAX_TOKENS - 2) as f64;
    let ratio = height as f64 / width as f64;
    let columns = (budget / ratio + 0.25).sqrt() - 0.5;
    let rows = columns * ratio;
    if columns < 1.0 {
        let rows = (MAX_TOKENS - 2) / 2;
        return ImageFit::of_aligned(TOKEN_SIDE, rows * TOKEN_SIDE);
    }
    if rows < 1.0 {
        let columns = MAX_TOKENS - 3;
        return ImageFit::of_aligned(columns * TOKEN_SIDE, TOKEN_SIDE);
    }
    let scale_w = (columns as usize * TOKEN_SIDE) as f64 / width as f64;
    let scale_h = (rows as usize * TOKEN_SIDE) as f64 / height as f64;
    let scale = scale_w.min(scale_h);
    let whole_patches = |side: usize| (side as f64 * scale / PATCH as f64) as usize * PATCH;
    ImageFit::of_aligned(whole_patches(width), whole_patches(height))
}

/// The size and tokens of an image sent at ``width × height`` with ``detail``, as the
/// official preprocessing gives them; ``Err`` says why it would refuse the image.
pub fn preprocessed(width: u32, height: u32, detail: ImageDetail) -> Result<ImageFit, String> {
    let (mut width, mut height) = (width as usize, height as usize);
    if detail == ImageDetail::Low {
        let long = width.max(height);
        if long > LOW_DETAIL_SIDE as usize {
            let scale = LOW_DETAIL_SIDE as f64 / long as f64;
            width = ((width as f64 * scale).round() as usize).max(1);
            height = ((height as f64 * scale).round() as usize).max(1);
        }
    }
    let mut source = (width, height);
    for _ in 0..MAX_WEBP_ROUNDS {
        let fitted = fit(source.0, source.1)?;
        if fitted.width == 0 || fitted.height == 0 {
            return Err(format!(
                "a {width}x{height} image fits the image token budget only as \
                 {}x{} pixels; send a less elongated image",
                fitted.width, fitted.height
            ));
        }
        if fitted.width <= WEBP_MAX_SIDE && fitted.height <= WEBP_MAX_SIDE {
            return Ok(fitted);
        }
        source = within_webp_limit(fitted.width, fitted.height);
    }
    Err(format!(
        "a {width}x{height} image has no preprocessed size within {WEBP_MAX_SIDE} pixels a side; \
         send a less elongated image"
    ))
}

/// The long side brought to the largest whole number of patches within WebP's limit,
/// the short side scaled with it and rounded up to whole patches (rounding up keeps
/// the area above the minimum, which would otherwise scale the long side out again).
fn within_webp_limit(width: usize, height: usize) -> (usize, usize) {
    let long = width.max(height);
    if long <= WEBP_MAX_SIDE {
        return (width, height);
    }
    let new_long = WEBP_MAX_SIDE / PATCH * PATCH;
    let short = (width.min(height) as f64 * new_long as f64 / long as f64).round() as usize;
    let new_short = short.max(1).div_ceil(PATCH) * PATCH;
    if width >= height {
        (new_long, new_short)
    } else {
        (new_short, new_long)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_takes_one_newline_per_row_and_two_delimiters() {
        // 980x490 px: 70x35 patches, 24x12 tokens.
        let f = ImageFit::of_aligned(980, 490);
        assert_eq!((f.columns, f.rows, f.tokens), (24, 12, 12 * 25 + 2));
    }

    #[test]
    fn small_images_are_scaled_up_and_large_ones_kept_within_the_budget() {
        let small = fit(10, 10).unwrap();
        assert!(small.width * small.height >= MIN_AREA, "{small:?}");
        for (w, h) in [(4000, 3000), (1, 40_000), (40_000, 1), (20_000, 20_000)] {
            let f = fit(w, h).unwrap();
            assert!(f.tokens <= MAX_TOKENS, "{w}x{h}: {f:?}");
            assert_eq!(
                fit(f.width, f.height).unwrap(),
                f,
                "a fitted size is a fixed point"
            );
        }
    }

    #[test]
    fn low_detail_shrinks_the_long_side_first() {
        let high = preprocessed(2000, 1000, ImageDetail::High).unwrap();
        let low = preprocessed(2000, 1000, ImageDetail::Low).unwrap();
        assert!(low.tokens < high.tokens, "{low:?} vs {high:?}");
    }

    #[test]
    fn preprocessed_sizes_stay_within_webp() {
        for (w, h) in [(1, 8192), (8192, 1), (3, 7000)] {
            let f = preprocessed(w, h, ImageDetail::High).unwrap();
            assert!(
                f.width <= WEBP_MAX_SIDE && f.height <= WEBP_MAX_SIDE,
                "{w}x{h}: {f:?}"
            );
        }
    }
}
