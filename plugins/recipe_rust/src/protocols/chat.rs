//! OpenAI Chat Completions request -> ``EngineRequest``.
//!
//! Accepted: ``model`` (required), ``messages`` (system / developer / user /
//! assistant / tool), ``tools`` (type function), ``tool_choice``,
//! ``parallel_tool_calls`` (false only with a forced tool choice), ``response_format``, ``temperature``,
//! ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``n``,
//! ``logprobs``, ``top_logprobs``, ``presence_penalty``, ``frequency_penalty``,
//! ``stream``, ``stream_options.include_usage``, ``metadata``, ``user``,
//! ``safety_identifier``, ``prompt_cache_key`` (both carried, affecting nothing),
//! ``prompt_cache_retention`` ("in_memory" only), ``reasoning_effort``, ``store``
//! (false only), ``modalities`` (["text"] only), ``logit_bias`` (token id ->
//! bias in [-100, 100]), ``service_tier`` ("auto"/"default" only).
//!
//! vLLM's sampling extensions: ``top_k`` (0 or -1 disables it), ``min_p``,
//! ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
//! ``include_stop_str_in_output``, ``skip_special_tokens``.
//!
//! Streaming writes every choice (``n``) and the log-probabilities (``output::sse``).
//!
//! Thinking on/off: DeepSeek's ``thinking: {"type": "enabled"|"disabled"}`` (an
//! optional ``budget_tokens`` is accepted too, as in Anthropic) and vLLM's
//! ``chat_template_kwargs: {"thinking": bool}`` or ``{"enable_thinking": bool}``
//! (no other template kwargs); contradicting settings are an error.
//! ``reasoning_effort: "none"`` turns thinking off unless a thinking setting turned it on
//! (DeepSeek's adapter: the explicit setting wins); other efforts set the effort.
//! Assistant history reasoning: ``reasoning_content`` (DeepSeek) or ``reasoning`` (vLLM).
//!
//! ``image_url.detail`` sizes the image as in V4.1's preprocessing (``crate::image_fit``).
//!
//! Ignored hints: ``response_format.json_schema.description``, ``stream_options.continuous_usage_stats``.

use serde_json::Value;

use super::*;
use crate::conversation::*;
use crate::error::{index, RecipeError, Result};

const TOP_LEVEL: &[&str] = &[
    "model",
    // powertrain's extension (vLLM's spelling): output constraints.
    "structured_outputs",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "n",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream",
    "stream_options",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning_effort",
    "thinking",
    "chat_template_kwargs",
    // Known, accepted only in their harmless form or rejected as unsupported:
    "store",
    "modalities",
    "service_tier",
    "audio",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "verbosity",
    // vLLM's sampling extensions.
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
];

pub fn parse(body: &Value) -> Result<EngineRequest> {
    let top = Fields::new(body, "")?;
    top.check_known(TOP_LEVEL)?;

    top.reject("audio", "audio output")?;
    top.reject("prediction", "predicted outputs")?;
    top.reject("web_search_options", "web search")?;
    top.reject("functions", "legacy functions; use `tools`")?;
    top.reject("function_call", "legacy function_call; use `tool_choice`")?;
    top.reject("verbosity", "verbosity control")?;
    if top.bool("store")? == Some(true) {
        return Err(unsupported_field(
            &top.at("store"),
            "store",
            "stored completions",
        ));
    }
    if let Some(modalities) = top.array("modalities")? {
        for (i, m) in modalities.iter().enumerate() {
            let path = index(&top.at("modalities"), i);
            if as_str(m, &path)? != "text" {
                return Err(unsupported_field(&path, "modalities", "only text output"));
            }
        }
    }
    check_openai_options(&top)?;

    let model = top.req_str("model")?.to_string();

    // Tools first: tool_choice is checked against them.
    let tools = match top.array("tools")? {
        Some(items) => parse_tools(items, &top.at("tools"))?,
        None => Vec::new(),
    };
    let tool_choice = match top.get("tool_choice") {
        Some(v) => parse_tool_choice(v, &top.at("tool_choice"), &tools)?,
        None => ToolChoice::Auto,
    };
    let single_tool_call = openai_single_tool_call(&top, &tool_choice, &tools)?;

    let messages_value = top.require("messages")?;
    let messages = parse_messages(
        as_array(messages_value, &top.at("messages"))?,
        &top.at("messages"),
    )?;

    let thinking = parse_thinking(&top)?;

    let sampling = parse_sampling(&top)?;
    let response_format = match top.get("response_format") {
        Some(v) => parse_response_format(v, &top.at("response_format"))?,
        None => ResponseFormat::Text,
    };

    let stream = top.bool("stream")?.unwrap_or(false);
    let mut include_usage = false;
    if let Some(opts) = top.object("stream_options")? {
        opts.check_known(&[
            "include_usage",
            "continuous_usage_stats",
            "include_obfuscation",
        ])?;
        if !stream {
            return Err(RecipeError::invalid(
                top.at("stream_options"),
                "stream_options is only allowed when stream is true",
            ));
        }
        include_usage = opts.bool("include_usage")?.unwrap_or(false);
        opts.bool("continuous_usage_stats")?;
        opts.bool("include_obfuscation")?;
    }
    let metadata = openai_metadata(&top)?;
    let user = top.str("user")?.map(str::to_string);
    let (safety_identifier, prompt_cache_key) = openai_identifiers(&top)?;

    let structured_outputs = parse_structured_outputs(&top, &response_format, "response_format")?;

    Ok(EngineRequest {
        protocol: Protocol::ChatCompletions,
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
        include_usage,
        reasoning_summary: None,
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

fn parse_sampling(top: &Fields) -> Result<SamplingSettings> {
    let mut s = SamplingSettings {
        temperature: top.f64_in("temperature", 0.0, 2.0, false)?,
        top_p: top.f64_in("top_p", 0.0, 1.0, true)?,
        ..SamplingSettings::default()
    };
    let max_tokens = top.positive_u32("max_tokens")?;
    let max_completion = top.positive_u32("max_completion_tokens")?;
    if let (Some(a), Some(b)) = (max_tokens, max_completion) {
        if a != b {
            return Err(RecipeError::invalid(
                top.at("max_tokens"),
                "max_tokens and max_completion_tokens disagree; send one of them",
            ));
        }
    }
    s.max_tokens = max_completion.or(max_tokens);
    if let Some(v) = top.get("stop") {
        s.stop = string_or_list(v, &top.at("stop"))?;
    }
    s.seed = top.u64("seed")?;
    s.n = top.positive_u32("n")?.unwrap_or(1);
    s.logprobs = top.bool("logprobs")?.unwrap_or(false);
    if let Some(k) = top.u32("top_logprobs")? {
        if k > 20 {
            return Err(RecipeError::invalid(
                top.at("top_logprobs"),
                format!("must be in 0..=20, got {k}"),
            ));
        }
        if !s.logprobs {
            return Err(RecipeError::invalid(
                top.at("top_logprobs"),
                "top_logprobs requires logprobs: true",
            ));
        }
        s.top_logprobs = Some(k);
    }
    s.presence_penalty = top.f64_in("presence_penalty", -2.0, 2.0, false)?;
    s.frequency_penalty = top.f64_in("frequency_penalty", -2.0, 2.0, false)?;
    s.logit_bias = parse_logit_bias(top)?;
    parse_vllm_sampling(top, &mut s)?;
    Ok(s)
}

/// ``{"token id": bias}``; whether an id is in the vocabulary is the engine's check.
fn parse_logit_bias(top: &Fields) -> Result<Vec<(u32, f64)>> {
    let Some(bias) = top.object("logit_bias")? else {
        return Ok(Vec::new());
    };
    let mut pairs = Vec::with_capacity(bias.map.len());
    for key in bias.map.keys() {
        let token = key.parse::<u32>().map_err(|_| {
            RecipeError::invalid(
                bias.at(key),
                format!("logit_bias keys must be token ids (decimal integers >= 0), got {key:?}"),
            )
        })?;
        if let Some(value) = bias.f64_in(key, -100.0, 100.0, false)? {
            pairs.push((token, value));
        }
    }
    Ok(pairs)
}

/// vLLM's extensions, so clients written for vLLM work unchanged; the ranges are
/// the engine's (``SamplingParams``), checked here so the error names the field.
fn parse_vllm_sampling(top: &Fields, s: &mut SamplingSettings) -> Result<()> {
    s.top_k = match top.get("top_k") {
        Some(v) if v.as_i64() == Some(-1) => Some(0), // vLLM's older spelling of "off"
        Some(v) => Some(as_u32(v, &top.at("top_k"))?),
        None => None,
    };
    s.min_p = top.f64_in("min_p", 0.0, 1.0, false)?;
    if let Some(x) = top.f64("repetition_penalty")? {
        if !(x > 0.0 && x.is_finite()) {
            return Err(RecipeError::invalid(
                top.at("repetition_penalty"),
                format!("must be > 0 (1 disables it), got {x}"),
            ));
        }
        s.repetition_penalty = Some(x);
    }
    s.min_tokens = top.u32("min_tokens")?;
    if let (Some(min), Some(max)) = (s.min_tokens, s.max_tokens) {
        if min > max {
            return Err(RecipeError::invalid(
                top.at("min_tokens"),
                format!("must be <= max_tokens ({max}), got {min}"),
            ));
        }
    }
    s.ignore_eos = top.bool("ignore_eos")?.unwrap_or(false);
    if let Some(ids) = top.array("stop_token_ids")? {
        for (i, v) in ids.iter().enumerate() {
            s.stop_token_ids
                .push(as_u32(v, &index(&top.at("stop_token_ids"), i))?);
        }
    }
    s.include_stop_str_in_output = top.bool("include_stop_str_in_output")?.unwrap_or(false);
    s.skip_special_tokens = top.bool("skip_special_tokens")?.unwrap_or(true);
    Ok(())
}

fn parse_thinking(top: &Fields) -> Result<Thinking> {
    let mut thinking = Thinking::default();
    let set = |enabled: bool, path: String, thinking: &mut Thinking| -> Result<()> {
        if let Some(previous) = thinking.enabled {
            if previous != enabled {
                return Err(RecipeError::invalid(
                    path,
                    "contradicts another thinking setting of this request",
                ));
            }
        }
        thinking.enabled = Some(enabled);
        Ok(())
    };
    if let Some(t) = top.object("thinking")? {
        t.check_known(&["type", "budget_tokens"])?;
        match t.req_str("type")? {
            "enabled" => set(true, t.at("type"), &mut thinking)?,
            "disabled" => set(false, t.at("type"), &mut thinking)?,
            other => {
                return Err(RecipeError::invalid(
                    t.at("type"),
                    format!("unknown thinking type {other:?} (expected enabled or disabled)"),
                ))
            }
        }
        thinking.budget_tokens = t.positive_u32("budget_tokens")?;
    }
    if let Some(kwargs) = top.object("chat_template_kwargs")? {
        kwargs.check_known(&["thinking", "enable_thinking"])?;
        for key in ["thinking", "enable_thinking"] {
            if let Some(on) = kwargs.bool(key)? {
                set(on, kwargs.at(key), &mut thinking)?;
            }
        }
    }
    if let Some(effort) = top.str("reasoning_effort")? {
        apply_effort(&mut thinking, effort, &top.at("reasoning_effort"))?;
    }
    Ok(thinking)
}

pub(crate) fn parse_response_format(value: &Value, path: &str) -> Result<ResponseFormat> {
    let f = Fields::new(value, path)?;
    match f.req_str("type")? {
        "text" => {
            f.check_known(&["type"])?;
            Ok(ResponseFormat::Text)
        }
        "json_object" => {
            f.check_known(&["type"])?;
            Ok(ResponseFormat::JsonObject)
        }
        "json_schema" => {
            f.check_known(&["type", "json_schema"])?;
            let js = f.object("json_schema")?.ok_or_else(|| f.missing("json_schema"))?;
            js.check_known(&["name", "schema", "strict", "description"])?;
            json_schema_format(&js)
        }
        other => Err(RecipeError::invalid(
            f.at("type"),
            format!("unknown response format type {other:?} (expected text, json_object or json_schema)"),
        )),
    }
}

/// ``{name, schema, strict, description}`` (shared with Responses' ``text.format``).
pub(crate) fn json_schema_format(f: &Fields) -> Result<ResponseFormat> {
    let name = f.req_str("name")?;
    check_tool_name(name, &f.at("name")).map_err(|_| {
        RecipeError::invalid(
            f.at("name"),
            format!("schema name {name:?} must match ^[A-Za-z0-9_-]{{1,64}}$"),
        )
    })?;
    let schema = schema_object(f.require("schema")?, &f.at("schema"))?;
    f.str("description")?;
    let strict = f.bool("strict")?.unwrap_or(false);
    Ok(ResponseFormat::JsonSchema {
        name: name.to_string(),
        schema,
        strict,
    })
}

fn parse_tools(items: &[Value], path: &str) -> Result<Vec<Tool>> {
    let mut tools: Vec<Tool> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let tp = index(path, i);
        let t = Fields::new(item, &tp)?;
        t.check_known(&["type", "function"])?;
        let ty = t.req_str("type")?;
        if ty != "function" {
            if ty == "custom" {
                return Err(unsupported_field(
                    &t.at("type"),
                    "custom",
                    "custom (free-form) tools; use function tools",
                ));
            }
            return Err(RecipeError::invalid(
                t.at("type"),
                format!("unknown tool type {ty:?} (expected function)"),
            ));
        }
        let f = t.object("function")?.ok_or_else(|| t.missing("function"))?;
        f.check_known(&["name", "description", "parameters", "strict"])?;
        tools.push(function_tool(&f, &tools)?);
    }
    Ok(tools)
}

fn parse_tool_choice(value: &Value, path: &str, tools: &[Tool]) -> Result<ToolChoice> {
    let choice = match value {
        Value::String(s) => openai_tool_choice_word(s, path)?,
        Value::Object(_) => {
            let f = Fields::new(value, path)?;
            let ty = f.req_str("type")?;
            match ty {
                "function" => {
                    f.check_known(&["type", "function"])?;
                    let func = f.object("function")?.ok_or_else(|| f.missing("function"))?;
                    func.check_known(&["name"])?;
                    let name = func.req_str("name")?;
                    named_choice(name, &func.at("name"), tools)?
                }
                "allowed_tools" | "custom" => {
                    return Err(unsupported_field(
                        &f.at("type"),
                        ty,
                        "this tool_choice form",
                    ))
                }
                other => {
                    return Err(RecipeError::invalid(
                        f.at("type"),
                        format!("unknown tool_choice type {other:?} (expected function)"),
                    ))
                }
            }
        }
        other => return Err(expected(path, "string or object", other)),
    };
    check_choice_has_tools(&choice, path, tools)?;
    Ok(choice)
}

/// A named tool_choice must name a declared tool.
pub(crate) fn named_choice(name: &str, path: &str, tools: &[Tool]) -> Result<ToolChoice> {
    if !tools.iter().any(|t| t.name == name) {
        let known: Vec<String> = tools.iter().map(|t| format!("{:?}", t.name)).collect();
        let known = if known.is_empty() {
            "the request declares no tools".to_string()
        } else {
            format!("the request's tools are {}", known.join(", "))
        };
        return Err(RecipeError::invalid(
            path,
            format!("tool_choice names the tool {name:?}, which is not in tools ({known}); name one of them, or declare it in tools"),
        ));
    }
    Ok(ToolChoice::Named(name.to_string()))
}

pub(crate) fn check_choice_has_tools(
    choice: &ToolChoice,
    path: &str,
    tools: &[Tool],
) -> Result<()> {
    if *choice == ToolChoice::Required && tools.is_empty() {
        return Err(RecipeError::invalid(
            path,
            "tool_choice requires a tool call but no tools are given",
        ));
    }
    Ok(())
}

fn parse_messages(items: &[Value], path: &str) -> Result<Vec<Message>> {
    if items.is_empty() {
        return Err(RecipeError::invalid(
            path,
            "at least one message is required",
        ));
    }
    let mut calls = CallTracker::default();
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let mp = index(path, i);
        let m = Fields::new(item, &mp)?;
        let role = m.req_str("role")?;
        let message = match role {
            "system" | "developer" => {
                m.check_known(&["role", "content", "name"])?;
                m.reject("name", "participant names")?;
                let content = text_content(m.require("content")?, &m.at("content"), &["text"])?;
                let role = if role == "system" {
                    Role::System
                } else {
                    Role::Developer
                };
                plain(role, content)
            }
            "user" => {
                m.check_known(&["role", "content", "name"])?;
                m.reject("name", "participant names")?;
                let content = user_content(m.require("content")?, &m.at("content"))?;
                plain(Role::User, content)
            }
            "assistant" => {
                m.check_known(&[
                    "role",
                    "content",
                    "name",
                    "tool_calls",
                    "reasoning_content",
                    "reasoning",
                    "refusal",
                    "audio",
                    "function_call",
                ])?;
                m.reject("name", "participant names")?;
                m.reject("audio", "audio output")?;
                m.reject("function_call", "legacy function_call; use tool_calls")?;
                m.reject("refusal", "a separate refusal; put the text in content")?;
                let content = match m.get("content") {
                    Some(v) => text_content(v, &m.at("content"), &["text", "refusal"])?,
                    None => Vec::new(),
                };
                let mut reasoning = None;
                for key in ["reasoning_content", "reasoning"] {
                    if let Some(text) = m.str(key)? {
                        if reasoning.is_some() {
                            return Err(RecipeError::invalid(
                                m.at(key),
                                "send reasoning_content or reasoning, not both",
                            ));
                        }
                        reasoning = Some(text.to_string());
                    }
                }
                let tool_calls = match m.array("tool_calls")? {
                    Some(list) => parse_tool_calls(list, &m.at("tool_calls"))?,
                    None => Vec::new(),
                };
                calls.record(&tool_calls);
                Message {
                    role: Role::Assistant,
                    content,
                    reasoning,
                    tool_calls,
                    tool_call_id: None,
                    name: None,
                    is_error: false,
                }
            }
            "tool" => {
                m.check_known(&["role", "content", "tool_call_id", "name"])?;
                let id = m.req_str("tool_call_id")?;
                let name = calls.resolve(id, &m.at("tool_call_id"))?;
                if let Some(given) = m.str("name")? {
                    if given != name {
                        return Err(RecipeError::invalid(
                            m.at("name"),
                            format!("name {given:?} does not match the call's tool {name:?}"),
                        ));
                    }
                }
                let content = text_content(m.require("content")?, &m.at("content"), &["text"])?;
                Message {
                    role: Role::Tool,
                    content,
                    reasoning: None,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(id.to_string()),
                    name: Some(name),
                    is_error: false,
                }
            }
            "function" => {
                return Err(unsupported_field(
                    &m.at("role"),
                    "function",
                    "legacy function messages; use role tool",
                ))
            }
            other => {
                return Err(RecipeError::invalid(
                    m.at("role"),
                    format!(
                    "unknown role {other:?} (expected system, developer, user, assistant or tool)"
                ),
                ))
            }
        };
        out.push(message);
    }
    Ok(out)
}

fn plain(role: Role, content: Vec<ContentPart>) -> Message {
    Message {
        role,
        content,
        reasoning: None,
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        is_error: false,
    }
}

fn parse_tool_calls(items: &[Value], path: &str) -> Result<Vec<ToolCall>> {
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let cp = index(path, i);
        let c = Fields::new(item, &cp)?;
        c.check_known(&["id", "type", "function"])?;
        let ty = c.req_str("type")?;
        if ty != "function" {
            return Err(RecipeError::invalid(
                c.at("type"),
                format!("unknown tool call type {ty:?} (expected function)"),
            ));
        }
        let id = c.req_str("id")?;
        check_call_id(id, &c.at("id"))?;
        let f = c.object("function")?.ok_or_else(|| c.missing("function"))?;
        f.check_known(&["name", "arguments"])?;
        let name = f.req_str("name")?;
        check_tool_name(name, &f.at("name"))?;
        let arguments = compact_arguments(f.req_str("arguments")?, &f.at("arguments"))?;
        out.push(ToolCall {
            id: id.to_string(),
            name: name.to_string(),
            arguments,
        });
    }
    Ok(out)
}

/// String, or an array of parts whose types are in ``allowed`` (text-like parts).
fn text_content(value: &Value, path: &str, allowed: &[&str]) -> Result<Vec<ContentPart>> {
    match value {
        Value::String(s) => Ok(normalize_content(vec![ContentPart::Text {
            text: s.clone(),
        }])),
        Value::Array(items) => {
            let mut parts = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let pp = index(path, i);
                let p = Fields::new(item, &pp)?;
                let ty = p.req_str("type")?;
                if !allowed.contains(&ty) {
                    return Err(RecipeError::invalid(
                        p.at("type"),
                        format!(
                            "content part type {ty:?} is not allowed here (expected {})",
                            allowed.join(" or ")
                        ),
                    ));
                }
                parts.push(text_part(&p, ty)?);
            }
            Ok(normalize_content(parts))
        }
        other => Err(expected(path, "string or array of content parts", other)),
    }
}

fn text_part(p: &Fields, ty: &str) -> Result<ContentPart> {
    if ty == "refusal" {
        p.check_known(&["type", "refusal"])?;
        return Ok(ContentPart::Text {
            text: p.req_str("refusal")?.to_string(),
        });
    }
    p.check_known(&["type", "text"])?;
    Ok(ContentPart::Text {
        text: p.req_str("text")?.to_string(),
    })
}

fn user_content(value: &Value, path: &str) -> Result<Vec<ContentPart>> {
    let Value::Array(items) = value else {
        return text_content(value, path, &["text"]);
    };
    let mut parts = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let pp = index(path, i);
        let p = Fields::new(item, &pp)?;
        let ty = p.req_str("type")?;
        match ty {
            "text" => parts.push(text_part(&p, ty)?),
            "image_url" => {
                p.check_known(&["type", "image_url"])?;
                let img = p
                    .object("image_url")?
                    .ok_or_else(|| p.missing("image_url"))?;
                img.check_known(&["url", "detail"])?;
                let url = img.req_str("url")?;
                if url.is_empty() {
                    return Err(RecipeError::invalid(img.at("url"), "must not be empty"));
                }
                let detail = images::detail_field(img.str("detail")?, &img.at("detail"))?;
                parts.push(images::image_from_url(url, &img.at("url"), detail)?);
            }
            "input_audio" => return Err(unsupported_field(&p.at("type"), ty, "audio input")),
            "file" => return Err(unsupported_field(&p.at("type"), ty, "file input")),
            other => {
                return Err(RecipeError::invalid(
                    p.at("type"),
                    format!("unknown content part type {other:?} (expected text or image_url)"),
                ))
            }
        }
    }
    Ok(normalize_content(parts))
}
