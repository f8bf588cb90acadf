//! The fast byte-level pre-tokenizer against the tokenizers crate's own pipeline, on
//! SmolLM2's tokenizer.json as shipped (ByteLevel) and as the GGUF loader rebuilds it
//! (Digits then ByteLevel): the same splits for every char, the same ids for arbitrary
//! text, and a piece holding a non-special added token still split at it.

use std::path::PathBuf;
use std::sync::LazyLock;

use powertrain_recipe::pretokenize::{byte_level, ByteLevelSplitter};
use powertrain_recipe::render::{Prompt, Segment};
use powertrain_recipe::tokenize::PromptTokenizer;
use proptest::prelude::*;
use serde_json::{json, Value};
use tokenizers::pattern::Pattern;
use tokenizers::utils::SysRegex;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};

static FIXTURE: LazyLock<Value> = LazyLock::new(|| {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2/tokenizer.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
});

/// The fixture with its pre-tokenizer replaced and extra added tokens appended.
fn variant(pre_tokenizer: Option<Value>, extra_added: &[(&str, bool)]) -> Vec<u8> {
    let mut json = FIXTURE.clone();
    if let Some(pre) = pre_tokenizer {
        json["pre_tokenizer"] = pre;
    }
    let added = json["added_tokens"].as_array_mut().unwrap();
    for (i, (content, special)) in extra_added.iter().enumerate() {
        added.push(json!({
            "id": 49152 + i, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special,
        }));
    }
    serde_json::to_vec(&json).unwrap()
}

fn byte_level_json(add_prefix_space: bool, use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true, "use_regex": use_regex})
}

fn digits_then_byte_level(individual_digits: bool) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": individual_digits}, byte_level_json(false, true),
    ]})
}

/// A tokenizer, its crate-pipeline reference (special tokens unmatched, as
/// ``PromptTokenizer`` encodes text) and the splitter it selects.
struct Case {
    ours: PromptTokenizer,
    reference: Tokenizer,
    splitter: ByteLevelSplitter,
}

impl Case {
    fn new(json: Vec<u8>) -> Case {
        let mut reference = Tokenizer::from_bytes(&json).unwrap();
        reference.set_encode_special_tokens(true);
        let splitter = ByteLevelSplitter::for_tokenizer(&reference).expect("the fast path applies");
        Case {
            ours: PromptTokenizer::from_bytes(&json).unwrap(),
            reference,
            splitter,
        }
    }

    fn splits(&self, text: &str) -> Vec<String> {
        let mut splits = Vec::new();
        self.splitter.split(text, &mut splits);
        let mut word = String::new();
        splits
            .into_iter()
            .map(|s| {
                byte_level(s, &mut word);
                word.clone()
            })
            .collect()
    }

    fn reference_splits(&self, text: &str) -> Vec<String> {
        let mut pretokenized = PreTokenizedString::from(text);
        self.reference
            .get_pre_tokenizer()
            .unwrap()
            .pre_tokenize(&mut pretokenized)
            .unwrap();
        pretokenized
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect()
    }

    fn ids(&self, text: &str) -> Vec<u32> {
        let segment = Segment {
            text: text.to_string(),
            trusted: false,
        };
        self.ours
            .encode(&Prompt {
                segments: vec![segment],
            })
            .unwrap()
    }

    fn reference_ids(&self, text: &str) -> Vec<u32> {
        self.reference
            .encode_fast(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    }
}

static BYTE_LEVEL: LazyLock<Case> = LazyLock::new(|| Case::new(variant(None, &[])));
static DIGITS: LazyLock<Case> =
    LazyLock::new(|| Case::new(variant(Some(digits_then_byte_level(true)), &[])));
/// Non-special added tokens that random text will contain, and a special one.
static ADDED: LazyLock<Case> = LazyLock::new(|| {
    Case::new(variant(
        Some(digits_then_byte_level(true)),
        &[
            ("ing the", false),
            (" \n", false),
            ("'s", false),
            ("1 ", false),
            ("<x>", true),
        ],
    ))
});

fn cases() -> [&'static Case; 3] {
    [&BYTE_LEVEL, &DIGITS, &ADDED]
}

#[test]
fn the_fast_path_applies_only_to_the_pipelines_it_reproduces() {
    let applies = |pre: Option<Value>, normalizer: Value| {
        let mut json: Value = serde_json::from_slice(&variant(pre, &[])).unwrap();
        json["normalizer"] = normalizer;
        let tokenizer = Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        ByteLevelSplitter::for_tokenizer(&tokenizer).is_some()
    };
    assert!(applies(None, Value::Null));
    assert!(applies(Some(digits_then_byte_level(true)), Value::Null));
    let sequence = |pre: Vec<Value>| json!({"type": "Sequence", "pretokenizers": pre});
    assert!(applies(
        Some(sequence(vec![byte_level_json(false, true)])),
        Value::Null
    ));
    assert!(!applies(Some(digits_then_byte_level(false)), Value::Null));
    assert!(!applies(Some(byte_level_json(true, true)), Value::Null));
    assert!(!applies(Some(byte_level_json(false, false)), Value::Null));
    assert!(!applies(Some(json!({"type": "Whitespace"})), Value::Null));
    assert!(!applies(None, json!({"type": "NFC"})));
}

/// Every char, in contexts that tell letters, numbers, whitespace and the rest apart,
/// splits as the crate's Oniguruma regex splits it: `regex-automata`'s Unicode tables
/// agree with Oniguruma's. (The regex alone: the whole pipeline on ~6M chars is too slow
/// for a debug build; the tests below run the pipeline.)
#[test]
fn every_char_splits_as_the_crate_regex_splits_it() {
    // Verbatim from tokenizers' pre_tokenizers/byte_level.rs.
    let onig = SysRegex::new(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    )
    .unwrap();
    let chars: Vec<char> = (0..=0x10FFFFu32).filter_map(char::from_u32).collect();
    for chunk in chars.chunks(8192) {
        let text: String = chunk.iter().map(|c| format!("a{c}! {c}")).collect();
        let mut ours = Vec::new();
        BYTE_LEVEL.splitter.split(&text, &mut ours);
        let theirs: Vec<&str> = (&onig)
            .find_matches(&text)
            .unwrap()
            .into_iter()
            .map(|((start, end), _)| &text[start..end])
            .collect();
        assert_eq!(ours, theirs, "chars from U+{:04X}", chunk[0] as u32);
    }
}

#[test]
fn edge_cases_match_the_crate() {
    let texts = [
        "",
        " ",
        "  ",
        "Hello  world",
        "a \n b",
        "a\n\n\nb",
        "a \t\r\n  b  ",
        "ends in spaces   ",
        "\r\n\r\n",
        "x\u{3000}\u{3000}y",
        "x\u{a0}\u{a0}y",
        "x \u{85} y\u{2028}\u{2029}z",
        "\u{200b}zero\u{200b} width\u{feff}",
        "I'm, you're, it's, we'll, they'd, I've, don't; IT'S ''s 's",
        "’s curly",
        "12345 67.89 -1e10 ٣٤ ²³ Ⅻ ½",
        "  123  ",
        "Straße мир 日本語 عربي हिन्दी",
        "e\u{301}\u{301} n\u{303}",
        "🙂 👩\u{200d}👩\u{200d}👧 🇫🇷!!",
        "<|im_start|>user\n<|im_end|>",
        "tabs\t\tand\t",
        "ing the thing the 1 2 's",
    ];
    for case in cases() {
        for text in texts {
            assert_eq!(case.ids(text), case.reference_ids(text), "{text:?}");
            if !std::ptr::eq(case, &*ADDED) {
                assert_eq!(case.splits(text), case.reference_splits(text), "{text:?}");
            }
        }
    }
}

#[test]
fn whitespace_before_a_word_leaves_it_one_space() {
    assert_eq!(
        BYTE_LEVEL.splits("Hello  world \n"),
        ["Hello", "Ġ", "Ġworld", "ĠĊ"]
    );
    assert_eq!(BYTE_LEVEL.splits("a\n\n b"), ["a", "ĊĊ", "Ġb"]);
    assert_eq!(BYTE_LEVEL.splits("a\n\tb"), ["a", "Ċ", "ĉ", "b"]);
    assert_eq!(DIGITS.splits("x  42"), ["x", "ĠĠ", "4", "2"]);
}

fn text() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        3 => proptest::sample::select(vec![
            " ", "  ", "\t", "\n", "\r\n", "\r", "\u{b}", "\u{c}", "\u{85}", "\u{a0}", "\u{1680}",
            "\u{2000}", "\u{2028}", "\u{2029}", "\u{202f}", "\u{205f}", "\u{3000}", "\u{200b}",
            "\u{feff}", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'", "’s", "don't",
            "hello", "the", "ing", "Straße", "мир", "日本語", "عربي", "हिन्दी", "e\u{301}",
            "\u{301}", "🙂", "👩\u{200d}👧", "🇫🇷", "0", "7", "2024", "٣", "²", "Ⅻ", "½", "𝟙",
            "!", "...", "-", "_", "<|im_start|>", "<x>", "ing the", "1 ",
        ]).prop_map(str::to_string),
        2 => "[ \t\n\r]{1,6}",
        2 => "[a-zA-Z0-9 '.,!?\n]{1,8}",
        1 => any::<char>().prop_map(String::from),
        1 => any::<String>().prop_map(|s| s.chars().take(6).collect()),
    ];
    proptest::collection::vec(fragment, 0..32).prop_map(|parts| parts.concat())
}

/// ASCII only: the splitter's hand-written ASCII path.
fn ascii_text() -> impl Strategy<Value = String> {
    let fragment = prop_oneof![
        3 => proptest::sample::select(vec![
            " ", "  ", "\t", "\n", "\r\n", "\u{b}", "\u{c}", "\u{1c}", "\u{7f}", "'s", "'t",
            "'re", "'ve", "'m", "'ll", "'d", "'S", "'R", "'", "''", "' ", "don't", "hello", "ing",
            "0", "2024", "!", "...", "-", "_", "<|im_start|>", "ing the", "1 ",
        ]).prop_map(str::to_string),
        2 => "[ \t\n\r\x0b\x0c]{1,6}",
        3 => "[\x00-\x7f]{1,8}",
    ];
    proptest::collection::vec(fragment, 0..32).prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn ascii_fast_path_equals_the_crate(text in ascii_text()) {
        for case in cases() {
            prop_assert_eq!(case.ids(&text), case.reference_ids(&text));
        }
        for case in [&*BYTE_LEVEL, &*DIGITS] {
            prop_assert_eq!(case.splits(&text), case.reference_splits(&text));
        }
    }

    #[test]
    fn fast_path_ids_equal_the_crate_ids(text in text()) {
        for case in cases() {
            prop_assert_eq!(case.ids(&text), case.reference_ids(&text));
        }
    }

    #[test]
    fn fast_path_splits_equal_the_crate_splits(text in text()) {
        for case in [&*BYTE_LEVEL, &*DIGITS] {
            prop_assert_eq!(case.splits(&text), case.reference_splits(&text));
        }
    }
}
