//! Image content parts, the same in every protocol, checked here.
//!
//! An image arrives as a ``data:<media type>;base64,<data>`` URL (Chat Completions'
//! ``image_url``, Responses' ``input_image``) or as base64 with its media type
//! (Anthropic's ``source``), which becomes such a URL. The data must decode, be a PNG,
//! JPEG, GIF or WebP image (its header gives the size, read by the ``imagesize``
//! crate), agree with the media type it claims, and stay within the limits below; each
//! failure is a 400 naming the part. Each image's preprocessed size and token count
//! follow DeepSeek's V4.1 specification (``crate::image_fit``) and go to the engine as
//! ``EngineRequest::image_fits``; the decoded bytes go along in ``image_parts`` for the
//! server to decode into pixels (base64 is decoded once, here).
//!
//! A remote ``http(s)`` URL is refused by default (``RemoteImages::Refuse``): the server
//! may have no network, and fetching what a client names is a server-side request
//! forgery risk. A server whose operator enabled fetching parses with
//! ``RemoteImages::Defer``: the URL becomes an image part of unknown size, which the
//! server fetches under its own rules (allowed hosts, a byte cap, a timeout) and then
//! checks with ``check_image_bytes`` and ``fit_image``, the same rules as inline data.

use base64::Engine;

use std::sync::Arc;

use crate::conversation::{ContentPart, Conversation, EngineRequest, ImagePart, ImageSource};
use crate::error::{RecipeError, Result};
use crate::image_fit::{self, ImageDetail, ImageFit};

/// The largest decoded image (OpenAI's and Anthropic's limits are 20 MB and 5 MB).
pub const MAX_IMAGE_BYTES: usize = 20 * 1024 * 1024;
/// The most images one request may carry.
pub const MAX_IMAGES: usize = 32;
/// The largest side, in pixels (the official adapter's limit)...
pub const MAX_IMAGE_SIDE: usize = 8192;
/// ...and its limit once a request carries ``MANY_IMAGES`` or more.
pub const MAX_IMAGE_SIDE_OF_MANY: usize = 4096;
pub const MANY_IMAGES: usize = 15;

const MEDIA_TYPES: &[(&str, imagesize::ImageType)] = &[
    ("image/png", imagesize::ImageType::Png),
    ("image/jpeg", imagesize::ImageType::Jpeg),
    ("image/gif", imagesize::ImageType::Gif),
    ("image/webp", imagesize::ImageType::Webp),
];

/// What the parser does with a remote ``http(s)`` image URL.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RemoteImages {
    /// Refuse it (400 naming the part): the default.
    #[default]
    Refuse,
    /// Let it through as an image part of unknown size, for the server to fetch and check.
    Defer,
}

/// A checked image part from a URL a client sent (``path`` names it in errors). A remote
/// URL becomes a part of unknown size; ``fit_images`` refuses or keeps it.
pub(crate) fn image_from_url(url: &str, path: &str, detail: ImageDetail) -> Result<ContentPart> {
    if url.starts_with("http://") || url.starts_with("https://") {
        return Ok(ContentPart::Image {
            url: url.to_string(),
            width: 0,
            height: 0,
            detail,
            source: ImageSource {
                path: path.to_string(),
                media_type: None,
                data: None,
            },
        });
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(RecipeError::invalid(
            path,
            "an image must be a data URL (data:image/png;base64,...)",
        ));
    };
    let Some((media_type, data)) = rest.split_once(";base64,") else {
        return Err(RecipeError::invalid(
            path,
            "an image data URL must be base64-encoded (data:<media type>;base64,<data>)",
        ));
    };
    image_from_base64(media_type, data, path, detail)
}

/// A checked image part from base64 data and its declared media type.
pub(crate) fn image_from_base64(
    media_type: &str,
    data: &str,
    path: &str,
    detail: ImageDetail,
) -> Result<ContentPart> {
    check_media_type(media_type, path)?;
    // A base64 text longer than this decodes to more than the limit: refuse before decoding.
    if data.len() / 4 * 3 > MAX_IMAGE_BYTES + 3 {
        return Err(too_large(path));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| RecipeError::invalid(path, format!("the image is not valid base64: {e}")))?;
    let (width, height) = check_image_bytes(&bytes, media_type, path)?;
    Ok(ContentPart::Image {
        url: format!("data:{media_type};base64,{}", data.trim()),
        width,
        height,
        detail,
        source: ImageSource {
            path: path.to_string(),
            media_type: Some(media_type.to_string()),
            data: Some(Arc::from(bytes)),
        },
    })
}

/// The width and height of an image's ``bytes`` from its header, once they are checked:
/// not empty, within ``MAX_IMAGE_BYTES``, of the image type ``media_type`` names (a PNG,
/// JPEG, GIF or WebP), each side 1 to ``MAX_IMAGE_SIDE`` pixels. Errors name ``path``.
pub fn check_image_bytes(bytes: &[u8], media_type: &str, path: &str) -> Result<(u32, u32)> {
    let expected = check_media_type(media_type, path)?;
    if bytes.is_empty() {
        return Err(RecipeError::invalid(path, "the image is empty"));
    }
    if bytes.len() > MAX_IMAGE_BYTES {
        return Err(too_large(path));
    }
    let found = imagesize::image_type(bytes).ok();
    if found != Some(expected) {
        return Err(RecipeError::invalid(
            path,
            format!("the image data is not a valid {media_type} image"),
        ));
    }
    let size = imagesize::blob_size(bytes).map_err(|e| {
        RecipeError::invalid(path, format!("the {media_type} image cannot be read: {e}"))
    })?;
    if size.width == 0 || size.height == 0 || size.width.max(size.height) > MAX_IMAGE_SIDE {
        return Err(RecipeError::invalid(
            path,
            format!(
                "the image is {}x{} pixels; each side must be 1 to {MAX_IMAGE_SIDE}",
                size.width, size.height
            ),
        ));
    }
    Ok((size.width as u32, size.height as u32))
}

/// The ``detail`` field of an image part, when given: low, high, auto or original.
pub(crate) fn detail_field(detail: Option<&str>, path: &str) -> Result<ImageDetail> {
    match detail {
        None => Ok(ImageDetail::default()),
        Some(name) => ImageDetail::parse(name).ok_or_else(|| {
            RecipeError::invalid(
                path,
                format!("unknown detail {name:?} (expected auto, low, high or original)"),
            )
        }),
    }
}

/// The image type a supported media type names; any other is an error at ``path``.
pub(crate) fn check_media_type(media_type: &str, path: &str) -> Result<imagesize::ImageType> {
    MEDIA_TYPES
        .iter()
        .find(|(name, _)| *name == media_type)
        .map(|(_, kind)| *kind)
        .ok_or_else(|| {
            RecipeError::invalid(
                path,
                format!("unsupported image media type {media_type:?} (expected image/png, image/jpeg, image/gif or image/webp)"),
            )
        })
}

fn too_large(path: &str) -> RecipeError {
    RecipeError::invalid(
        path,
        format!(
            "the image is larger than {} MB; send a smaller image",
            MAX_IMAGE_BYTES / (1024 * 1024)
        ),
    )
}

/// V4.1's fit of image ``number`` (from 1) of the ``count`` a request carries, sized
/// ``width × height``: a side over the limit for this many images, or an image the V4.1
/// preprocessing cannot fit, is an error at ``path``.
pub fn fit_image(
    width: u32,
    height: u32,
    detail: ImageDetail,
    number: usize,
    count: usize,
    path: &str,
) -> Result<ImageFit> {
    let max_side = if count >= MANY_IMAGES {
        MAX_IMAGE_SIDE_OF_MANY
    } else {
        MAX_IMAGE_SIDE
    };
    let which = format!("image {number} of {count}");
    if width.max(height) as usize > max_side {
        return Err(RecipeError::invalid(
            path,
            format!(
                "{which} is {width}x{height} pixels; with {count} image(s) each side must be at most {max_side}"
            ),
        ));
    }
    image_fit::preprocessed(width, height, detail)
        .map_err(|why| RecipeError::invalid(path, format!("{which}: {why}")))
}

/// Counts and fits a request's images (``images``, ``image_fits``, ``image_parts``):
/// more than ``MAX_IMAGES``, a side over the limit for this many images, or an image the
/// V4.1 preprocessing cannot fit is an error; so is a remote URL unless ``remote`` defers it.
pub(crate) fn fit_images(request: &mut EngineRequest, remote: RemoteImages) -> Result<()> {
    let conversation: &Conversation = &request.conversation;
    let count = conversation.image_count();
    if count > MAX_IMAGES {
        return Err(RecipeError::invalid(
            "messages",
            format!("{count} images; a request may carry at most {MAX_IMAGES}"),
        ));
    }
    let images = conversation
        .messages
        .iter()
        .flat_map(|m| &m.content)
        .filter_map(|p| match p {
            ContentPart::Image {
                url,
                width,
                height,
                detail,
                source,
            } => Some((url, *width, *height, *detail, source)),
            ContentPart::Text { .. } => None,
        });
    let mut fits = Vec::with_capacity(count);
    let mut parts = Vec::with_capacity(count);
    for (number, (url, width, height, detail, source)) in images.enumerate() {
        if source.is_remote() {
            if remote == RemoteImages::Refuse {
                return Err(RecipeError::unsupported(
                    &source.path,
                    "remote image URLs are not fetched by this server (its operator has not \
                     enabled [server.images] fetch); send the image inline as a data URL \
                     (data:image/png;base64,...)",
                ));
            }
            parts.push(ImagePart {
                path: source.path.clone(),
                media_type: None,
                detail,
                width: 0,
                height: 0,
                fit: None,
                url: Some(url.clone()),
                data: None,
            });
            continue;
        }
        let fit = fit_image(width, height, detail, number + 1, count, "messages")?;
        fits.push(fit);
        parts.push(ImagePart {
            path: source.path.clone(),
            media_type: source.media_type.clone(),
            detail,
            width,
            height,
            fit: Some(fit),
            url: None,
            data: source.data.clone(),
        });
    }
    request.images = count;
    request.image_fits = fits;
    request.image_parts = parts;
    Ok(())
}
