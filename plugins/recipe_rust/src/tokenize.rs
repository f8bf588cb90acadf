//! Prompt segments -> token ids with the model's tokenizer.json.
//!
//! Trusted text (template text) is tokenized as transformers'
//! ``tokenizer.encode(text, add_special_tokens=False)`` would: added tokens split the
//! text, the pieces between them go through normalizer, pre-tokenizer and model. No
//! BOS/EOS is added (``apply_chat_template(tokenize=True)`` adds none either).
//!
//! Untrusted text never yields a special token: special added tokens are only matched
//! inside trusted segments (a match must lie wholly inside one), never in untrusted
//! text or across a boundary. The text between two special-token matches is
//! tokenized as ONE piece even when it spans trusted and untrusted segments, with the
//! tokenizer's ``encode_special_tokens`` on (special tokens are not matched, non-special
//! added tokens still are), so the ids equal transformers' whenever no special-token
//! string occurs in untrusted text.
//!
//! Byte-level BPE tokenizers whose pre-tokenizer ``pretokenize::ByteLevelSplitter``
//! reproduces skip the crate's pipeline: the splitter's splits go straight to the
//! tokenizer's own model (same ids, several times faster). A piece that contains a
//! non-special added token still takes the crate's pipeline, which splits it there.
//! The fast path keeps its own cache of split -> ids (the model's answer for a split
//! never changes, except under BPE dropout, which turns the cache off): a hit costs
//! one hash lookup, where the model's own cache clones its word and allocates a
//! token string per id.
//!
//! Not reproduced: added tokens with ``normalized: true`` are matched on the raw text
//! (HF matches them on normalized text), their ``lstrip``/``rstrip``/``single_word``
//! flags are ignored, and a Metaspace pre-tokenizer with ``prepend_scheme: "first"``
//! sees each piece as a first piece. None of these matter for byte-level BPE
//! tokenizers (SmolLM2, Llama 3, Qwen, DeepSeek).

use std::collections::HashMap;
use std::sync::RwLock;

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::{Model, ModelWrapper, Tokenizer};

use crate::error::{RecipeError, Result};
use crate::pretokenize::{byte_level, ByteLevelSplitter};
use crate::render::Prompt;

pub struct PromptTokenizer {
    /// Encodes with special tokens left unmatched (non-special added tokens still match).
    plain: Tokenizer,
    /// The unmodified tokenizer (decoding).
    full: Tokenizer,
    /// Special added tokens, longest first: (content, id).
    special: Vec<(String, u32)>,
    /// Finds ``special`` leftmost-longest (pattern index = index in ``special``).
    special_matcher: Option<AhoCorasick>,
    /// The fast path past the crate's pre-tokenizer, where it gives the same splits.
    splitter: Option<ByteLevelSplitter>,
    /// Non-special added tokens: a piece containing one takes the crate's pipeline.
    plain_added: Vec<String>,
    /// The fast path's split -> ids cache (None under BPE dropout).
    cache: Option<SplitCache>,
}

type SplitCache = RwLock<HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>>;

/// Entries the split cache holds before it starts over (HF's BPE cache holds 10,000).
const CACHE_CAPACITY: usize = 50_000;
/// Longer splits are not cached (rare, and they would crowd the cache).
const CACHE_MAX_SPLIT: usize = 64;

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl PromptTokenizer {
    pub fn from_bytes(tokenizer_json: &[u8]) -> Result<PromptTokenizer> {
        let full = Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| RecipeError::internal(format!("tokenizer.json does not load: {e}")))?;
        let mut plain = full.clone();
        plain.set_encode_special_tokens(true);
        let mut special: Vec<(String, u32)> = full
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| (t.content, id))
            .collect();
        special.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let special_matcher = if special.is_empty() {
            None
        } else {
            let matcher = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(special.iter().map(|(s, _)| s))
                .map_err(|e| RecipeError::internal(format!("special tokens: {e}")))?;
            Some(matcher)
        };
        let plain_added = full
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| !t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        // Truncation and padding are post-processing the fast path would skip.
        let splitter = if full.get_truncation().is_none() && full.get_padding().is_none() {
            ByteLevelSplitter::for_tokenizer(&full)
        } else {
            None
        };
        let dropout = matches!(full.get_model(), ModelWrapper::BPE(bpe) if bpe.dropout.is_some());
        let cache = (!dropout).then(|| RwLock::new(HashMap::default()));
        Ok(PromptTokenizer {
            plain,
            full,
            special,
            special_matcher,
            splitter,
            plain_added,
            cache,
        })
    }

    /// The special added tokens' strings.
    pub fn special_tokens(&self) -> Vec<String> {
        let mut tokens: Vec<String> = self.special.iter().map(|(s, _)| s.clone()).collect();
        tokens.sort();
        tokens
    }

    /// The special added tokens' ids.
    pub fn special_token_ids(&self) -> Vec<u32> {
        self.special.iter().map(|(_, id)| *id).collect()
    }

    pub fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut pending = String::new();
        for segment in &prompt.segments {
            if !segment.trusted {
                pending.push_str(&segment.text);
                continue;
            }
            let text = segment.text.as_str();
            let mut start = 0;
            for (at, len, id) in self.find_special(text) {
                pending.push_str(&text[start..at]);
                self.encode_piece(&pending, &mut ids)?;
                pending.clear();
                ids.push(id);
                start = at + len;
            }
            pending.push_str(&text[start..]);
        }
        self.encode_piece(&pending, &mut ids)?;
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.full
            .decode(ids, skip_special_tokens)
            .map_err(|e| RecipeError::internal(format!("decoding failed: {e}")))
    }

    /// Leftmost-longest special-token matches in ``text``: (byte offset, length, id).
    fn find_special<'a>(&'a self, text: &'a str) -> impl Iterator<Item = (usize, usize, u32)> + 'a {
        self.special_matcher
            .iter()
            .flat_map(move |matcher| matcher.find_iter(text))
            .map(|m| (m.start(), m.len(), self.special[m.pattern().as_usize()].1))
    }

    fn encode_piece(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        if let Some(splitter) = &self.splitter {
            if !self.plain_added.iter().any(|t| text.contains(t.as_str())) {
                return self.encode_splits(splitter, text, ids);
            }
        }
        let encoding = self
            .plain
            .encode_fast(text, false)
            .map_err(|e| RecipeError::internal(format!("tokenization failed: {e}")))?;
        ids.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    /// The fast path: ``splitter``'s splits, byte-mapped, through the tokenizer's model
    /// (as the crate's pipeline does after its pre-tokenizer).
    fn encode_splits(
        &self,
        splitter: &ByteLevelSplitter,
        text: &str,
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        let mut splits = Vec::new();
        splitter.split(text, &mut splits);
        let mut word = String::new();
        let Some(cache) = &self.cache else {
            for split in splits {
                self.tokenize_split(split, &mut word, ids)?;
            }
            return Ok(());
        };
        let mut missed = Vec::new();
        {
            let cached = cache.read().unwrap_or_else(|e| e.into_inner());
            for split in splits {
                match cached.get(split) {
                    Some(hit) => ids.extend_from_slice(hit),
                    None => {
                        let start = ids.len();
                        self.tokenize_split(split, &mut word, ids)?;
                        if split.len() <= CACHE_MAX_SPLIT {
                            missed.push((split, start..ids.len()));
                        }
                    }
                }
            }
        }
        if !missed.is_empty() {
            let mut cached = cache.write().unwrap_or_else(|e| e.into_inner());
            if cached.len() + missed.len() > CACHE_CAPACITY {
                cached.clear();
            }
            for (split, range) in missed.into_iter().take(CACHE_CAPACITY) {
                cached.insert(split.into(), ids[range].into());
            }
        }
        Ok(())
    }

    /// One split through the tokenizer's model (``word``: scratch space).
    fn tokenize_split(&self, split: &str, word: &mut String, ids: &mut Vec<u32>) -> Result<()> {
        byte_level(split, word);
        let tokens = self
            .plain
            .get_model()
            .tokenize(word)
            .map_err(|e| RecipeError::internal(format!("tokenization failed: {e}")))?;
        ids.extend(tokens.iter().map(|t| t.id));
        Ok(())
    }
}
