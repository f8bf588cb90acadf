//! Conversation -> prompt text, as segments (see ``Segment``).

use serde::{Deserialize, Serialize};

/// A piece of a rendered prompt. Template text may spell special tokens; text that
/// came from a user, a tool or a document is ``trusted: false`` and is always
/// tokenized as plain text, so typing ``<|im_end|>`` cannot inject a control token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub text: String,
    pub trusted: bool,
}

/// A rendered prompt: its segments, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Prompt {
    pub segments: Vec<Segment>,
}

impl Prompt {
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect()
    }
}

pub mod deepseek_v4;
pub mod hf_template;

pub use deepseek_v4::{render_deepseek_v4, render_v4_family, Version};
pub use hf_template::ChatTemplate;

use serde_json::Value;

use crate::conversation::{Conversation, EngineRequest, ResponseFormat};
use crate::error::{RecipeError, Result};

impl Segment {
    pub fn trusted(text: impl Into<String>) -> Segment {
        Segment {
            text: text.into(),
            trusted: true,
        }
    }

    pub fn untrusted(text: impl Into<String>) -> Segment {
        Segment {
            text: text.into(),
            trusted: false,
        }
    }
}

impl Prompt {
    /// Appends text, merging it into the last segment when the trust matches.
    /// Empty text is dropped.
    pub fn push(&mut self, text: &str, trusted: bool) {
        if text.is_empty() {
            return;
        }
        match self.segments.last_mut() {
            Some(last) if last.trusted == trusted => last.text.push_str(text),
            _ => self.segments.push(Segment {
                text: text.to_string(),
                trusted,
            }),
        }
    }

    pub fn push_trusted(&mut self, text: &str) {
        self.push(text, true);
    }

    pub fn push_untrusted(&mut self, text: &str) {
        self.push(text, false);
    }

    /// Appends every segment of ``other``.
    pub fn extend(&mut self, other: Prompt) {
        for segment in other.segments {
            self.push(&segment.text, segment.trusted);
        }
    }
}

/// How a model's conversations become prompt text.
#[derive(Debug)]
pub enum Encoder {
    /// The model's Hugging Face chat template (tokenizer_config.json ``chat_template``).
    HfTemplate(Box<ChatTemplate>),
    /// DeepSeek's native V4 or V4.1 encoder (the model ships no chat template).
    Deepseek(Version),
}

impl Encoder {
    /// Picks the encoder from the model's tokenizer_config.json and config.json.
    ///
    /// DeepSeek-V4 (``model_type`` "deepseek_v4", or an architecture name containing
    /// "DeepseekV4") always uses the native encoder; so does a DeepSeek V3.2-style
    /// model (``model_type`` "deepseek_v32" or architecture "DeepseekV32") without a
    /// chat template (V3.2 shares V4's encoder apart from the tool-call block name;
    /// see ``deepseek_v4``). Otherwise the template from ``chat_template`` (a string,
    /// or a list of ``{name, template}`` where "default" wins, else the first) is used,
    /// with ``bos_token``/``eos_token`` read as a string or an AddedToken dict.
    pub fn from_metadata(tokenizer_config: &Value, model_config: &Value) -> Result<Encoder> {
        let model_type = model_config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        let architectures: Vec<&str> = model_config
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let is_v4 = model_type == "deepseek_v4"
            || model_type == "deepseek_v41"
            || architectures.iter().any(|a| a.contains("DeepseekV4"));
        let is_v32 =
            model_type == "deepseek_v32" || architectures.iter().any(|a| a.contains("DeepseekV32"));
        let template = chat_template_source(tokenizer_config)?;
        if is_v4 && is_v41(tokenizer_config, model_config) {
            return Ok(Encoder::Deepseek(Version::V41));
        }
        if is_v4 || (is_v32 && template.is_none()) {
            return Ok(Encoder::Deepseek(Version::V4));
        }
        let Some(source) = template else {
            return Err(RecipeError::internal(
                "the model's tokenizer_config.json has no chat_template and no native encoder fits its model_type",
            ));
        };
        let bos = token_text(tokenizer_config.get("bos_token"));
        let eos = token_text(tokenizer_config.get("eos_token"));
        Ok(Encoder::HfTemplate(Box::new(ChatTemplate::new(
            &source,
            bos.as_deref(),
            eos.as_deref(),
        )?)))
    }

    /// Renders a parsed request: its conversation and, for DeepSeek's encodings, its
    /// response format (the JSON formats add instructions to the system text).
    pub fn render_request(
        &self,
        request: &EngineRequest,
        add_generation_prompt: bool,
    ) -> Result<Prompt> {
        match self {
            Encoder::Deepseek(version) => render_v4_family(
                &request.conversation,
                &request.response_format,
                add_generation_prompt,
                *version,
            ),
            Encoder::HfTemplate(template) => template
                .render(&request.conversation, add_generation_prompt)
                .map_err(|mut e| {
                    // A text-only template that cannot show the request's images.
                    if request.images > 0 && e.kind == crate::error::ErrorKind::Unsupported {
                        e.message = format!(
                            "model {:?} has no vision encoder and takes text only (its chat template cannot render image parts); remove the {} image part(s)",
                            request.model, request.images
                        );
                    }
                    e
                }),
        }
    }

    pub fn render(
        &self,
        conversation: &Conversation,
        add_generation_prompt: bool,
    ) -> Result<Prompt> {
        match self {
            Encoder::HfTemplate(template) => template.render(conversation, add_generation_prompt),
            Encoder::Deepseek(version) => render_v4_family(
                conversation,
                &ResponseFormat::Text,
                add_generation_prompt,
                *version,
            ),
        }
    }
}

/// A V4-architecture checkpoint is V4.1 (V4.1-Flash) when config.json says
/// ``"chat_encoding": "deepseek_v41"`` (an override a deployment may add), its
/// ``model_type`` is "deepseek_v41" or an architecture is V4.1's
/// (``DeepseekV41ForCausalLM``, as the transformers pull request names it), or its
/// ``_name_or_path`` or tokenizer_config.json's ``name_or_path`` names V4.1 (as
/// ``deepseek-ai/DeepSeek-V4.1-Flash`` does). DeepSeek's own adapter chooses by the
/// request's model name instead.
fn is_v41(tokenizer_config: &Value, model_config: &Value) -> bool {
    if let Some(encoding) = model_config.get("chat_encoding").and_then(Value::as_str) {
        return encoding == "deepseek_v41";
    }
    let architecture = model_config
        .get("architectures")
        .and_then(Value::as_array)
        .is_some_and(|names| {
            names
                .iter()
                .filter_map(Value::as_str)
                .any(|a| a.contains("DeepseekV41"))
        });
    if architecture
        || model_config.get("model_type").and_then(Value::as_str) == Some("deepseek_v41")
    {
        return true;
    }
    [
        model_config.get("_name_or_path"),
        tokenizer_config.get("name_or_path"),
    ]
    .into_iter()
    .flatten()
    .filter_map(Value::as_str)
    .any(|name| name.to_ascii_lowercase().contains("v4.1"))
}

fn chat_template_source(tokenizer_config: &Value) -> Result<Option<String>> {
    match tokenizer_config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named: Vec<(&str, &str)> = list
                .iter()
                .filter_map(|item| {
                    Some((item.get("name")?.as_str()?, item.get("template")?.as_str()?))
                })
                .collect();
            Ok(named
                .iter()
                .find(|(name, _)| *name == "default")
                .or_else(|| named.first())
                .map(|(_, t)| t.to_string()))
        }
        Some(_) => Err(RecipeError::internal(
            "tokenizer_config.json: chat_template is neither a string nor a list",
        )),
    }
}

fn token_text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// Python's ``json.dumps(value, ensure_ascii=.., indent=.., sort_keys=..)`` with its
/// default separators (``", "`` and ``": "``; ``","`` at line ends when indenting),
/// which both HF's ``tojson`` and DeepSeek's ``to_json`` use.
pub fn python_json_dumps(
    value: &Value,
    ensure_ascii: bool,
    indent: Option<usize>,
    sort_keys: bool,
) -> String {
    let mut out = String::new();
    let style = Style {
        ascii: ensure_ascii,
        indent,
        sort: sort_keys,
        numbers: Numbers::Python,
    };
    dump(value, &style, 0, &mut out);
    out
}

/// JSON as DeepSeek's own adapter (``deepseek-recipe``) writes it into V4 / V4.1
/// prompts: ``python_json_dumps``' spacing, unicode kept, keys in order, but floats in
/// scientific notation below 1e-5 with an unpadded exponent (``1e-6``, where Python
/// writes ``1e-06``) and from 1e16 up as Python does (``1e+16``).
pub fn deepseek_json_dumps(value: &Value) -> String {
    let mut out = String::new();
    let style = Style {
        ascii: false,
        indent: None,
        sort: false,
        numbers: Numbers::DeepseekRecipe,
    };
    dump(value, &style, 0, &mut out);
    out
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Numbers {
    Python,
    DeepseekRecipe,
}

struct Style {
    ascii: bool,
    indent: Option<usize>,
    sort: bool,
    numbers: Numbers,
}

fn dump(value: &Value, style: &Style, level: usize, out: &mut String) {
    let Style {
        ascii,
        indent,
        sort,
        numbers,
    } = *style;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&json_number(n, numbers)),
        Value::String(s) => dump_str(s, ascii, out),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                dump(item, style, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                dump_str(key, ascii, out);
                out.push_str(": ");
                dump(item, style, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

fn json_number(n: &serde_json::Number, numbers: Numbers) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let Some(f) = n.as_f64() else {
        return n.to_string();
    };
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Python's repr(float): shortest round-trip digits, scientific notation when the
    // exponent is < -4 or >= 16, written as "1e-05" / "1.5e+16". DeepSeek's adapter:
    // the same from 1e16 up, but scientific only below 1e-5, written "1e-6".
    let sci = format!("{:e}", f); // shortest digits, e.g. "1.5e16", "1e-5"
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return sci;
    };
    let Ok(exp) = exp.parse::<i32>() else {
        return sci;
    };
    let smallest_positional = match numbers {
        Numbers::Python => -4,
        Numbers::DeepseekRecipe => -5,
    };
    if !(smallest_positional..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        match numbers {
            Numbers::Python => format!("{mantissa}e{sign}{:02}", exp.abs()),
            Numbers::DeepseekRecipe => format!("{mantissa}e{sign}{}", exp.abs()),
        }
    } else {
        let s = format!("{}", f);
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    }
}

fn dump_str(s: &str, ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ascii && (c as u32) > 0x7f => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
