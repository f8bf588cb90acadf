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
//!
//! Not reproduced: added tokens with ``normalized: true`` are matched on the raw text
//! (HF matches them on normalized text), their ``lstrip``/``rstrip``/``single_word``
//! flags are ignored, and a Metaspace pre-tokenizer with ``prepend_scheme: "first"``
//! sees each piece as a first piece. None of these matter for byte-level BPE
//! tokenizers (SmolLM2, Llama 3, Qwen, DeepSeek).

use tokenizers::{Model, Tokenizer};

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
    /// The fast path past the crate's pre-tokenizer, where it gives the same splits.
    splitter: Option<ByteLevelSplitter>,
    /// Non-special added tokens: a piece containing one takes the crate's pipeline.
    plain_added: Vec<String>,
}

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
        Ok(PromptTokenizer {
            plain,
            full,
            special,
            splitter,
            plain_added,
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
    fn find_special(&self, text: &str) -> Vec<(usize, usize, u32)> {
        let mut found = Vec::new();
        if self.special.is_empty() {
            return found;
        }
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            // Only check at char boundaries; tokens are longest first.
            if text.is_char_boundary(i) {
                if let Some((s, id)) = self
                    .special
                    .iter()
                    .find(|(s, _)| bytes[i..].starts_with(s.as_bytes()))
                {
                    found.push((i, s.len(), *id));
                    i += s.len();
                    continue;
                }
            }
            i += 1;
        }
        found
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
        let model = self.plain.get_model();
        let mut splits = Vec::new();
        splitter.split(text, &mut splits);
        let mut word = String::new();
        for split in splits {
            byte_level(split, &mut word);
            let tokens = model
                .tokenize(&word)
                .map_err(|e| RecipeError::internal(format!("tokenization failed: {e}")))?;
            ids.extend(tokens.iter().map(|t| t.id));
        }
        Ok(())
    }
}
