//! The one typed conversation every protocol parses into, and the request around it.
//!
//! Chat Completions, Responses and Anthropic Messages say the same things in three
//! shapes; after parsing nothing downstream (rendering, tokenizing, the engine)
//! knows which protocol a request came in. Two requests that mean the same
//! conversation compare equal here, which is what makes "the same prompt from every
//! protocol" testable.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::image_fit::{ImageDetail, ImageFit};
use serde_json::{Map, Value};

/// Which wire protocol a request arrived in (and its response must leave in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    ChatCompletions,
    Responses,
    AnthropicMessages,
}

impl Protocol {
    pub fn parse(name: &str) -> Option<Protocol> {
        match name {
            "chat_completions" | "chat.completions" | "openai_chat" => {
                Some(Protocol::ChatCompletions)
            }
            "responses" | "openai_responses" => Some(Protocol::Responses),
            "anthropic_messages" | "messages" | "anthropic" => Some(Protocol::AnthropicMessages),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    /// OpenAI's "developer" messages: system-level instructions from the application.
    Developer,
    User,
    Assistant,
    Tool,
}

/// One piece of a message's content. An image is inline data, checked when parsed
/// (``protocols::images``): its data URL, its size in pixels and the detail asked for;
/// or, where the caller lets remote images through, an ``http(s)`` URL whose size is
/// known only once the server has fetched it (``width`` and ``height`` 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text {
        text: String,
    },
    Image {
        url: String,
        #[serde(default)]
        width: u32,
        #[serde(default)]
        height: u32,
        #[serde(default)]
        detail: ImageDetail,
        /// Where the part was and its decoded bytes: not part of what it means.
        #[serde(skip)]
        source: ImageSource,
    },
}

/// What the adapter keeps of an image part besides its meaning: where in the request
/// body it was (errors found later, when the server decodes or fetches it, name that
/// field) and the bytes its base64 decoded to (so the server does not decode it again).
///
/// It compares equal to every other source: the same image sent in two protocols sits
/// at two different paths, and its bytes are already in the part's ``url``.
#[derive(Debug, Clone, Default)]
pub struct ImageSource {
    /// The field path of the image in the request body (``messages[0].content[1].image_url.url``).
    pub path: String,
    /// The declared media type of inline data; None for a remote URL.
    pub media_type: Option<String>,
    /// The decoded bytes of inline data; None for a remote URL.
    pub data: Option<Arc<[u8]>>,
}

impl PartialEq for ImageSource {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl ImageSource {
    /// Whether the image is a remote URL still to fetch.
    pub fn is_remote(&self) -> bool {
        self.data.is_none()
    }
}

/// One image of a request as the server needs it, in placeholder order: where it was,
/// what it claims to be, its size (0 for a remote image not fetched yet) and V4.1's
/// preprocessed size and token count (None until its size is known).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImagePart {
    pub path: String,
    /// The declared media type of inline data; None for a remote URL.
    pub media_type: Option<String>,
    pub detail: ImageDetail,
    pub width: u32,
    pub height: u32,
    pub fit: Option<ImageFit>,
    /// The remote URL to fetch; None for inline data.
    pub url: Option<String>,
    /// The decoded bytes of inline data (the Python binding hands them over as ``bytes``).
    #[serde(skip)]
    pub data: Option<Arc<[u8]>>,
}

/// An assistant's call of a tool; ``arguments`` is the JSON text the model produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: Vec<ContentPart>,
    /// An assistant turn's reasoning ("thinking") text, when the history carries it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's tool name (Anthropic and Responses do not always say it; it is
    /// filled from the matching call when the history has one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A tool result that reports a failure (Anthropic's ``tool_result.is_error``).
    #[serde(default, skip_serializing_if = "is_false")]
    pub is_error: bool,
}

fn is_false(value: &bool) -> bool {
    !*value
}

impl Message {
    pub fn text(role: Role, text: impl Into<String>) -> Message {
        Message {
            role,
            content: vec![ContentPart::Text { text: text.into() }],
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            is_error: false,
        }
    }

    /// The text parts joined (what a text-only template sees as ``content``).
    pub fn joined_text(&self) -> String {
        self.content
            .iter()
            .filter_map(|part| match part {
                ContentPart::Text { text } => Some(text.as_str()),
                ContentPart::Image { .. } => None,
            })
            .collect::<Vec<_>>()
            .join("")
    }
}

/// A function the model may call; ``parameters`` is its JSON schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub parameters: Value,
    /// The caller asked for arguments that follow ``parameters`` exactly (OpenAI's and
    /// Anthropic's ``strict``): the engine then constrains a forced call's arguments.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub strict: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "type", content = "name", rename_all = "snake_case")]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    Named(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffort {
    Minimal,
    Low,
    Medium,
    High,
    Xhigh,
    Max,
}

/// Responses' ``reasoning.summary``: the client wants reasoning as summary parts.
/// This engine has no summariser: whichever level is asked for, the summary is the
/// model's whole reasoning text (see ``output::response``).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningSummary {
    Auto,
    Concise,
    Detailed,
}

/// Thinking mode: ``enabled`` None leaves it to the model's default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Thinking {
    pub enabled: Option<bool>,
    pub effort: Option<ReasoningEffort>,
    /// Anthropic's thinking budget in tokens, when given.
    pub budget_tokens: Option<u32>,
    /// Anthropic's ``{"type": "adaptive"}``: thinking is on (``enabled`` is Some(true))
    /// and the model decides how much to think, with no token budget.
    #[serde(default, skip_serializing_if = "is_false")]
    pub adaptive: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Conversation {
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    pub thinking: Thinking,
    /// At most one tool call (OpenAI's ``parallel_tool_calls: false``, Anthropic's
    /// ``disable_parallel_tool_use``): a required call is then constrained to exactly one.
    #[serde(default, skip_serializing_if = "is_false")]
    pub single_tool_call: bool,
}

impl Conversation {
    /// How many image parts its messages carry.
    pub fn image_count(&self) -> usize {
        self.messages
            .iter()
            .flat_map(|m| &m.content)
            .filter(|p| matches!(p, ContentPart::Image { .. }))
            .count()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    #[default]
    Text,
    JsonObject,
    JsonSchema {
        name: String,
        schema: Value,
        strict: bool,
    },
}

/// powertrain's extension field ``structured_outputs`` (vLLM's spelling and keys):
/// constrain the output to a JSON schema, a regular expression, a Lark grammar or one
/// of several strings. One per request, and not together with a JSON response format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum StructuredOutputs {
    Json(Value),
    Regex(String),
    Grammar(String),
    Choice(Vec<String>),
}

/// What the sampler is asked for; None means the engine's default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingSettings {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u32>,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    pub n: u32,
    /// Log-probabilities of the chosen tokens were asked for.
    pub logprobs: bool,
    /// How many alternatives per position, when logprobs are on.
    pub top_logprobs: Option<u32>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    // vLLM's sampling extensions (Chat Completions only).
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub min_tokens: Option<u32>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    /// Keep the matched stop string in the output text instead of cutting it.
    pub include_stop_str_in_output: bool,
    /// Leave special tokens (e.g. an end-of-turn token generated under ``ignore_eos``)
    /// out of the output text; vLLM's default is true.
    pub skip_special_tokens: bool,
    /// OpenAI's ``logit_bias``: (token id, bias in [-100, 100]) pairs.
    pub logit_bias: Vec<(u32, f64)>,
}

impl Default for SamplingSettings {
    fn default() -> Self {
        SamplingSettings {
            temperature: None,
            top_p: None,
            top_k: None,
            max_tokens: None,
            stop: Vec::new(),
            seed: None,
            n: 1,
            logprobs: false,
            top_logprobs: None,
            presence_penalty: None,
            frequency_penalty: None,
            min_p: None,
            repetition_penalty: None,
            min_tokens: None,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            logit_bias: Vec::new(),
        }
    }
}

/// A parsed request: everything the engine needs, protocol-free except for the
/// protocol to answer in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineRequest {
    pub protocol: Protocol,
    pub model: String,
    pub conversation: Conversation,
    pub sampling: SamplingSettings,
    pub response_format: ResponseFormat,
    pub stream: bool,
    /// Chat Completions' stream_options.include_usage (the other protocols always report usage).
    pub include_usage: bool,
    /// Responses' ``reasoning.summary``, when asked for: reasoning output then goes
    /// into the reasoning item's ``summary`` instead of its ``content``.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_summary: Option<ReasoningSummary>,
    pub metadata: Map<String, Value>,
    /// A caller-chosen end-user id, when the protocol carries one (OpenAI's older
    /// ``user``, Anthropic's ``metadata.user_id``).
    pub user: Option<String>,
    /// OpenAI's ``safety_identifier``: a stable id of the end user for abuse
    /// detection. Carried, affects nothing here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safety_identifier: Option<String>,
    /// OpenAI's ``prompt_cache_key``: a routing hint for prompt caching. The prefix
    /// cache works on token ids whatever the key; carried, affects nothing here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_cache_key: Option<String>,
    /// The ``structured_outputs`` extension field, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
    /// How many image parts the conversation carries (a model without a vision
    /// encoder refuses the request when there are any).
    #[serde(default)]
    pub images: usize,
    /// Each inline image's preprocessed size and token count, in placeholder order: what
    /// an engine with V4.1's vision encoder expands each image placeholder to. A remote
    /// image (let through by ``protocols::ImagePolicy``) has none until it is fetched.
    #[serde(default)]
    pub image_fits: Vec<ImageFit>,
    /// Every image part, in placeholder order (``images`` of them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_parts: Vec<ImagePart>,
}
