//! Request bodies of the three protocols -> ``EngineRequest``.
//!
//! - [`chat`]: OpenAI Chat Completions (``POST /v1/chat/completions``).
//! - [`responses`]: OpenAI Responses (``POST /v1/responses``).
//! - [`anthropic`]: Anthropic Messages (``POST /v1/messages``).
//!
//! Every parser is strict: an unknown field, role, part or block type is an
//! ``InvalidRequest`` naming its path; a known field the engine cannot honour is
//! ``Unsupported`` with a message saying to drop it. Nothing is silently dropped,
//! except the purely advisory hints listed in each module's docs.
//!
//! Normalisation (so one conversation compares equal whatever protocol it came in):
//! - content: adjacent text parts are concatenated (no separator) and empty text
//!   parts removed, so ``"content": ""`` and ``"content": null`` both become ``[]``;
//! - tool call arguments: compact JSON text (``serde_json::to_string`` of the value);
//! - reasoning: several reasoning pieces of one assistant turn are joined with "\n\n";
//! - a tool result's ``name`` is the name of the earlier call with the same id.
//!
//! ``null`` for an optional field means the field is absent (OpenAI clients send it).

pub mod anthropic;
pub mod chat;
pub mod images;
pub mod responses;

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::conversation::{
    ContentPart, EngineRequest, Protocol, ReasoningEffort, ResponseFormat, StructuredOutputs,
    Thinking, Tool, ToolCall, ToolChoice,
};
use crate::error::{child, index, RecipeError, Result};

pub use images::RemoteImages;

/// Parses a raw request body. Malformed JSON is ``InvalidRequest`` with path "" and
/// serde's line/column in the message. Remote image URLs are refused.
pub fn parse_request(protocol: Protocol, body: &[u8]) -> Result<EngineRequest> {
    parse_request_with(protocol, body, RemoteImages::Refuse)
}

/// ``parse_request``, with remote image URLs refused or deferred as ``remote`` says.
pub fn parse_request_with(
    protocol: Protocol,
    body: &[u8],
    remote: RemoteImages,
) -> Result<EngineRequest> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| RecipeError::invalid("", format!("request body is not valid JSON: {e}")))?;
    parse_value_with(protocol, &value, remote)
}

/// Parses an already-decoded request body (remote image URLs refused).
pub fn parse_value(protocol: Protocol, body: &Value) -> Result<EngineRequest> {
    parse_value_with(protocol, body, RemoteImages::Refuse)
}

/// ``parse_value``, with remote image URLs refused or deferred as ``remote`` says.
pub fn parse_value_with(
    protocol: Protocol,
    body: &Value,
    remote: RemoteImages,
) -> Result<EngineRequest> {
    let mut request = match protocol {
        Protocol::ChatCompletions => chat::parse(body),
        Protocol::Responses => responses::parse(body),
        Protocol::AnthropicMessages => anthropic::parse(body),
    }?;
    images::fit_images(&mut request, remote)?;
    Ok(request)
}

// ---------------------------------------------------------------------------
// Typed readers with path-naming errors.

pub(crate) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub(crate) fn expected(path: &str, what: &str, got: &Value) -> RecipeError {
    RecipeError::invalid(path, format!("expected {what}, got {}", type_name(got)))
}

pub(crate) fn as_object<'a>(value: &'a Value, path: &str) -> Result<&'a Map<String, Value>> {
    value
        .as_object()
        .ok_or_else(|| expected(path, "object", value))
}

pub(crate) fn as_array<'a>(value: &'a Value, path: &str) -> Result<&'a Vec<Value>> {
    value
        .as_array()
        .ok_or_else(|| expected(path, "array", value))
}

pub(crate) fn as_str<'a>(value: &'a Value, path: &str) -> Result<&'a str> {
    value
        .as_str()
        .ok_or_else(|| expected(path, "string", value))
}

pub(crate) fn as_bool(value: &Value, path: &str) -> Result<bool> {
    value
        .as_bool()
        .ok_or_else(|| expected(path, "boolean", value))
}

pub(crate) fn as_f64(value: &Value, path: &str) -> Result<f64> {
    match value {
        Value::Number(n) => n.as_f64().ok_or_else(|| expected(path, "number", value)),
        _ => Err(expected(path, "number", value)),
    }
}

pub(crate) fn as_u64(value: &Value, path: &str) -> Result<u64> {
    match value {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                Ok(u)
            } else if n.as_i64().is_some() {
                Err(RecipeError::invalid(path, format!("must be >= 0, got {n}")))
            } else {
                Err(RecipeError::invalid(
                    path,
                    format!("expected integer, got {n}"),
                ))
            }
        }
        _ => Err(expected(path, "integer", value)),
    }
}

pub(crate) fn as_u32(value: &Value, path: &str) -> Result<u32> {
    let n = as_u64(value, path)?;
    u32::try_from(n).map_err(|_| RecipeError::invalid(path, format!("{n} is too large")))
}

/// A JSON object read field by field; every error names the field's full path.
pub(crate) struct Fields<'a> {
    pub map: &'a Map<String, Value>,
    pub path: String,
}

impl<'a> Fields<'a> {
    pub fn new(value: &'a Value, path: &str) -> Result<Fields<'a>> {
        Ok(Fields {
            map: as_object(value, path)?,
            path: path.to_string(),
        })
    }

    pub fn at(&self, key: &str) -> String {
        child(&self.path, key)
    }

    /// Every key must be in ``known`` (an unknown one is an error naming its path).
    pub fn check_known(&self, known: &[&str]) -> Result<()> {
        for key in self.map.keys() {
            if !known.contains(&key.as_str()) {
                return Err(RecipeError::invalid(
                    self.at(key),
                    format!("unknown field `{key}`"),
                ));
            }
        }
        Ok(())
    }

    /// The value, or None when absent or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn missing(&self, key: &str) -> RecipeError {
        RecipeError::invalid(self.at(key), format!("missing required field `{key}`"))
    }

    pub fn require(&self, key: &str) -> Result<&'a Value> {
        self.get(key).ok_or_else(|| self.missing(key))
    }

    pub fn str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key).map(|v| as_str(v, &self.at(key))).transpose()
    }

    pub fn req_str(&self, key: &str) -> Result<&'a str> {
        as_str(self.require(key)?, &self.at(key))
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| as_bool(v, &self.at(key))).transpose()
    }

    pub fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| as_f64(v, &self.at(key))).transpose()
    }

    pub fn u32(&self, key: &str) -> Result<Option<u32>> {
        self.get(key).map(|v| as_u32(v, &self.at(key))).transpose()
    }

    pub fn u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key).map(|v| as_u64(v, &self.at(key))).transpose()
    }

    pub fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>> {
        self.get(key)
            .map(|v| as_array(v, &self.at(key)))
            .transpose()
    }

    pub fn object(&self, key: &str) -> Result<Option<Fields<'a>>> {
        self.get(key)
            .map(|v| Fields::new(v, &self.at(key)))
            .transpose()
    }

    /// A known field the engine cannot honour: Unsupported when present (not null).
    pub fn reject(&self, key: &str, why: &str) -> Result<()> {
        if self.get(key).is_some() {
            return Err(unsupported_field(&self.at(key), key, why));
        }
        Ok(())
    }

    /// Number in a range; ``low_open`` excludes the lower bound.
    pub fn f64_in(&self, key: &str, low: f64, high: f64, low_open: bool) -> Result<Option<f64>> {
        let Some(x) = self.f64(key)? else {
            return Ok(None);
        };
        let low_ok = if low_open { x > low } else { x >= low };
        if !low_ok || x > high {
            let bracket = if low_open { "(" } else { "[" };
            return Err(RecipeError::invalid(
                self.at(key),
                format!("must be in {bracket}{low}, {high}], got {x}"),
            ));
        }
        Ok(Some(x))
    }

    /// Integer >= 1 (token counts, n).
    pub fn positive_u32(&self, key: &str) -> Result<Option<u32>> {
        let Some(x) = self.u32(key)? else {
            return Ok(None);
        };
        if x < 1 {
            return Err(RecipeError::invalid(self.at(key), "must be >= 1, got 0"));
        }
        Ok(Some(x))
    }
}

pub(crate) fn unsupported_field(path: &str, key: &str, why: &str) -> RecipeError {
    RecipeError::unsupported(
        path,
        format!("`{key}` is not supported by this engine ({why}); drop the field"),
    )
}

/// Tool names: ``^[A-Za-z0-9_-]{1,64}$``.
pub(crate) fn check_tool_name(name: &str, path: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !ok {
        return Err(RecipeError::invalid(
            path,
            format!("tool name {name:?} must match ^[A-Za-z0-9_-]{{1,64}}$"),
        ));
    }
    Ok(())
}

/// Call ids: any non-empty string.
pub(crate) fn check_call_id(id: &str, path: &str) -> Result<()> {
    if id.is_empty() {
        return Err(RecipeError::invalid(path, "must not be empty"));
    }
    Ok(())
}

/// A tool call's argument text, re-serialised compactly; invalid JSON is an error.
pub(crate) fn compact_arguments(text: &str, path: &str) -> Result<String> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        RecipeError::invalid(path, format!("arguments must be valid JSON text: {e}"))
    })?;
    compact_value(&value)
}

pub(crate) fn compact_value(value: &Value) -> Result<String> {
    serde_json::to_string(value)
        .map_err(|e| RecipeError::internal(format!("serialising JSON: {e}")))
}

/// Empty text parts removed; the others kept apart, since encoders join them
/// differently (a chat template's string content concatenates them, DeepSeek's
/// encoding puts a blank line between them).
pub(crate) fn normalize_content(parts: Vec<ContentPart>) -> Vec<ContentPart> {
    parts
        .into_iter()
        .filter(|part| !matches!(part, ContentPart::Text { text } if text.is_empty()))
        .collect()
}

/// Joins reasoning pieces of one turn.
pub(crate) fn append_reasoning(slot: &mut Option<String>, text: &str) {
    match slot {
        Some(existing) => {
            existing.push_str("\n\n");
            existing.push_str(text);
        }
        None => *slot = Some(text.to_string()),
    }
}

/// Remembers the tool calls seen so far, so a tool result can be checked against
/// (and named from) the call it answers.
#[derive(Default)]
pub(crate) struct CallTracker {
    names: HashMap<String, String>,
}

impl CallTracker {
    pub fn record(&mut self, calls: &[ToolCall]) {
        for call in calls {
            self.names.insert(call.id.clone(), call.name.clone());
        }
    }

    /// The name of the earlier call with this id; an unknown id is an error at ``path``.
    pub fn resolve(&self, id: &str, path: &str) -> Result<String> {
        self.names.get(id).cloned().ok_or_else(|| {
            RecipeError::invalid(
                path,
                format!("tool result for call id {id:?} does not follow a tool call with that id"),
            )
        })
    }
}

/// A protocol's reasoning-effort field, as DeepSeek's own adapter reads it in every
/// protocol: "none" turns thinking off unless the request turned it on explicitly
/// (an explicit thinking setting wins); any other level sets the effort (and leaves
/// thinking to its explicit setting or the model's default).
pub(crate) fn apply_effort(thinking: &mut Thinking, value: &str, path: &str) -> Result<()> {
    let effort = match value {
        "none" => {
            thinking.enabled.get_or_insert(false);
            return Ok(());
        }
        "minimal" => ReasoningEffort::Minimal,
        "low" => ReasoningEffort::Low,
        "medium" => ReasoningEffort::Medium,
        "high" => ReasoningEffort::High,
        "xhigh" => ReasoningEffort::Xhigh,
        "max" => ReasoningEffort::Max,
        other => {
            return Err(RecipeError::invalid(
                path,
                format!("unknown reasoning effort {other:?} (expected none, minimal, low, medium, high, xhigh or max)"),
            ))
        }
    };
    thinking.effort = Some(effort);
    Ok(())
}

/// Metadata: an object of string values (OpenAI's rule).
pub(crate) fn string_map(value: &Value, path: &str) -> Result<Map<String, Value>> {
    let map = as_object(value, path)?;
    for (key, v) in map {
        as_str(v, &child(path, key))?;
    }
    Ok(map.clone())
}

/// A string or an array of strings (``stop``).
pub(crate) fn string_or_list(value: &Value, path: &str) -> Result<Vec<String>> {
    match value {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| as_str(v, &index(path, i)).map(str::to_string))
            .collect(),
        other => Err(expected(path, "string or array of strings", other)),
    }
}

/// The ``structured_outputs`` extension field: an object with exactly one of ``json``
/// (a schema), ``regex``, ``grammar`` (Lark) or ``choice`` (strings); refused next to a
/// response format other than text (one constraint per request).
pub(crate) fn parse_structured_outputs(
    top: &Fields,
    response_format: &ResponseFormat,
    format_path: &str,
) -> Result<Option<StructuredOutputs>> {
    let Some(f) = top.object("structured_outputs")? else {
        return Ok(None);
    };
    f.check_known(&["json", "regex", "grammar", "choice"])?;
    let given: Vec<&String> = f.map.keys().collect();
    if given.len() != 1 {
        return Err(RecipeError::invalid(
            f.path.clone(),
            "give exactly one of `json`, `regex`, `grammar` or `choice`",
        ));
    }
    if *response_format != ResponseFormat::Text {
        return Err(RecipeError::invalid(
            format_path,
            "a JSON response format and `structured_outputs` cannot be combined; give one",
        ));
    }
    let key = given[0].as_str();
    let value = f.require(key)?;
    let constraint = match key {
        "json" => StructuredOutputs::Json(schema_object(value, &f.at(key))?),
        "regex" => StructuredOutputs::Regex(as_str(value, &f.at(key))?.to_string()),
        "grammar" => StructuredOutputs::Grammar(as_str(value, &f.at(key))?.to_string()),
        _ => {
            let items = as_array(value, &f.at(key))?;
            if items.is_empty() {
                return Err(RecipeError::invalid(f.at(key), "needs at least one string"));
            }
            let choices = items
                .iter()
                .enumerate()
                .map(|(i, item)| as_str(item, &index(&f.at(key), i)).map(str::to_string))
                .collect::<Result<Vec<_>>>()?;
            StructuredOutputs::Choice(choices)
        }
    };
    Ok(Some(constraint))
}

/// A JSON schema slot (tool parameters, response schemas): must be an object.
pub(crate) fn schema_object(value: &Value, path: &str) -> Result<Value> {
    as_object(value, path)?;
    Ok(value.clone())
}

/// ``service_tier``, which both OpenAI protocols carry: only the values that change
/// nothing here are accepted.
pub(crate) fn check_openai_options(top: &Fields) -> Result<()> {
    if let Some(tier) = top.str("service_tier")? {
        if tier != "auto" && tier != "default" {
            return Err(unsupported_field(
                &top.at("service_tier"),
                "service_tier",
                "service tiers",
            ));
        }
    }
    Ok(())
}

/// Whether the request allows at most one tool call (``parallel_tool_calls: false``,
/// ``disable_parallel_tool_use: true``, at ``path``). It is enforced by constraining a
/// forced call (required: exactly one; a named tool is one call anyway); under ``auto``
/// nothing holds the model to one call, so that combination is refused rather than
/// promised.
pub(crate) fn single_tool_call(
    single: bool,
    choice: &ToolChoice,
    tools: &[Tool],
    path: &str,
    field: &str,
) -> Result<bool> {
    if single && *choice == ToolChoice::Auto && !tools.is_empty() {
        return Err(RecipeError::invalid(
            path,
            format!("{field} limits the model to one tool call, which this server enforces only when the call is forced: use tool_choice \"required\" (or a named tool) with it, or drop {field}"),
        ));
    }
    Ok(single)
}

/// ``parallel_tool_calls: false``, which both OpenAI protocols carry (see ``single_tool_call``).
pub(crate) fn openai_single_tool_call(
    top: &Fields,
    choice: &ToolChoice,
    tools: &[Tool],
) -> Result<bool> {
    single_tool_call(
        top.bool("parallel_tool_calls")? == Some(false),
        choice,
        tools,
        &top.at("parallel_tool_calls"),
        "parallel_tool_calls: false",
    )
}

/// OpenAI's ``safety_identifier`` and ``prompt_cache_key`` (strings, carried as
/// given) and ``prompt_cache_retention`` (only "in_memory", what a prefix cache in
/// this process's memory is, is accepted).
pub(crate) fn openai_identifiers(top: &Fields) -> Result<(Option<String>, Option<String>)> {
    let safety_identifier = top.str("safety_identifier")?.map(str::to_string);
    let prompt_cache_key = top.str("prompt_cache_key")?.map(str::to_string);
    if let Some(retention) = top.str("prompt_cache_retention")? {
        match retention {
            "in-memory" | "in_memory" => {}
            "24h" => {
                return Err(unsupported_field(
                    &top.at("prompt_cache_retention"),
                    "prompt_cache_retention",
                    "extended prompt cache retention; the prefix cache lives in memory",
                ))
            }
            other => {
                return Err(RecipeError::invalid(
                    top.at("prompt_cache_retention"),
                    format!("unknown prompt_cache_retention {other:?} (expected in_memory or 24h)"),
                ))
            }
        }
    }
    Ok((safety_identifier, prompt_cache_key))
}

/// OpenAI's ``metadata``: string values only (absent means empty).
pub(crate) fn openai_metadata(top: &Fields) -> Result<Map<String, Value>> {
    match top.get("metadata") {
        Some(v) => string_map(v, &top.at("metadata")),
        None => Ok(Map::new()),
    }
}

/// The string forms of an OpenAI ``tool_choice``.
pub(crate) fn openai_tool_choice_word(word: &str, path: &str) -> Result<ToolChoice> {
    match word {
        "auto" => Ok(ToolChoice::Auto),
        "none" => Ok(ToolChoice::None),
        "required" => Ok(ToolChoice::Required),
        other => Err(RecipeError::invalid(
            path,
            format!("unknown tool_choice {other:?} (expected auto, none, required or an object)"),
        )),
    }
}

/// A function tool's ``name`` / ``description`` / ``parameters`` / ``strict`` (where
/// Chat Completions nests them under ``function`` and Responses does not): the name
/// checked and unique among ``earlier``, the parameters a schema object.
pub(crate) fn function_tool(f: &Fields, earlier: &[Tool]) -> Result<Tool> {
    let name = f.req_str("name")?;
    check_tool_name(name, &f.at("name"))?;
    if earlier.iter().any(|existing| existing.name == name) {
        return Err(RecipeError::invalid(
            f.at("name"),
            format!("duplicate tool name {name:?}"),
        ));
    }
    let description = f.str("description")?.map(str::to_string);
    let parameters = match f.get("parameters") {
        Some(v) => schema_object(v, &f.at("parameters"))?,
        None => empty_parameters(),
    };
    let strict = f.bool("strict")?.unwrap_or(false);
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
        strict,
    })
}

/// The schema a tool without ``parameters`` gets.
pub(crate) fn empty_parameters() -> Value {
    serde_json::json!({"type": "object", "properties": {}})
}
