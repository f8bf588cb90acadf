//! Server-sent events for each protocol, from parser events.
//!
//! Each returned `String` is one complete frame: `data: {...}\n\n` for Chat
//! Completions (ending with `data: [DONE]\n\n`), `event: <type>\ndata: {...}\n\n` for
//! Responses and Anthropic Messages. JSON is compact.
//!
//! - Chat Completions: `start` sends the role chunk (`delta: {role, content: ""}`);
//!   each text / reasoning / tool-call delta is one `chat.completion.chunk`
//!   (`content`, `reasoning_content`, `tool_calls[{index, id, type, function{name,
//!   arguments: ""}}]` on a call's start, then `tool_calls[{index, function{arguments}}]`);
//!   `finish` sends an empty delta with `finish_reason`, a `choices: []` usage chunk when
//!   include_usage is on (every chunk then carries `usage: null`), and `[DONE]`.
//! - Responses: `response.created`, `response.in_progress`; per output item
//!   `response.output_item.added`, then for a message `response.content_part.added`,
//!   `response.output_text.delta`…, `response.output_text.done`,
//!   `response.content_part.done`; for reasoning the same with `reasoning_text`
//!   (`response.reasoning_text.delta` / `.done`), or, when the request asked for a
//!   summary ([`SseWriter::with_reasoning_summary`]),
//!   `response.reasoning_summary_part.added`, `response.reasoning_summary_text.delta`…,
//!   `response.reasoning_summary_text.done`, `response.reasoning_summary_part.done`
//!   (`summary_index` 0; see `output::response` for what the summary is); for a call
//!   `response.function_call_arguments.delta`… / `.done`; then
//!   `response.output_item.done`; finally `response.completed` (or
//!   `response.incomplete` on Length) with the whole response and usage. Every event
//!   has `sequence_number` from 0. Item ids follow [`responses_item_id`].
//! - Anthropic: `message_start`, one `ping`, per block `content_block_start` /
//!   `content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta`) /
//!   `content_block_stop`, then `message_delta` (stop_reason, stop_sequence, usage) and
//!   `message_stop`, as the Messages API streams them. A thinking block ends with a
//!   `signature_delta` before its `content_block_stop`, as the API's do; the signature
//!   is "" (this engine signs nothing; the non-streaming body says `signature: ""` too,
//!   and a signature sent back in a later request is ignored). `message_start` usage
//!   comes from [`SseWriter::with_prompt_usage`] (0 otherwise).

use serde_json::{json, Value};

use crate::conversation::Protocol;
use crate::output::parser::OutputEvent;
use crate::output::response::{
    anthropic_usage, responses_item, responses_item_id, responses_object, responses_reasoning_part,
    responses_summary_part, responses_text_part, FinishReason, ResponseBuilder, Segment, Usage,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Reasoning,
    Text,
    Tool(usize),
}

#[derive(Debug, Clone)]
pub struct SseWriter {
    protocol: Protocol,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
    sequence: u64,
    builder: ResponseBuilder,
    /// The open item / block and its position (output_index / block index).
    open: Option<(Open, usize)>,
    finished: bool,
    /// Chat Completions: this writer's choice (``n`` > 1 streams one writer per choice).
    choice_index: usize,
    /// Chat Completions: whether `finish` also ends the stream (usage chunk, `[DONE]`);
    /// off for every choice but the last of an ``n`` > 1 stream.
    ends_stream: bool,
    /// Token log-probabilities given but not written yet: they go on the next frame
    /// that carries generated text (see [`SseWriter::add_logprobs`]).
    pending_logprobs: Vec<Value>,
    /// Responses: every entry given, for the `output_text` part's `logprobs`.
    all_logprobs: Vec<Value>,
}

impl SseWriter {
    pub fn new(
        protocol: Protocol,
        id: impl Into<String>,
        model: impl Into<String>,
        created: u64,
    ) -> SseWriter {
        SseWriter {
            protocol,
            id: id.into(),
            model: model.into(),
            created,
            include_usage: false,
            prompt_tokens: 0,
            cached_prompt_tokens: 0,
            sequence: 0,
            builder: ResponseBuilder::new(),
            open: None,
            finished: false,
            choice_index: 0,
            ends_stream: true,
            pending_logprobs: Vec::new(),
            all_logprobs: Vec::new(),
        }
    }

    /// Chat Completions: the choice this writer streams, and whether its `finish` ends
    /// the whole stream (the last choice of an ``n`` > 1 stream; the only one otherwise).
    pub fn with_choice(mut self, index: usize, ends_stream: bool) -> SseWriter {
        self.choice_index = index;
        self.ends_stream = ends_stream;
        self
    }

    /// Log-probability entries (OpenAI's ``{token, logprob, bytes, top_logprobs}``) of
    /// the tokens generated since the last call. They are written with the next frame
    /// that carries generated text, so text the parser held back (a possible marker)
    /// brings its tokens' entries along when it is released: Chat Completions puts them
    /// on the chunk's ``logprobs.content``, Responses on ``output_text.delta``, and the
    /// finish chunk / the final response take whatever is left. Streamed in order, they
    /// add up to the non-streaming body's list.
    pub fn add_logprobs(&mut self, entries: Vec<Value>) {
        self.pending_logprobs.extend(entries);
    }

    fn take_logprobs(&mut self) -> Vec<Value> {
        let taken = std::mem::take(&mut self.pending_logprobs);
        self.all_logprobs.extend(taken.iter().cloned());
        taken
    }

    /// Responses: the request asked for a reasoning summary (`reasoning.summary`).
    pub fn with_reasoning_summary(mut self, on: bool) -> SseWriter {
        self.builder.set_reasoning_summary(on);
        self
    }

    /// Chat Completions' `stream_options.include_usage` (other protocols always report usage).
    pub fn with_include_usage(mut self, include_usage: bool) -> SseWriter {
        self.include_usage = include_usage;
        self
    }

    /// Prompt token counts for Anthropic's `message_start` usage.
    pub fn with_prompt_usage(mut self, prompt_tokens: u32, cached_prompt_tokens: u32) -> SseWriter {
        self.prompt_tokens = prompt_tokens;
        self.cached_prompt_tokens = cached_prompt_tokens;
        self
    }

    /// Everything seen so far, for logging or a final non-streaming body.
    pub fn builder(&self) -> &ResponseBuilder {
        &self.builder
    }

    pub fn start(&mut self) -> Vec<String> {
        match self.protocol {
            Protocol::ChatCompletions => {
                vec![self.chat_chunk(json!({"role": "assistant", "content": ""}), None)]
            }
            Protocol::Responses => {
                let response =
                    responses_object(&self.id, &self.model, self.created, None, vec![], None);
                vec![
                    self.responses_frame("response.created", json!({"response": response.clone()})),
                    self.responses_frame("response.in_progress", json!({"response": response})),
                ]
            }
            Protocol::AnthropicMessages => {
                let usage = Usage {
                    prompt_tokens: self.prompt_tokens,
                    cached_prompt_tokens: self.cached_prompt_tokens,
                    completion_tokens: 0,
                    reasoning_tokens: 0,
                };
                vec![
                    frame(
                        "message_start",
                        json!({
                            "type": "message_start",
                            "message": {
                                "id": self.id,
                                "type": "message",
                                "role": "assistant",
                                "model": self.model,
                                "content": [],
                                "stop_reason": null,
                                "stop_sequence": null,
                                "usage": anthropic_usage(&usage),
                            },
                        }),
                    ),
                    frame("ping", json!({"type": "ping"})),
                ]
            }
        }
    }

    pub fn events(&mut self, events: &[OutputEvent]) -> Vec<String> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        for event in events {
            match event {
                OutputEvent::Reasoning(s) | OutputEvent::Text(s) if s.is_empty() => continue,
                _ => {}
            }
            self.builder.push(event);
            match self.protocol {
                Protocol::ChatCompletions => self.chat_event(event, &mut out),
                Protocol::Responses => self.responses_event(event, &mut out),
                Protocol::AnthropicMessages => self.anthropic_event(event, &mut out),
            }
        }
        out
    }

    pub fn finish(&mut self, finish_reason: &FinishReason, usage: &Usage) -> Vec<String> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.finished = true;
        match self.protocol {
            Protocol::ChatCompletions => {
                out.push(self.chat_chunk(json!({}), Some(finish_reason.chat_completions())));
                if !self.ends_stream {
                    return out;
                }
                if self.include_usage {
                    let body = json!({
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": crate::output::response::chat_usage(usage),
                    });
                    out.push(data_frame(&body));
                }
                out.push("data: [DONE]\n\n".to_string());
            }
            Protocol::Responses => {
                self.responses_close(&mut out);
                let response = self.response(finish_reason, usage);
                let kind = if *finish_reason == FinishReason::Length {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                out.push(self.responses_frame(kind, json!({"response": response})));
            }
            Protocol::AnthropicMessages => {
                self.anthropic_close(&mut out);
                out.push(frame(
                    "message_delta",
                    json!({
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": finish_reason.anthropic(),
                            "stop_sequence": finish_reason.stop_sequence(),
                        },
                        "usage": anthropic_usage(usage),
                    }),
                ));
                out.push(frame("message_stop", json!({"type": "message_stop"})));
            }
        }
        out
    }

    /// The whole response body of everything written so far (the non-streaming body,
    /// and Responses' final event), with every log-probability entry given where the
    /// protocol reports it: Chat Completions' ``choices[0].logprobs.content``, the
    /// Responses ``output_text`` part's ``logprobs`` (a reasoning or tool-call token is
    /// listed there too, as vLLM does; an answer with no text has no place for them).
    pub fn response(&mut self, finish_reason: &FinishReason, usage: &Usage) -> Value {
        let mut body = self.builder.build(
            self.protocol,
            &self.id,
            &self.model,
            self.created,
            finish_reason,
            usage,
        );
        self.take_logprobs();
        if !self.all_logprobs.is_empty() {
            let logprobs = Value::Array(self.all_logprobs.clone());
            match self.protocol {
                Protocol::ChatCompletions => {
                    body["choices"][0]["logprobs"] = json!({"content": logprobs, "refusal": null})
                }
                Protocol::Responses => set_output_text_logprobs(&mut body, logprobs),
                Protocol::AnthropicMessages => {}
            }
        }
        body
    }

    // ---- Chat Completions ----

    fn chat_chunk(&mut self, delta: Value, finish_reason: Option<&str>) -> String {
        let logprobs = self.take_logprobs();
        let logprobs = if logprobs.is_empty() {
            Value::Null
        } else {
            json!({"content": logprobs, "refusal": null})
        };
        let mut body = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": self.choice_index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        });
        if self.include_usage {
            body["usage"] = Value::Null;
        }
        data_frame(&body)
    }

    fn chat_event(&mut self, event: &OutputEvent, out: &mut Vec<String>) {
        let delta = match event {
            OutputEvent::Reasoning(s) => json!({"reasoning_content": s}),
            OutputEvent::Text(s) => json!({"content": s}),
            OutputEvent::ToolCallStart { index, id, name } => json!({"tool_calls": [{
                "index": index,
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }]}),
            OutputEvent::ToolCallArguments { index, delta } => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]})
            }
            OutputEvent::ToolCallEnd { .. } | OutputEvent::Stopped { .. } => return,
        };
        out.push(self.chat_chunk(delta, None));
    }

    // ---- Responses ----

    fn responses_frame(&mut self, kind: &str, fields: Value) -> String {
        let mut body = json!({"type": kind});
        if let Value::Object(map) = fields {
            for (k, v) in map {
                body[k] = v;
            }
        }
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        frame(kind, body)
    }

    fn segment(&self, position: usize) -> Segment {
        self.builder
            .segments()
            .get(position)
            .cloned()
            .unwrap_or(Segment::Text(String::new()))
    }

    fn responses_open(&mut self, kind: Open, out: &mut Vec<String>) -> (usize, String) {
        if let Some((open, position)) = self.open {
            if open == kind {
                let id = responses_item_id(&self.id, position, &self.segment(position));
                return (position, id);
            }
        }
        self.responses_close(out);
        // The builder has just pushed the event that opens this item: it is the last segment.
        let position = self.builder.segments().len() - 1;
        let seg = self.segment(position);
        let item_id = responses_item_id(&self.id, position, &seg);
        let summary = self.builder.reasoning_summary();
        let mut item = responses_item(&self.id, position, &seg, "in_progress", summary);
        if let Segment::ToolCall(_) = seg {
            item["arguments"] = json!("");
        }
        out.push(self.responses_frame(
            "response.output_item.added",
            json!({"output_index": position, "item": item}),
        ));
        let part = match kind {
            Open::Reasoning if summary => {
                out.push(self.responses_frame(
                    "response.reasoning_summary_part.added",
                    json!({"item_id": item_id, "output_index": position, "summary_index": 0, "part": responses_summary_part("")}),
                ));
                None
            }
            Open::Reasoning => Some(responses_reasoning_part("")),
            Open::Text => Some(responses_text_part("")),
            Open::Tool(_) => None,
        };
        if let Some(part) = part {
            out.push(self.responses_frame(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": position, "content_index": 0, "part": part}),
            ));
        }
        self.open = Some((kind, position));
        (position, item_id)
    }

    fn responses_close(&mut self, out: &mut Vec<String>) {
        let Some((kind, position)) = self.open.take() else {
            return;
        };
        let seg = self.segment(position);
        let item_id = responses_item_id(&self.id, position, &seg);
        let summary = self.builder.reasoning_summary();
        match (&seg, kind) {
            (Segment::Reasoning(text), _) if summary => {
                out.push(self.responses_frame(
                    "response.reasoning_summary_text.done",
                    json!({"item_id": item_id, "output_index": position, "summary_index": 0, "text": text}),
                ));
                out.push(self.responses_frame(
                    "response.reasoning_summary_part.done",
                    json!({"item_id": item_id, "output_index": position, "summary_index": 0, "part": responses_summary_part(text)}),
                ));
            }
            (Segment::Reasoning(text), _) => {
                out.push(self.responses_frame(
                    "response.reasoning_text.done",
                    json!({"item_id": item_id, "output_index": position, "content_index": 0, "text": text}),
                ));
                out.push(self.responses_frame(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": position, "content_index": 0, "part": responses_reasoning_part(text)}),
                ));
            }
            (Segment::Text(text), _) => {
                let logprobs = self.all_logprobs.clone();
                out.push(self.responses_frame(
                    "response.output_text.done",
                    json!({"item_id": item_id, "output_index": position, "content_index": 0, "text": text, "logprobs": logprobs}),
                ));
                out.push(self.responses_frame(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": position, "content_index": 0, "part": responses_text_part(text)}),
                ));
            }
            (Segment::ToolCall(call), _) => {
                out.push(self.responses_frame(
                    "response.function_call_arguments.done",
                    json!({"item_id": item_id, "output_index": position, "name": call.name, "arguments": call.arguments}),
                ));
            }
        }
        let item = responses_item(&self.id, position, &seg, "completed", summary);
        out.push(self.responses_frame(
            "response.output_item.done",
            json!({"output_index": position, "item": item}),
        ));
    }

    fn responses_event(&mut self, event: &OutputEvent, out: &mut Vec<String>) {
        match event {
            OutputEvent::Reasoning(s) => {
                let (position, item_id) = self.responses_open(Open::Reasoning, out);
                let delta = if self.builder.reasoning_summary() {
                    self.responses_frame(
                        "response.reasoning_summary_text.delta",
                        json!({"item_id": item_id, "output_index": position, "summary_index": 0, "delta": s}),
                    )
                } else {
                    self.responses_frame(
                        "response.reasoning_text.delta",
                        json!({"item_id": item_id, "output_index": position, "content_index": 0, "delta": s}),
                    )
                };
                out.push(delta);
            }
            OutputEvent::Text(s) => {
                let (position, item_id) = self.responses_open(Open::Text, out);
                let logprobs = self.take_logprobs();
                out.push(self.responses_frame(
                    "response.output_text.delta",
                    json!({"item_id": item_id, "output_index": position, "content_index": 0, "delta": s, "logprobs": logprobs}),
                ));
            }
            OutputEvent::ToolCallStart { index, .. } => {
                self.responses_close(out);
                self.responses_open(Open::Tool(*index), out);
            }
            OutputEvent::ToolCallArguments { index, delta } => {
                if let Some((Open::Tool(i), position)) = self.open {
                    if i == *index {
                        let item_id =
                            responses_item_id(&self.id, position, &self.segment(position));
                        out.push(self.responses_frame(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item_id, "output_index": position, "delta": delta}),
                        ));
                    }
                }
            }
            OutputEvent::ToolCallEnd { index } => {
                if matches!(self.open, Some((Open::Tool(i), _)) if i == *index) {
                    self.responses_close(out);
                }
            }
            OutputEvent::Stopped { .. } => {}
        }
    }

    // ---- Anthropic ----

    fn anthropic_open(&mut self, kind: Open, out: &mut Vec<String>) -> usize {
        if let Some((open, position)) = self.open {
            if open == kind {
                return position;
            }
        }
        self.anthropic_close(out);
        let position = self.builder.segments().len() - 1;
        let block = match self.segment(position) {
            Segment::Reasoning(_) => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Segment::Text(_) => json!({"type": "text", "text": ""}),
            Segment::ToolCall(c) => {
                json!({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
            }
        };
        out.push(frame(
            "content_block_start",
            json!({"type": "content_block_start", "index": position, "content_block": block}),
        ));
        self.open = Some((kind, position));
        position
    }

    fn anthropic_close(&mut self, out: &mut Vec<String>) {
        if let Some((kind, position)) = self.open.take() {
            if kind == Open::Reasoning {
                out.push(frame(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": position, "delta": {"type": "signature_delta", "signature": ""}}),
                ));
            }
            out.push(frame(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": position}),
            ));
        }
    }

    fn anthropic_event(&mut self, event: &OutputEvent, out: &mut Vec<String>) {
        let (kind, delta) = match event {
            OutputEvent::Reasoning(s) => (
                Open::Reasoning,
                json!({"type": "thinking_delta", "thinking": s}),
            ),
            OutputEvent::Text(s) => (Open::Text, json!({"type": "text_delta", "text": s})),
            OutputEvent::ToolCallStart { index, .. } => {
                self.anthropic_close(out);
                self.anthropic_open(Open::Tool(*index), out);
                return;
            }
            OutputEvent::ToolCallArguments { index, delta } => (
                Open::Tool(*index),
                json!({"type": "input_json_delta", "partial_json": delta}),
            ),
            OutputEvent::ToolCallEnd { index } => {
                if matches!(self.open, Some((Open::Tool(i), _)) if i == *index) {
                    self.anthropic_close(out);
                }
                return;
            }
            OutputEvent::Stopped { .. } => return,
        };
        let position = match (kind, self.open) {
            (Open::Tool(i), Some((Open::Tool(j), position))) if i == j => position,
            (Open::Tool(_), _) => return, // arguments for a call that is not open: dropped
            _ => self.anthropic_open(kind, out),
        };
        out.push(frame(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": position, "delta": delta}),
        ));
    }
}

fn data_frame(body: &Value) -> String {
    format!(
        "data: {}\n\n",
        serde_json::to_string(body).unwrap_or_default()
    )
}

fn frame(kind: &str, body: Value) -> String {
    format!(
        "event: {kind}\ndata: {}\n\n",
        serde_json::to_string(&body).unwrap_or_default()
    )
}

/// Puts the log-probabilities on the response's first ``output_text`` part.
fn set_output_text_logprobs(response: &mut Value, logprobs: Value) {
    let parts = response
        .get_mut("output")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter(|item| item.get("type").and_then(Value::as_str) == Some("message"))
        .filter_map(|item| item.get_mut("content").and_then(Value::as_array_mut))
        .flatten()
        .find(|part| part.get("type").and_then(Value::as_str) == Some("output_text"));
    if let Some(part) = parts {
        part["logprobs"] = logprobs;
    }
}
