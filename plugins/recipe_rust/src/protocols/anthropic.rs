//! Anthropic Messages request -> ``EngineRequest``.
//!
//! Accepted: ``model``, ``messages`` and ``max_tokens`` (all required), ``system``
//! (string or text blocks), user blocks ``text`` / ``image`` (base64 -> a
//! ``data:<media_type>;base64,...`` reference, url -> the url) / ``tool_result``,
//! assistant blocks ``text`` / ``tool_use`` / ``thinking``, ``tools`` (custom tools:
//! name, description, input_schema), ``tool_choice`` (auto / any -> Required / none /
//! tool; ``disable_parallel_tool_use`` only with any / tool), ``thinking`` (enabled with budget_tokens >= 1024 and < max_tokens;
//! adaptive: on, no budget, the model decides how much; or disabled),
//! ``thinking.display`` ("summarized" only), ``output_config.effort`` (none / minimal /
//! low / medium / high / xhigh / max, read as Chat's ``reasoning_effort``),
//! ``output_config.format`` (json_schema -> a strict JSON-schema response format
//! named "output"),
//! ``temperature`` (0..=1), ``top_p``, ``top_k``, ``stop_sequences``, ``stream``,
//! ``metadata.user_id`` (-> ``user``), ``service_tier`` ("auto" only).
//!
//! Each ``tool_result`` becomes a Role::Tool message, in order, split out of its user
//! turn and placed before the remaining user content of that turn; its ``is_error``
//! becomes the message's ``is_error``.
//!
//! Ignored hints: ``cache_control`` everywhere (top level too), ``citations`` on text blocks and
//! thinking ``signature``.

use serde_json::{Map, Value};

use super::*;
use crate::conversation::*;
use crate::error::{index, RecipeError, Result};
use crate::image_fit::ImageDetail;

const TOP_LEVEL: &[&str] = &[
    "model",
    // powertrain's extension (vLLM's spelling): output constraints.
    "structured_outputs",
    "messages",
    "max_tokens",
    "system",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "service_tier",
    "cache_control",
    // Known, rejected as unsupported:
    "container",
    "mcp_servers",
    "context_management",
];

pub fn parse(body: &Value) -> Result<EngineRequest> {
    let top = Fields::new(body, "")?;
    top.check_known(TOP_LEVEL)?;
    top.reject("container", "code execution containers")?;
    top.reject("mcp_servers", "MCP connectors")?;
    top.reject("context_management", "server-side context management")?;
    top.object("cache_control")?;
    if let Some(tier) = top.str("service_tier")? {
        if tier != "auto" {
            return Err(unsupported_field(
                &top.at("service_tier"),
                "service_tier",
                "service tiers",
            ));
        }
    }

    let model = top.req_str("model")?.to_string();
    let max_tokens = top
        .positive_u32("max_tokens")?
        .ok_or_else(|| top.missing("max_tokens"))?;

    let tools = match top.array("tools")? {
        Some(items) => parse_tools(items, &top.at("tools"))?,
        None => Vec::new(),
    };
    let (tool_choice, single_tool_call) = match top.object("tool_choice")? {
        Some(f) => parse_tool_choice(&f, &tools)?,
        None => (ToolChoice::Auto, false),
    };

    let mut messages = Vec::new();
    if let Some(system) = top.get("system") {
        let content = system_content(system, &top.at("system"))?;
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
    let list = as_array(top.require("messages")?, &top.at("messages"))?;
    if list.is_empty() {
        return Err(RecipeError::invalid(
            top.at("messages"),
            "at least one message is required",
        ));
    }
    parse_messages(list, &top.at("messages"), &mut messages)?;

    let mut thinking = Thinking::default();
    if let Some(t) = top.object("thinking")? {
        match t.req_str("type")? {
            "enabled" => {
                t.check_known(&["type", "budget_tokens", "display"])?;
                check_thinking_display(&t)?;
                let budget = t
                    .u32("budget_tokens")?
                    .ok_or_else(|| t.missing("budget_tokens"))?;
                if budget < 1024 {
                    return Err(RecipeError::invalid(
                        t.at("budget_tokens"),
                        format!("must be >= 1024, got {budget}"),
                    ));
                }
                if budget >= max_tokens {
                    return Err(RecipeError::invalid(
                        t.at("budget_tokens"),
                        format!("must be less than max_tokens ({max_tokens}), got {budget}"),
                    ));
                }
                thinking.enabled = Some(true);
                thinking.budget_tokens = Some(budget);
            }
            "adaptive" => {
                t.check_known(&["type", "display"])?;
                check_thinking_display(&t)?;
                thinking.enabled = Some(true);
                thinking.adaptive = true;
            }
            "disabled" => {
                t.check_known(&["type"])?;
                thinking.enabled = Some(false);
            }
            "between_tools" => {
                return Err(unsupported_field(
                    &t.at("type"),
                    "between_tools",
                    "thinking only between tool calls",
                ))
            }
            other => {
                return Err(RecipeError::invalid(
                    t.at("type"),
                    format!(
                        "unknown thinking type {other:?} (expected enabled, adaptive or disabled)"
                    ),
                ))
            }
        }
    }
    let mut response_format = ResponseFormat::Text;
    if let Some(config) = top.object("output_config")? {
        config.check_known(&["effort", "format"])?;
        if let Some(effort) = config.str("effort")? {
            apply_effort(&mut thinking, effort, &config.at("effort"))?;
        }
        if let Some(format) = config.object("format")? {
            format.check_known(&["type", "schema"])?;
            let ty = format.req_str("type")?;
            if ty != "json_schema" {
                return Err(RecipeError::invalid(
                    format.at("type"),
                    format!("unknown output format type {ty:?} (expected json_schema)"),
                ));
            }
            let schema = schema_object(format.require("schema")?, &format.at("schema"))?;
            response_format = ResponseFormat::JsonSchema {
                name: "output".to_string(),
                schema,
                strict: true,
            };
        }
    }

    let mut sampling = SamplingSettings {
        max_tokens: Some(max_tokens),
        temperature: top.f64_in("temperature", 0.0, 1.0, false)?,
        top_p: top.f64_in("top_p", 0.0, 1.0, true)?,
        top_k: top.positive_u32("top_k")?,
        ..SamplingSettings::default()
    };
    if let Some(list) = top.array("stop_sequences")? {
        for (i, v) in list.iter().enumerate() {
            let s = as_str(v, &index(&top.at("stop_sequences"), i))?;
            sampling.stop.push(s.to_string());
        }
    }

    let stream = top.bool("stream")?.unwrap_or(false);
    let mut user = None;
    if let Some(meta) = top.object("metadata")? {
        meta.check_known(&["user_id"])?;
        user = meta.str("user_id")?.map(str::to_string);
    }

    let structured_outputs =
        parse_structured_outputs(&top, &response_format, "output_config.format")?;

    Ok(EngineRequest {
        protocol: Protocol::AnthropicMessages,
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
        reasoning_summary: None,
        metadata: Map::new(),
        user,
        safety_identifier: None,
        prompt_cache_key: None,
        structured_outputs,
        images: 0, // counted by parse_value
        image_fits: Vec::new(),
        image_parts: Vec::new(),
    })
}

/// ``thinking.display``: "summarized" returns thinking as usual; "omitted" (thinking
/// redacted, only a signature returned) is not supported.
fn check_thinking_display(t: &Fields) -> Result<()> {
    match t.str("display")? {
        None | Some("summarized") => Ok(()),
        Some("omitted") => Err(unsupported_field(
            &t.at("display"),
            "display",
            "omitting thinking from the response; send summarized or drop the field",
        )),
        Some(other) => Err(RecipeError::invalid(
            t.at("display"),
            format!("unknown display {other:?} (expected summarized or omitted)"),
        )),
    }
}

fn parse_tools(items: &[Value], path: &str) -> Result<Vec<Tool>> {
    let mut tools: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let t = Fields::new(item, &index(path, i))?;
        if let Some(ty) = t.str("type")? {
            if ty != "custom" {
                return Err(unsupported_field(
                    &t.at("type"),
                    ty,
                    "server and built-in tools; declare custom tools",
                ));
            }
        }
        t.check_known(&[
            "type",
            "name",
            "description",
            "input_schema",
            "cache_control",
            "strict",
        ])?;
        let name = t.req_str("name")?;
        check_tool_name(name, &t.at("name"))?;
        if tools.iter().any(|existing| existing.name == name) {
            return Err(RecipeError::invalid(
                t.at("name"),
                format!("duplicate tool name {name:?}"),
            ));
        }
        let description = t.str("description")?.map(str::to_string);
        let parameters = schema_object(t.require("input_schema")?, &t.at("input_schema"))?;
        let strict = t.bool("strict")?.unwrap_or(false);
        tools.push(Tool {
            name: name.to_string(),
            description,
            parameters,
            strict,
        });
    }
    Ok(tools)
}

/// The tool choice and whether it allows at most one call (``disable_parallel_tool_use``).
fn parse_tool_choice(f: &Fields, tools: &[Tool]) -> Result<(ToolChoice, bool)> {
    let ty = f.req_str("type")?;
    let choice = match ty {
        "auto" | "any" => {
            f.check_known(&["type", "disable_parallel_tool_use"])?;
            if ty == "auto" {
                ToolChoice::Auto
            } else {
                ToolChoice::Required
            }
        }
        "none" => {
            f.check_known(&["type"])?;
            ToolChoice::None
        }
        "tool" => {
            f.check_known(&["type", "name", "disable_parallel_tool_use"])?;
            super::chat::named_choice(f.req_str("name")?, &f.at("name"), tools)?
        }
        other => {
            return Err(RecipeError::invalid(
                f.at("type"),
                format!("unknown tool_choice type {other:?} (expected auto, any, none or tool)"),
            ))
        }
    };
    super::chat::check_choice_has_tools(&choice, &f.path, tools)?;
    let single = super::single_tool_call(
        f.bool("disable_parallel_tool_use")? == Some(true),
        &choice,
        tools,
        &f.at("disable_parallel_tool_use"),
        "disable_parallel_tool_use",
    )?;
    Ok((choice, single))
}

fn system_content(value: &Value, path: &str) -> Result<Vec<ContentPart>> {
    match value {
        Value::String(s) => Ok(normalize_content(vec![ContentPart::Text {
            text: s.clone(),
        }])),
        Value::Array(items) => {
            let mut parts = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let b = Fields::new(item, &index(path, i))?;
                let ty = b.req_str("type")?;
                if ty != "text" {
                    return Err(RecipeError::invalid(
                        b.at("type"),
                        format!("system blocks must be text, got {ty:?}"),
                    ));
                }
                parts.push(text_block(&b)?);
            }
            Ok(normalize_content(parts))
        }
        other => Err(expected(path, "string or array of text blocks", other)),
    }
}

fn text_block(b: &Fields) -> Result<ContentPart> {
    b.check_known(&["type", "text", "cache_control", "citations"])?;
    b.object("cache_control")?;
    b.array("citations")?;
    Ok(ContentPart::Text {
        text: b.req_str("text")?.to_string(),
    })
}

fn image_block(b: &Fields) -> Result<ContentPart> {
    b.check_known(&["type", "source", "cache_control"])?;
    let s = b.object("source")?.ok_or_else(|| b.missing("source"))?;
    match s.req_str("type")? {
        "base64" => {
            s.check_known(&["type", "media_type", "data"])?;
            let media = s.req_str("media_type")?;
            images::check_media_type(media, &s.at("media_type"))?;
            let data = s.req_str("data")?;
            images::image_from_base64(media, data, &s.at("data"), ImageDetail::High)
        }
        "url" => {
            s.check_known(&["type", "url"])?;
            images::image_from_url(s.req_str("url")?, &s.at("url"), ImageDetail::High)
        }
        "file" => Err(unsupported_field(
            &s.at("type"),
            "file",
            "uploaded files; send the image as base64",
        )),
        other => Err(RecipeError::invalid(
            s.at("type"),
            format!("unknown image source type {other:?} (expected base64)"),
        )),
    }
}

const UNSUPPORTED_BLOCKS: &[&str] = &[
    "document",
    "search_result",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
];

fn parse_messages(items: &[Value], path: &str, out: &mut Vec<Message>) -> Result<()> {
    let mut calls = CallTracker::default();
    for (i, item) in items.iter().enumerate() {
        let m = Fields::new(item, &index(path, i))?;
        m.check_known(&["role", "content"])?;
        let role = m.req_str("role")?;
        let content_path = m.at("content");
        let content = m.require("content")?;
        let blocks: Vec<Fields> = match content {
            Value::String(s) => {
                let role = match role {
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    other => return Err(unknown_role(&m, other)),
                };
                out.push(Message {
                    role,
                    content: normalize_content(vec![ContentPart::Text { text: s.clone() }]),
                    reasoning: None,
                    tool_calls: Vec::new(),
                    tool_call_id: None,
                    name: None,
                    is_error: false,
                });
                continue;
            }
            Value::Array(list) => list
                .iter()
                .enumerate()
                .map(|(j, v)| Fields::new(v, &index(&content_path, j)))
                .collect::<Result<_>>()?,
            other => {
                return Err(expected(
                    &content_path,
                    "string or array of content blocks",
                    other,
                ))
            }
        };
        match role {
            "user" => {
                let mut parts = Vec::new();
                let mut had_tool_result = false;
                for b in &blocks {
                    let ty = b.req_str("type")?;
                    match ty {
                        "text" => parts.push(text_block(b)?),
                        "image" => parts.push(image_block(b)?),
                        "tool_result" => {
                            had_tool_result = true;
                            out.push(tool_result(b, &calls)?);
                        }
                        "tool_use" | "thinking" => {
                            return Err(RecipeError::invalid(
                                b.at("type"),
                                format!("{ty} blocks are only allowed in assistant messages"),
                            ))
                        }
                        other => return Err(unknown_block(b, other)),
                    }
                }
                let parts = normalize_content(parts);
                if !parts.is_empty() || !had_tool_result {
                    out.push(Message {
                        role: Role::User,
                        content: parts,
                        reasoning: None,
                        tool_calls: Vec::new(),
                        tool_call_id: None,
                        name: None,
                        is_error: false,
                    });
                }
            }
            "assistant" => {
                let mut msg = Message {
                    role: Role::Assistant,
                    content: Vec::new(),
                    reasoning: None,
                    tool_calls: Vec::new(),
                    tool_call_id: None,
                    name: None,
                    is_error: false,
                };
                for b in &blocks {
                    let ty = b.req_str("type")?;
                    match ty {
                        "text" => msg.content.push(text_block(b)?),
                        "tool_use" => {
                            b.check_known(&["type", "id", "name", "input", "cache_control"])?;
                            let id = b.req_str("id")?;
                            check_call_id(id, &b.at("id"))?;
                            let name = b.req_str("name")?;
                            check_tool_name(name, &b.at("name"))?;
                            let input = b.require("input")?;
                            as_object(input, &b.at("input"))?;
                            msg.tool_calls.push(ToolCall {
                                id: id.to_string(),
                                name: name.to_string(),
                                arguments: compact_value(input)?,
                            });
                        }
                        "thinking" => {
                            b.check_known(&["type", "thinking", "signature"])?;
                            b.str("signature")?;
                            let text = b.req_str("thinking")?;
                            if !text.is_empty() {
                                append_reasoning(&mut msg.reasoning, text);
                            }
                        }
                        "image" | "tool_result" => {
                            return Err(RecipeError::invalid(
                                b.at("type"),
                                format!("{ty} blocks are only allowed in user messages"),
                            ))
                        }
                        other => return Err(unknown_block(b, other)),
                    }
                }
                msg.content = normalize_content(msg.content);
                calls.record(&msg.tool_calls);
                out.push(msg);
            }
            other => return Err(unknown_role(&m, other)),
        }
    }
    Ok(())
}

fn unknown_role(m: &Fields, role: &str) -> RecipeError {
    RecipeError::invalid(
        m.at("role"),
        format!("unknown role {role:?} (expected user or assistant)"),
    )
}

fn unknown_block(b: &Fields, ty: &str) -> RecipeError {
    if UNSUPPORTED_BLOCKS.contains(&ty) {
        unsupported_field(&b.at("type"), ty, "this content block type")
    } else {
        RecipeError::invalid(b.at("type"), format!("unknown content block type {ty:?}"))
    }
}

fn tool_result(b: &Fields, calls: &CallTracker) -> Result<Message> {
    b.check_known(&[
        "type",
        "tool_use_id",
        "content",
        "is_error",
        "cache_control",
    ])?;
    let id = b.req_str("tool_use_id")?;
    let name = calls.resolve(id, &b.at("tool_use_id"))?;
    let is_error = b.bool("is_error")?.unwrap_or(false);
    let content = match b.get("content") {
        None => Vec::new(),
        Some(Value::String(s)) => normalize_content(vec![ContentPart::Text { text: s.clone() }]),
        Some(Value::Array(list)) => {
            let mut parts = Vec::with_capacity(list.len());
            for (j, v) in list.iter().enumerate() {
                let cb = Fields::new(v, &index(&b.at("content"), j))?;
                match cb.req_str("type")? {
                    "text" => parts.push(text_block(&cb)?),
                    "image" => parts.push(image_block(&cb)?),
                    other => return Err(unknown_block(&cb, other)),
                }
            }
            normalize_content(parts)
        }
        Some(other) => {
            return Err(expected(
                &b.at("content"),
                "string or array of content blocks",
                other,
            ))
        }
    };
    Ok(Message {
        role: Role::Tool,
        content,
        reasoning: None,
        tool_calls: Vec::new(),
        tool_call_id: Some(id.to_string()),
        name: Some(name),
        is_error,
    })
}
