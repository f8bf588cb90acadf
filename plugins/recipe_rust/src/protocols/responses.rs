//! OpenAI Responses request -> ``EngineRequest``.
//!
//! Accepted: ``model`` (required), ``input`` (a string: one user message; or a list
//! of items: messages with role user / assistant / system / developer and content a
//! string or parts ``input_text`` / ``output_text`` / ``refusal`` / ``input_image``
//! (by ``image_url``); ``function_call``; ``function_call_output``; ``reasoning``),
//! ``instructions`` (a system message first), ``tools`` (type function),
//! ``tool_choice``, ``parallel_tool_calls`` (false only with a forced tool choice), ``reasoning.effort``,
//! ``reasoning.summary`` (-> ``EngineRequest::reasoning_summary``), ``text.format``,
//! ``temperature``, ``top_p``, ``max_output_tokens``, ``top_logprobs`` (0..=20),
//! ``stream``, ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``
//! (both carried, affecting nothing), ``prompt_cache_retention`` ("in_memory" only),
//! ``store`` (false only), ``truncation`` ("disabled" only), ``service_tier``
//! ("auto"/"default" only), ``text.verbosity`` ("medium" only).
//!
//! ``include``: ``message.output_text.logprobs`` turns log-probabilities on (with
//! ``top_logprobs`` alternatives; without the include ``top_logprobs`` asks for
//! nothing, as in OpenAI's API); streamed, they ride on ``response.output_text.delta``
//! events (``output::sse``). The built-in tool values
//! (``file_search_call.results``, ``web_search_call.results``,
//! ``web_search_call.action.sources``, ``computer_call_output.output.image_url``,
//! ``code_interpreter_call.outputs``) and ``message.input_image.image_url`` are
//! accepted and change nothing: built-in tools are refused, so no such items are
//! produced, and input items are never echoed. ``reasoning.encrypted_content`` is
//! refused: reasoning is returned as readable text, never encrypted.
//!
//! Assistant turns: consecutive output items (reasoning, one message, function calls)
//! merge into one assistant ``Message``, so the conversation equals its Chat
//! Completions form. A reasoning item attaches to the assistant turn that follows
//! it (content parts preferred, else summary parts, joined with "\n\n").
//!
//! Ignored hints: item ``id`` / ``status``, ``output_text.annotations`` /
//! ``logprobs``,
//! ``text.format.description``, ``stream_options.include_obfuscation``.

use serde_json::Value;

use super::chat::{check_choice_has_tools, json_schema_format, named_choice};
use super::*;
use crate::conversation::*;
use crate::error::{index, RecipeError, Result};

const TOP_LEVEL: &[&str] = &[
    "model",
    // powertrain's extension (vLLM's spelling): output constraints.
    "structured_outputs",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning",
    "text",
    "temperature",
    "top_p",
    "max_output_tokens",
    "stream",
    "stream_options",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "top_logprobs",
    "store",
    "include",
    "truncation",
    "service_tier",
    // Known, rejected as unsupported:
    "previous_response_id",
    "background",
    "conversation",
    "prompt",
    "max_tool_calls",
];

const BUILTIN_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
];

const BUILTIN_ITEMS: &[&str] = &[
    "item_reference",
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "web_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "custom_tool_call",
    "custom_tool_call_output",
];

pub fn parse(body: &Value) -> Result<EngineRequest> {
    let top = Fields::new(body, "")?;
    top.check_known(TOP_LEVEL)?;

    top.reject(
        "previous_response_id",
        "stored responses; send the whole conversation in `input`",
    )?;
    top.reject(
        "conversation",
        "stored conversations; send the whole conversation in `input`",
    )?;
    top.reject("prompt", "stored prompt templates")?;
    top.reject("max_tool_calls", "a limit on built-in tool calls")?;
    if top.bool("background")? == Some(true) {
        return Err(unsupported_field(
            &top.at("background"),
            "background",
            "background responses",
        ));
    }
    if top.bool("store")? == Some(true) {
        return Err(unsupported_field(
            &top.at("store"),
            "store",
            "stored responses; send store: false",
        ));
    }
    if let Some(t) = top.str("truncation")? {
        if t != "disabled" {
            return Err(unsupported_field(
                &top.at("truncation"),
                "truncation",
                "automatic truncation",
            ));
        }
    }
    check_openai_options(&top)?;

    let model = top.req_str("model")?.to_string();

    let tools = match top.array("tools")? {
        Some(items) => parse_tools(items, &top.at("tools"))?,
        None => Vec::new(),
    };
    let tool_choice = match top.get("tool_choice") {
        Some(v) => parse_tool_choice(v, &top.at("tool_choice"), &tools)?,
        None => ToolChoice::Auto,
    };
    let single_tool_call = openai_single_tool_call(&top, &tool_choice, &tools)?;

    let mut messages = Vec::new();
    if let Some(instructions) = top.str("instructions")? {
        let content = normalize_content(vec![ContentPart::Text {
            text: instructions.to_string(),
        }]);
        messages.push(Message {
            role: Role::System,
            content,
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            is_error: false,
        });
    }
    let input = top.require("input")?;
    match input {
        Value::String(s) => messages.push(Message {
            role: Role::User,
            content: normalize_content(vec![ContentPart::Text { text: s.clone() }]),
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            is_error: false,
        }),
        Value::Array(items) => parse_items(items, &top.at("input"), &mut messages)?,
        other => {
            return Err(expected(
                &top.at("input"),
                "string or array of input items",
                other,
            ))
        }
    }
    if messages.is_empty() {
        return Err(RecipeError::invalid(
            top.at("input"),
            "at least one input item is required",
        ));
    }

    let mut thinking = Thinking::default();
    let mut reasoning_summary = None;
    if let Some(r) = top.object("reasoning")? {
        r.check_known(&["effort", "summary", "generate_summary"])?;
        if let Some(effort) = r.str("effort")? {
            apply_effort(&mut thinking, effort, &r.at("effort"))?;
        }
        for key in ["summary", "generate_summary"] {
            if let Some(s) = r.str(key)? {
                let summary = match s {
                    "auto" => ReasoningSummary::Auto,
                    "concise" => ReasoningSummary::Concise,
                    "detailed" => ReasoningSummary::Detailed,
                    other => {
                        return Err(RecipeError::invalid(
                            r.at(key),
                            format!(
                                "unknown summary {other:?} (expected auto, concise or detailed)"
                            ),
                        ))
                    }
                };
                if reasoning_summary.is_some_and(|earlier| earlier != summary) {
                    return Err(RecipeError::invalid(
                        r.at(key),
                        "summary and generate_summary disagree; send one of them",
                    ));
                }
                reasoning_summary = Some(summary);
            }
        }
    }

    let mut response_format = ResponseFormat::Text;
    if let Some(text) = top.object("text")? {
        text.check_known(&["format", "verbosity"])?;
        if let Some(v) = text.str("verbosity")? {
            if v != "medium" {
                return Err(unsupported_field(
                    &text.at("verbosity"),
                    "verbosity",
                    "verbosity control",
                ));
            }
        }
        if let Some(format) = text.object("format")? {
            response_format = match format.req_str("type")? {
                "text" => {
                    format.check_known(&["type"])?;
                    ResponseFormat::Text
                }
                "json_object" => {
                    format.check_known(&["type"])?;
                    ResponseFormat::JsonObject
                }
                "json_schema" => {
                    format.check_known(&["type", "name", "schema", "strict", "description"])?;
                    json_schema_format(&format)?
                }
                other => {
                    return Err(RecipeError::invalid(
                        format.at("type"),
                        format!(
                        "unknown format type {other:?} (expected text, json_object or json_schema)"
                    ),
                    ))
                }
            };
        }
    }

    let stream = top.bool("stream")?.unwrap_or(false);
    let mut sampling = SamplingSettings {
        temperature: top.f64_in("temperature", 0.0, 2.0, false)?,
        top_p: top.f64_in("top_p", 0.0, 1.0, true)?,
        max_tokens: top.positive_u32("max_output_tokens")?,
        ..SamplingSettings::default()
    };
    let top_logprobs = top.u32("top_logprobs")?;
    if let Some(k) = top_logprobs {
        if k > 20 {
            return Err(RecipeError::invalid(
                top.at("top_logprobs"),
                format!("must be in 0..=20, got {k}"),
            ));
        }
    }
    if let Some(include) = top.array("include")? {
        for (i, value) in include.iter().enumerate() {
            let path = index(&top.at("include"), i);
            match as_str(value, &path)? {
                "message.output_text.logprobs" => {
                    sampling.logprobs = true;
                    sampling.top_logprobs = top_logprobs;
                }
                "reasoning.encrypted_content" => {
                    return Err(unsupported_field(
                        &path,
                        "reasoning.encrypted_content",
                        "encrypted reasoning; reasoning items carry their text, send them back as they came",
                    ))
                }
                "file_search_call.results"
                | "web_search_call.results"
                | "web_search_call.action.sources"
                | "computer_call_output.output.image_url"
                | "code_interpreter_call.outputs"
                | "message.input_image.image_url" => {}
                other => {
                    return Err(RecipeError::invalid(
                        path,
                        format!("unknown include value {other:?}"),
                    ))
                }
            }
        }
    }

    if let Some(opts) = top.object("stream_options")? {
        opts.check_known(&["include_obfuscation"])?;
        opts.bool("include_obfuscation")?;
    }
    let metadata = openai_metadata(&top)?;
    let user = top.str("user")?.map(str::to_string);
    let (safety_identifier, prompt_cache_key) = openai_identifiers(&top)?;

    let structured_outputs = parse_structured_outputs(&top, &response_format, "text.format")?;

    Ok(EngineRequest {
        protocol: Protocol::Responses,
        model,
        conversation: Conversation {
            messages,
            tools,
            tool_choice,
            thinking,
            single_tool_call,
        },
        sampling,
        response_format,
        stream,
        include_usage: true,
        reasoning_summary,
        metadata,
        user,
        safety_identifier,
        prompt_cache_key,
        structured_outputs,
        images: 0, // counted by parse_value
        image_fits: Vec::new(),
        image_parts: Vec::new(),
    })
}

fn parse_tools(items: &[Value], path: &str) -> Result<Vec<Tool>> {
    let mut tools: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let t = Fields::new(item, &index(path, i))?;
        let ty = t.req_str("type")?;
        if ty != "function" {
            if BUILTIN_TOOLS.contains(&ty) {
                return Err(unsupported_field(
                    &t.at("type"),
                    ty,
                    "built-in tools; declare function tools",
                ));
            }
            return Err(RecipeError::invalid(
                t.at("type"),
                format!("unknown tool type {ty:?} (expected function)"),
            ));
        }
        t.check_known(&["type", "name", "description", "parameters", "strict"])?;
        tools.push(function_tool(&t, &tools)?);
    }
    Ok(tools)
}

fn parse_tool_choice(value: &Value, path: &str, tools: &[Tool]) -> Result<ToolChoice> {
    let choice = match value {
        Value::String(s) => openai_tool_choice_word(s, path)?,
        Value::Object(_) => {
            let f = Fields::new(value, path)?;
            let ty = f.req_str("type")?;
            if ty == "function" {
                f.check_known(&["type", "name"])?;
                named_choice(f.req_str("name")?, &f.at("name"), tools)?
            } else if ty == "allowed_tools" || ty == "mcp" || BUILTIN_TOOLS.contains(&ty) {
                return Err(unsupported_field(
                    &f.at("type"),
                    ty,
                    "this tool_choice form",
                ));
            } else {
                return Err(RecipeError::invalid(
                    f.at("type"),
                    format!("unknown tool_choice type {ty:?} (expected function)"),
                ));
            }
        }
        other => return Err(expected(path, "string or object", other)),
    };
    check_choice_has_tools(&choice, path, tools)?;
    Ok(choice)
}

/// Builds the message list, merging consecutive assistant output items.
struct Builder<'m> {
    out: &'m mut Vec<Message>,
    /// The assistant turn being assembled.
    pending: Option<Message>,
    calls: CallTracker,
}

impl Builder<'_> {
    fn pending(&mut self) -> &mut Message {
        self.pending.get_or_insert_with(|| Message {
            role: Role::Assistant,
            content: Vec::new(),
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            is_error: false,
        })
    }

    fn flush(&mut self) {
        if let Some(mut m) = self.pending.take() {
            m.content = normalize_content(std::mem::take(&mut m.content));
            self.calls.record(&m.tool_calls);
            self.out.push(m);
        }
    }

    fn push(&mut self, m: Message) {
        self.flush();
        self.out.push(m);
    }
}

fn parse_items(items: &[Value], path: &str, out: &mut Vec<Message>) -> Result<()> {
    let mut b = Builder {
        out,
        pending: None,
        calls: CallTracker::default(),
    };
    for (i, item) in items.iter().enumerate() {
        let ip = index(path, i);
        let f = Fields::new(item, &ip)?;
        // EasyInputMessage: {role, content} without a type.
        let ty = match f.get("type") {
            Some(v) => as_str(v, &f.at("type"))?,
            None if f.get("role").is_some() => "message",
            None => return Err(f.missing("type")),
        };
        match ty {
            "message" => {
                f.check_known(&["type", "role", "content", "id", "status"])?;
                check_id_status(&f)?;
                let role = f.req_str("role")?;
                let content = message_content(f.require("content")?, &f.at("content"))?;
                if role != "user" && content.iter().any(|p| matches!(p, ContentPart::Image { .. })) {
                    return Err(RecipeError::invalid(f.at("content"), "images are only allowed in user messages"));
                }
                let role = match role {
                    "user" => Role::User,
                    "system" => Role::System,
                    "developer" => Role::Developer,
                    "assistant" => {
                        if let Some(p) = &b.pending {
                            if !p.content.is_empty() || !p.tool_calls.is_empty() {
                                b.flush();
                            }
                        }
                        b.pending().content.extend(content);
                        continue;
                    }
                    other => {
                        return Err(RecipeError::invalid(
                            f.at("role"),
                            format!("unknown role {other:?} (expected user, assistant, system or developer)"),
                        ))
                    }
                };
                b.push(Message { role, content, reasoning: None, tool_calls: Vec::new(), tool_call_id: None, name: None, is_error: false });
            }
            "function_call" => {
                f.check_known(&["type", "id", "call_id", "name", "arguments", "status"])?;
                check_id_status(&f)?;
                let id = f.req_str("call_id")?;
                check_call_id(id, &f.at("call_id"))?;
                let name = f.req_str("name")?;
                check_tool_name(name, &f.at("name"))?;
                let arguments = compact_arguments(f.req_str("arguments")?, &f.at("arguments"))?;
                b.pending().tool_calls.push(ToolCall { id: id.to_string(), name: name.to_string(), arguments });
            }
            "function_call_output" => {
                f.check_known(&["type", "id", "call_id", "output", "status"])?;
                check_id_status(&f)?;
                b.flush();
                let id = f.req_str("call_id")?;
                let name = b.calls.resolve(id, &f.at("call_id"))?;
                let content = output_content(f.require("output")?, &f.at("output"))?;
                b.push(Message {
                    role: Role::Tool,
                    content,
                    reasoning: None,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(id.to_string()),
                    name: Some(name),
                    is_error: false,
                });
            }
            "reasoning" => {
                f.check_known(&["type", "id", "summary", "content", "encrypted_content", "status"])?;
                check_id_status(&f)?;
                f.reject("encrypted_content", "encrypted reasoning")?;
                let content = reasoning_texts(&f, "content", "reasoning_text")?;
                let summary = reasoning_texts(&f, "summary", "summary_text")?;
                let texts = if content.is_empty() { summary } else { content };
                if let Some(p) = &b.pending {
                    if !p.content.is_empty() || !p.tool_calls.is_empty() {
                        b.flush();
                    }
                }
                let pending = b.pending();
                for text in texts {
                    append_reasoning(&mut pending.reasoning, &text);
                }
            }
            other if BUILTIN_ITEMS.contains(&other) => {
                return Err(unsupported_field(&f.at("type"), other, "built-in tool items and item references"))
            }
            other => {
                return Err(RecipeError::invalid(
                    f.at("type"),
                    format!("unknown input item type {other:?} (expected message, function_call, function_call_output or reasoning)"),
                ))
            }
        }
    }
    b.flush();
    Ok(())
}

fn check_id_status(f: &Fields) -> Result<()> {
    f.str("id")?;
    f.str("status")?;
    Ok(())
}

fn reasoning_texts(f: &Fields, key: &str, part_type: &str) -> Result<Vec<String>> {
    let Some(list) = f.array(key)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let p = Fields::new(item, &index(&f.at(key), i))?;
        p.check_known(&["type", "text"])?;
        let ty = p.req_str("type")?;
        if ty != part_type {
            return Err(RecipeError::invalid(
                p.at("type"),
                format!("unknown part type {ty:?} (expected {part_type})"),
            ));
        }
        let text = p.req_str("text")?;
        if !text.is_empty() {
            out.push(text.to_string());
        }
    }
    Ok(out)
}

/// Message content: a string or a list of parts, each read by ``part``.
fn content_parts(
    value: &Value,
    path: &str,
    part: fn(&Fields, &str) -> Result<ContentPart>,
) -> Result<Vec<ContentPart>> {
    let items = match value {
        Value::String(s) => {
            return Ok(normalize_content(vec![ContentPart::Text {
                text: s.clone(),
            }]))
        }
        Value::Array(items) => items,
        other => return Err(expected(path, "string or array of content parts", other)),
    };
    let mut parts = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let p = Fields::new(item, &index(path, i))?;
        let ty = p.req_str("type")?;
        parts.push(part(&p, ty)?);
    }
    Ok(normalize_content(parts))
}

fn message_content(value: &Value, path: &str) -> Result<Vec<ContentPart>> {
    content_parts(value, path, message_part)
}

fn message_part(p: &Fields, ty: &str) -> Result<ContentPart> {
    match ty {
        "input_text" => {
            p.check_known(&["type", "text"])?;
            Ok(ContentPart::Text { text: p.req_str("text")?.to_string() })
        }
        "output_text" => {
            p.check_known(&["type", "text", "annotations", "logprobs"])?;
            p.array("annotations")?;
            p.array("logprobs")?;
            Ok(ContentPart::Text { text: p.req_str("text")?.to_string() })
        }
        "refusal" => {
            p.check_known(&["type", "refusal"])?;
            Ok(ContentPart::Text { text: p.req_str("refusal")?.to_string() })
        }
        "input_image" => input_image(p),
        "input_file" => Err(unsupported_field(&p.at("type"), ty, "file input")),
        "input_audio" => Err(unsupported_field(&p.at("type"), ty, "audio input")),
        other => Err(RecipeError::invalid(
            p.at("type"),
            format!("unknown content part type {other:?} (expected input_text, output_text, refusal or input_image)"),
        )),
    }
}

fn input_image(p: &Fields) -> Result<ContentPart> {
    p.check_known(&["type", "image_url", "file_id", "detail"])?;
    p.reject("file_id", "uploaded files; send image_url")?;
    let detail = images::detail_field(p.str("detail")?, &p.at("detail"))?;
    let url = p.req_str("image_url")?;
    if url.is_empty() {
        return Err(RecipeError::invalid(p.at("image_url"), "must not be empty"));
    }
    images::image_from_url(url, &p.at("image_url"), detail)
}

/// A function_call_output's output: a string or a list of input_text / input_image parts.
fn output_content(value: &Value, path: &str) -> Result<Vec<ContentPart>> {
    content_parts(value, path, output_part)
}

fn output_part(p: &Fields, ty: &str) -> Result<ContentPart> {
    match ty {
        "input_text" => {
            p.check_known(&["type", "text"])?;
            Ok(ContentPart::Text {
                text: p.req_str("text")?.to_string(),
            })
        }
        "input_image" => input_image(p),
        "input_file" => Err(unsupported_field(&p.at("type"), ty, "file input")),
        other => Err(RecipeError::invalid(
            p.at("type"),
            format!("unknown output part type {other:?} (expected input_text or input_image)"),
        )),
    }
}
