//! A faster stand-in for the tokenizers crate's GPT-2 byte-level pre-tokenizer.
//!
//! The crate splits with the GPT-2 pattern through Oniguruma, a backtracking engine;
//! for SmolLM2-sized prompts that split is nearly all of the tokenization time. This
//! module produces the same splits with the `regex-automata` crate (a lazy DFA, run
//! anchored at each split's start: several times faster) and maps them to the ByteLevel alphabet, so each split can go straight to the
//! tokenizer's own model. It is only used where the tokenizer's normalizer and
//! pre-tokenizer are exactly what it reproduces (`ByteLevelSplitter::for_tokenizer`).

use regex_automata::meta::Regex;
use regex_automata::{Anchored, Input};
use tokenizers::{PreTokenizerWrapper, Tokenizer};

/// The GPT-2 pattern without its one lookahead, ``\s+(?!\S)``: `regex-automata` has no
/// lookaround, so `ByteLevelSplitter::split_gpt2` trims whitespace runs itself.
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// Splits text as ``ByteLevel(add_prefix_space=false, use_regex=true)``, optionally
/// preceded by ``Digits(individual_digits=true)``, would.
#[derive(Debug)]
pub struct ByteLevelSplitter {
    regex: Regex,
    /// Each numeric char is a split of its own (the Digits pre-tokenizer).
    individual_digits: bool,
}

impl ByteLevelSplitter {
    /// `Some` only when the tokenizer has no normalizer and its pre-tokenizer is exactly
    /// ``ByteLevel(add_prefix_space=false, use_regex=true)``, alone or after
    /// ``Digits(individual_digits=true)``; anything else keeps the crate's own pipeline.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Option<ByteLevelSplitter> {
        if tokenizer.get_normalizer().is_some() {
            return None;
        }
        let individual_digits = match tokenizer.get_pre_tokenizer()? {
            PreTokenizerWrapper::ByteLevel(b) if is_gpt2_byte_level(b) => false,
            PreTokenizerWrapper::Sequence(seq) => match seq.as_ref() {
                [PreTokenizerWrapper::Digits(d), PreTokenizerWrapper::ByteLevel(b)]
                    if d.individual_digits && is_gpt2_byte_level(b) =>
                {
                    true
                }
                [PreTokenizerWrapper::ByteLevel(b)] if is_gpt2_byte_level(b) => false,
                _ => return None,
            },
            _ => return None,
        };
        Some(ByteLevelSplitter {
            regex: Regex::new(GPT2_PATTERN).expect("the GPT-2 pattern compiles"),
            individual_digits,
        })
    }

    /// Appends ``text``'s splits, in order, as raw (not yet byte-mapped) text.
    pub fn split<'t>(&self, text: &'t str, splits: &mut Vec<&'t str>) {
        if !self.individual_digits {
            return self.split_gpt2(text, splits);
        }
        let mut start = 0;
        for (at, c) in text.char_indices() {
            if c.is_numeric() {
                self.split_gpt2(&text[start..at], splits);
                let end = at + c.len_utf8();
                splits.push(&text[at..end]);
                start = end;
            }
        }
        self.split_gpt2(&text[start..], splits);
    }

    /// The GPT-2 pattern's matches, each searched anchored where the last one ended
    /// (every char matches some alternative, so matches tile the text and an anchored
    /// search needs no reverse scan to find where a match starts). Oniguruma's
    /// ``\s+(?!\S)`` leaves a whitespace run's last char to the next match when a
    /// non-space follows (so " world" keeps its space); a run our ``\s+`` matched is
    /// shortened the same way, as tiktoken does. ASCII text skips the regex.
    fn split_gpt2<'t>(&self, text: &'t str, splits: &mut Vec<&'t str>) {
        if text.is_ascii() {
            return split_gpt2_ascii(text, splits);
        }
        let mut at = 0;
        while at < text.len() {
            let input = Input::new(text).range(at..).anchored(Anchored::Yes);
            let Some(found) = self.regex.search(&input) else {
                // Unreachable (``\s`` or ``[^\s\p{L}\p{N}]`` matches any char); keep the rest whole.
                splits.push(&text[at..]);
                return;
            };
            let mut end = found.end();
            let piece = &text[at..end];
            if end < text.len() {
                let mut chars = piece.chars();
                if let (Some(last), Some(_)) = (chars.next_back(), chars.next()) {
                    if last.is_whitespace() {
                        end -= last.len_utf8();
                    }
                }
            }
            splits.push(&text[at..end]);
            at = end;
        }
    }
}

/// The GPT-2 pattern's splits of ASCII text, by hand: at each split's start the
/// pattern's alternatives in its order (contractions; an optional space then a run of
/// letters, digits or other chars; else a whitespace run, shortened as in
/// ``split_gpt2``). For ASCII, ``\p{L}`` is ``[A-Za-z]``, ``\p{N}`` is ``[0-9]`` and
/// ``\s`` is ``[\t\n\x0B\x0C\r ]``.
fn split_gpt2_ascii<'t>(text: &'t str, splits: &mut Vec<&'t str>) {
    #[derive(Clone, Copy, PartialEq)]
    enum Class {
        Letter,
        Digit,
        Space,
        Other,
    }
    fn class(b: u8) -> Class {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
            b'0'..=b'9' => Class::Digit,
            b'\t'..=b'\r' | b' ' => Class::Space,
            _ => Class::Other,
        }
    }
    let bytes = text.as_bytes();
    let run_end =
        |from: usize, c: Class| from + bytes[from..].iter().take_while(|&&b| class(b) == c).count();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let end = match rest {
            [b'\'', b's' | b't' | b'm' | b'd', ..] => at + 2,
            [b'\'', b'r', b'e', ..] | [b'\'', b'v', b'e', ..] | [b'\'', b'l', b'l', ..] => at + 3,
            [b' ', next, ..] if class(*next) != Class::Space => run_end(at + 1, class(*next)),
            [first, ..] => match class(*first) {
                Class::Space => {
                    let end = run_end(at, Class::Space);
                    if end < bytes.len() && end - at > 1 {
                        end - 1
                    } else {
                        end
                    }
                }
                other => run_end(at, other),
            },
            [] => unreachable!("at < len"),
        };
        splits.push(&text[at..end]);
        at = end;
    }
}

fn is_gpt2_byte_level(b: &tokenizers::pre_tokenizers::byte_level::ByteLevel) -> bool {
    b.use_regex && !b.add_prefix_space
}

/// GPT-2's byte -> char table: printable bytes map to themselves, the rest to U+0100...
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("U+0100..U+0143 are chars")
        };
    }
    table
}

/// Writes ``split``'s bytes in the ByteLevel alphabet (what the model's vocab uses).
pub fn byte_level(split: &str, out: &mut String) {
    static TABLE: std::sync::LazyLock<[char; 256]> = std::sync::LazyLock::new(byte_chars);
    out.clear();
    out.extend(split.bytes().map(|b| TABLE[b as usize]));
}
