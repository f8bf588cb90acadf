//! Non-streaming response bodies for each protocol, built from parser events.
//!
//! Ids: the caller passes the response id (`chatcmpl-…`, `resp_…`, `msg_…`). Responses
//! output items get ids derived from it and their output index
//! ([`responses_item_id`]), the same in the streaming and non-streaming forms.
//! Anthropic's `usage.input_tokens` counts prompt tokens not read from the cache
//! (`prompt_tokens - cached_prompt_tokens`), as Anthropic defines it.
//!
//! Responses reasoning items: by default the reasoning is the item's `content`
//! (`[{"type": "reasoning_text", "text"}]`, as OpenAI's API returns an open-weight
//! model's raw reasoning) with `summary: []`. When the request asked for a summary
//! (`reasoning.summary`, [`ResponseBuilder::set_reasoning_summary`]) the reasoning is
//! the item's `summary` (`[{"type": "summary_text", "text"}]`) and `content` is left
//! out, as the API shapes a summarised reasoning item. There is no summariser here:
//! the "summary" is the whole reasoning text, whatever level was asked for.

use serde_json::{json, Map, Value};

use crate::conversation::{Protocol, ToolCall};
use crate::output::parser::OutputEvent;

/// Token counts for one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u32,
    /// Completion tokens spent on reasoning (part of `completion_tokens`).
    pub reasoning_tokens: u32,
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// End of turn (EOS / end-of-turn token).
    Stop,
    /// max_tokens (or the context) ran out.
    Length,
    /// The model called tools.
    ToolCalls,
    /// A caller's stop sequence matched (the string).
    StopSequence(String),
}

impl FinishReason {
    pub fn chat_completions(&self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopSequence(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }

    pub fn anthropic(&self) -> &'static str {
        match self {
            FinishReason::Stop => "end_turn",
            FinishReason::Length => "max_tokens",
            FinishReason::ToolCalls => "tool_use",
            FinishReason::StopSequence(_) => "stop_sequence",
        }
    }

    pub fn stop_sequence(&self) -> Option<&str> {
        match self {
            FinishReason::StopSequence(s) => Some(s),
            _ => None,
        }
    }
}

/// One piece of the output, in order; adjacent deltas of one kind are merged.
#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    Reasoning(String),
    Text(String),
    ToolCall(ToolCall),
}

/// Accumulates parser events into the whole output.
#[derive(Debug, Clone, Default)]
pub struct ResponseBuilder {
    segments: Vec<Segment>,
    stopped: Option<String>,
    /// Segment position of each open or finished tool call, by call index.
    calls: Vec<(usize, usize)>,
    /// Responses: reasoning goes into the item's `summary` rather than its `content`.
    reasoning_summary: bool,
}

impl ResponseBuilder {
    pub fn new() -> ResponseBuilder {
        ResponseBuilder::default()
    }

    /// Responses only: the request asked for a reasoning summary (see the module doc).
    pub fn set_reasoning_summary(&mut self, on: bool) {
        self.reasoning_summary = on;
    }

    pub fn reasoning_summary(&self) -> bool {
        self.reasoning_summary
    }

    pub fn push(&mut self, event: &OutputEvent) {
        match event {
            OutputEvent::Reasoning(s) if s.is_empty() => {}
            OutputEvent::Text(s) if s.is_empty() => {}
            OutputEvent::Reasoning(s) => match self.segments.last_mut() {
                Some(Segment::Reasoning(r)) => r.push_str(s),
                _ => self.segments.push(Segment::Reasoning(s.clone())),
            },
            OutputEvent::Text(s) => match self.segments.last_mut() {
                Some(Segment::Text(t)) => t.push_str(s),
                _ => self.segments.push(Segment::Text(s.clone())),
            },
            OutputEvent::ToolCallStart { index, id, name } => {
                self.calls.push((*index, self.segments.len()));
                self.segments.push(Segment::ToolCall(ToolCall {
                    id: id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                }));
            }
            OutputEvent::ToolCallArguments { index, delta } => {
                if let Some(&(_, pos)) = self.calls.iter().find(|(i, _)| i == index) {
                    if let Some(Segment::ToolCall(call)) = self.segments.get_mut(pos) {
                        call.arguments.push_str(delta);
                    }
                }
            }
            OutputEvent::ToolCallEnd { .. } => {}
            OutputEvent::Stopped { stop } => self.stopped = Some(stop.clone()),
        }
    }

    pub fn extend<'a>(&mut self, events: impl IntoIterator<Item = &'a OutputEvent>) {
        for event in events {
            self.push(event);
        }
    }

    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// All reasoning text, when there was any.
    pub fn reasoning(&self) -> Option<String> {
        let r: String = self
            .segments
            .iter()
            .filter_map(|s| match s {
                Segment::Reasoning(r) => Some(r.as_str()),
                _ => None,
            })
            .collect();
        (!r.is_empty()).then_some(r)
    }

    /// All answer text.
    pub fn text(&self) -> String {
        self.segments
            .iter()
            .filter_map(|s| match s {
                Segment::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    pub fn tool_calls(&self) -> Vec<ToolCall> {
        self.segments
            .iter()
            .filter_map(|s| match s {
                Segment::ToolCall(c) => Some(c.clone()),
                _ => None,
            })
            .collect()
    }

    /// The stop sequence that matched, if one did.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// The finish reason implied by the output: a matched stop sequence, else
    /// `Length` when the engine hit the token limit, else `ToolCalls` when the model
    /// called tools, else `Stop`.
    pub fn finish_reason(&self, hit_length: bool) -> FinishReason {
        if let Some(stop) = &self.stopped {
            FinishReason::StopSequence(stop.clone())
        } else if hit_length {
            FinishReason::Length
        } else if self
            .segments
            .iter()
            .any(|s| matches!(s, Segment::ToolCall(_)))
        {
            FinishReason::ToolCalls
        } else {
            FinishReason::Stop
        }
    }

    /// The protocol's non-streaming response body.
    pub fn build(
        &self,
        protocol: Protocol,
        id: &str,
        model: &str,
        created: u64,
        finish: &FinishReason,
        usage: &Usage,
    ) -> Value {
        match protocol {
            Protocol::ChatCompletions => self.chat_completion(id, model, created, finish, usage),
            Protocol::Responses => self.responses(id, model, created, finish, usage),
            Protocol::AnthropicMessages => self.anthropic(id, model, finish, usage),
        }
    }

    fn chat_completion(
        &self,
        id: &str,
        model: &str,
        created: u64,
        finish: &FinishReason,
        usage: &Usage,
    ) -> Value {
        let text = self.text();
        let calls = self.tool_calls();
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert(
            "content".into(),
            if text.is_empty() && !calls.is_empty() {
                Value::Null
            } else {
                Value::String(text)
            },
        );
        if let Some(reasoning) = self.reasoning() {
            message.insert("reasoning_content".into(), Value::String(reasoning));
        }
        if !calls.is_empty() {
            message.insert(
                "tool_calls".into(),
                Value::Array(calls.iter().map(chat_tool_call).collect()),
            );
        }
        json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": Value::Object(message),
                "logprobs": null,
                "finish_reason": finish.chat_completions(),
            }],
            "usage": chat_usage(usage),
        })
    }

    fn responses(
        &self,
        id: &str,
        model: &str,
        created: u64,
        finish: &FinishReason,
        usage: &Usage,
    ) -> Value {
        let output: Vec<Value> = self
            .segments
            .iter()
            .enumerate()
            .map(|(i, seg)| responses_item(id, i, seg, "completed", self.reasoning_summary))
            .collect();
        responses_object(id, model, created, Some(finish), output, Some(usage))
    }

    fn anthropic(&self, id: &str, model: &str, finish: &FinishReason, usage: &Usage) -> Value {
        let content: Vec<Value> = self.segments.iter().map(anthropic_block).collect();
        json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": finish.anthropic(),
            "stop_sequence": finish.stop_sequence(),
            "usage": anthropic_usage(usage),
        })
    }
}

pub(crate) fn chat_tool_call(call: &ToolCall) -> Value {
    json!({
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

pub(crate) fn chat_usage(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    })
}

pub(crate) fn responses_usage(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

pub(crate) fn anthropic_usage(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens.saturating_sub(usage.cached_prompt_tokens),
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_prompt_tokens,
    })
}

/// The id of a Responses output item: `rs_` / `msg_` / `fc_` + the response id without
/// its `resp_` prefix + `_` + the output index.
pub fn responses_item_id(response_id: &str, output_index: usize, segment: &Segment) -> String {
    let base = response_id.strip_prefix("resp_").unwrap_or(response_id);
    let kind = match segment {
        Segment::Reasoning(_) => "rs",
        Segment::Text(_) => "msg",
        Segment::ToolCall(_) => "fc",
    };
    format!("{kind}_{base}_{output_index}")
}

pub(crate) fn responses_reasoning_part(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

pub(crate) fn responses_summary_part(text: &str) -> Value {
    json!({"type": "summary_text", "text": text})
}

pub(crate) fn responses_text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// A Responses output item; `status` is "in_progress" while streaming, else
/// "completed"; `summary`: reasoning as summary parts (see the module doc).
pub(crate) fn responses_item(
    response_id: &str,
    output_index: usize,
    seg: &Segment,
    status: &str,
    summary: bool,
) -> Value {
    let item_id = responses_item_id(response_id, output_index, seg);
    let done = status == "completed";
    match seg {
        Segment::Reasoning(r) if summary => json!({
            "id": item_id,
            "type": "reasoning",
            "summary": if done { vec![responses_summary_part(r)] } else { vec![] },
        }),
        Segment::Reasoning(r) => json!({
            "id": item_id,
            "type": "reasoning",
            "summary": [],
            "content": if done { vec![responses_reasoning_part(r)] } else { vec![] },
        }),
        Segment::Text(t) => json!({
            "id": item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": if done { vec![responses_text_part(t)] } else { vec![] },
        }),
        Segment::ToolCall(c) => json!({
            "id": item_id,
            "type": "function_call",
            "status": status,
            "call_id": c.id,
            "name": c.name,
            "arguments": c.arguments,
        }),
    }
}

/// The Responses `response` object. `finish` None means still in progress.
pub(crate) fn responses_object(
    id: &str,
    model: &str,
    created: u64,
    finish: Option<&FinishReason>,
    output: Vec<Value>,
    usage: Option<&Usage>,
) -> Value {
    let (status, incomplete) = match finish {
        None => ("in_progress", Value::Null),
        Some(FinishReason::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
    };
    json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": null,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage.map(responses_usage),
    })
}

pub(crate) fn anthropic_block(seg: &Segment) -> Value {
    match seg {
        Segment::Reasoning(r) => json!({"type": "thinking", "thinking": r, "signature": ""}),
        Segment::Text(t) => json!({"type": "text", "text": t}),
        Segment::ToolCall(c) => json!({
            "type": "tool_use",
            "id": c.id,
            "name": c.name,
            "input": tool_input(&c.arguments),
        }),
    }
}

/// Anthropic's `input` must be an object: arguments that are not a JSON object become
/// `{}` (empty arguments) or `{"arguments": <the raw text>}` so nothing is lost silently.
pub fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(map)) => Value::Object(map),
        _ if arguments.trim().is_empty() => json!({}),
        _ => json!({"arguments": arguments}),
    }
}
