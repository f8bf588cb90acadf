//! Hugging Face chat templates, rendered with minijinja as transformers renders them.
//!
//! What transformers does (``transformers.utils.chat_template_utils``) and what is
//! reproduced here:
//! - the environment: ``trim_blocks=True, lstrip_blocks=True``, no
//!   ``keep_trailing_newline`` (a template's final newline is dropped), lenient
//!   undefined values, ``loopcontrols``;
//! - globals ``raise_exception(msg)`` and ``strftime_now(fmt)``, the ``tojson`` filter
//!   with Python's ``json.dumps`` spacing (``ensure_ascii=False`` by default, ``indent``,
//!   ``sort_keys``; no HTML escaping, unlike minijinja's own), Python string/dict/list
//!   methods through ``minijinja_contrib::pycompat``;
//! - ``{% generation %}`` / ``{% endgeneration %}`` (transformers' AssistantTracker)
//!   render their body unchanged;
//! - the context: ``messages`` as HF dicts, ``tools`` (None when empty),
//!   ``add_generation_prompt``, ``bos_token``, ``eos_token``, and ``enable_thinking`` /
//!   ``thinking`` / ``reasoning_effort`` when the conversation sets them.
//!
//! Message dicts: ``role``; ``content`` a string for text-only messages (left out for
//! an assistant turn with tool calls and no text: clients send null, and transformers
//! 5 drops null-valued keys, so the template sees it undefined), else a
//! list of ``{"type": "text", "text"}`` / ``{"type": "image", "url"}``;
//! ``reasoning_content``; ``tool_calls`` as ``[{"type": "function", "id",
//! "function": {"name", "arguments"}}]`` with ``arguments`` parsed into a dict (what
//! vLLM passes and Llama/Qwen/Hermes templates expect; a template that concatenates
//! ``arguments`` as a string, like DeepSeek-V3's, needs the string and is not served
//! by this); ``tool_call_id`` and ``name`` on tool results, and ``is_error: true`` on
//! a tool result that reports a failure (absent otherwise; a template that does not
//! read it renders the result as any other).
//! JSON objects keep their key order (an order-preserving map object), as Python dicts do.
//!
//! Trust: every string that came from the request (message text, reasoning, tool
//! call names, ids and arguments, tool names, descriptions and schema strings,
//! property names) is untrusted; only template text is trusted. The template is
//! rendered twice: once as is (the text transformers would produce), once with each
//! untrusted string's non-blank core wrapped in two private-use marker characters
//! (leading/trailing whitespace stays outside, so ``strip``/``trim`` still give the
//! same result). The marked rendering, markers removed, must equal the plain one;
//! then the markers give the untrusted byte ranges exactly. If the template
//! transformed untrusted text so that the two disagree (it sliced, split, compared
//! or re-encoded it), rendering fails with an error instead of guessing which text
//! is safe. Untrusted text containing a marker character is refused.

use std::collections::HashMap;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind as JErrorKind};
use serde_json::{json, Map, Value};

use super::{python_json_dumps, Prompt};
use crate::conversation::{ContentPart, Conversation, ReasoningEffort, Role};
use crate::error::{RecipeError, Result};

const OPEN: char = '\u{10FFF0}';
const CLOSE: char = '\u{10FFF1}';
const RAISED: &str = "chat template raised: ";

/// A compiled Hugging Face chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Tool-call arguments go in as a dict (else as their JSON text): see the module doc.
    arguments_as_mapping: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let source = strip_generation_tags(source);
        let arguments_as_mapping = wants_arguments_mapping(&source);
        env.add_template_owned("chat_template", source)
            .map_err(|e| {
                RecipeError::internal(format!(
                    "the model's chat template does not compile: {}",
                    describe(&e)
                ))
            })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
            arguments_as_mapping,
        })
    }

    /// Renders the conversation; see the module doc for how trust is tracked.
    pub fn render(
        &self,
        conversation: &Conversation,
        add_generation_prompt: bool,
    ) -> Result<Prompt> {
        check_no_markers(conversation)?;
        let plain = self.render_text(conversation, add_generation_prompt, false)?;
        let marked = self.render_text(conversation, add_generation_prompt, true)?;
        let prompt = split_marked(&marked)?;
        if prompt.text() != plain {
            return Err(RecipeError::internal(
                "the chat template transforms request text (slices, splits or compares it), so untrusted text \
                 cannot be located in the prompt safely; refusing to render",
            ));
        }
        Ok(prompt)
    }

    fn render_text(
        &self,
        conversation: &Conversation,
        add_generation_prompt: bool,
        mark: bool,
    ) -> Result<String> {
        let ctx = build_context(conversation, mark, self.arguments_as_mapping);
        let mut map: HashMap<&str, JValue> = HashMap::new();
        map.insert("messages", to_jinja(&ctx.messages));
        map.insert(
            "tools",
            if ctx.tools.is_empty() {
                JValue::from(())
            } else {
                to_jinja(&Value::Array(ctx.tools))
            },
        );
        map.insert("add_generation_prompt", JValue::from(add_generation_prompt));
        map.insert(
            "bos_token",
            self.bos_token
                .as_deref()
                .map(JValue::from)
                .unwrap_or_default(),
        );
        map.insert(
            "eos_token",
            self.eos_token
                .as_deref()
                .map(JValue::from)
                .unwrap_or_default(),
        );
        if let Some(enabled) = conversation.thinking.enabled {
            map.insert("enable_thinking", JValue::from(enabled));
            map.insert("thinking", JValue::from(enabled));
        }
        if let Some(effort) = conversation.thinking.effort {
            let name = match effort {
                ReasoningEffort::Minimal => "minimal",
                ReasoningEffort::Low => "low",
                ReasoningEffort::Medium => "medium",
                ReasoningEffort::High => "high",
                ReasoningEffort::Max => "max",
            };
            map.insert("reasoning_effort", JValue::from(name));
        }
        let template = self
            .env
            .get_template("chat_template")
            .map_err(|e| RecipeError::internal(format!("chat template: {}", describe(&e))))?;
        template.render(JValue::from(map)).map_err(|e| {
            let message = describe(&e);
            match message.find(RAISED) {
                Some(at) => {
                    RecipeError::invalid("messages", message[at + RAISED.len()..].to_string())
                }
                None => RecipeError::internal(format!(
                    "the model's chat template failed to render: {message}"
                )),
            }
        })
    }
}

fn describe(e: &JError) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

fn raise_exception(message: String) -> std::result::Result<JValue, JError> {
    Err(JError::new(
        JErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

fn tojson(value: JValue, kwargs: Kwargs) -> std::result::Result<JValue, JError> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<JValue> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JError::new(JErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(JValue::from_safe_string(python_json_dumps(
        &json,
        ensure_ascii.unwrap_or(false),
        indent,
        sort_keys.unwrap_or(false),
    )))
}

/// ``strftime_now(format)``: the current UTC time, with the common strftime codes.
fn strftime_now(format: String) -> std::result::Result<JValue, JError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(JValue::from(strftime(secs, &format)))
}

/// Formats unix time ``secs`` (UTC) with %Y %m %d %-d %e %H %M %S %B %b %A %a %y %j %p %I %%.
pub fn strftime(secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (hour, minute, second) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + if leap && month > 2 { 1 } else { 0 };
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut code = chars.next().unwrap_or('%');
        let no_pad = code == '-';
        if no_pad {
            code = chars.next().unwrap_or('%');
        }
        let num = |v: i64, width: usize| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        match code {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&num(year % 100, 2)),
            'm' => out.push_str(&num(month, 2)),
            'd' => out.push_str(&num(day, 2)),
            'e' => out.push_str(&format!("{day:2}")),
            'H' => out.push_str(&num(hour, 2)),
            'I' => out.push_str(&num(if hour % 12 == 0 { 12 } else { hour % 12 }, 2)),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'M' => out.push_str(&num(minute, 2)),
            'S' => out.push_str(&num(second, 2)),
            'j' => out.push_str(&num(yday, 3)),
            'B' => out.push_str(MONTHS[(month - 1) as usize]),
            'b' => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'a' => out.push_str(&DAYS[weekday][..3]),
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

/// Turns transformers' ``{% generation %}`` / ``{% endgeneration %}`` into a no-op block.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let left = if inner.starts_with('-') || inner.starts_with('+') {
            &inner[..1]
        } else {
            ""
        };
        let right = if inner.ends_with('-') || inner.ends_with('+') {
            &inner[inner.len() - 1..]
        } else {
            ""
        };
        let word = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        match word {
            "generation" => out.push_str(&format!("{{%{left} if true {right}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{left} endif {right}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

// ----------------------------------------------------------------------------
// Context building

struct Context {
    messages: Value,
    tools: Vec<Value>,
}

fn check_no_markers(conversation: &Conversation) -> Result<()> {
    let bad = |s: &str| s.contains(OPEN) || s.contains(CLOSE);
    let json_bad = |v: &Value| bad(&v.to_string());
    for (i, message) in conversation.messages.iter().enumerate() {
        let text_bad = message.content.iter().any(|p| match p {
            ContentPart::Text { text } => bad(text),
            ContentPart::Image { url } => bad(url),
        });
        let other_bad = message.reasoning.as_deref().is_some_and(bad)
            || message.tool_call_id.as_deref().is_some_and(bad)
            || message.name.as_deref().is_some_and(bad)
            || message
                .tool_calls
                .iter()
                .any(|c| bad(&c.id) || bad(&c.name) || bad(&c.arguments));
        if text_bad || other_bad {
            return Err(RecipeError::invalid(
                format!("messages[{i}]"),
                "contains the reserved characters U+10FFF0/U+10FFF1",
            ));
        }
    }
    for (i, tool) in conversation.tools.iter().enumerate() {
        if bad(&tool.name)
            || tool.description.as_deref().is_some_and(bad)
            || json_bad(&tool.parameters)
        {
            return Err(RecipeError::invalid(
                format!("tools[{i}]"),
                "contains the reserved characters U+10FFF0/U+10FFF1",
            ));
        }
    }
    Ok(())
}

/// Wraps the non-blank core of ``s`` in markers (whitespace stays outside).
fn wrap(s: &str, mark: bool) -> String {
    if !mark {
        return s.to_string();
    }
    let core = s.trim();
    if core.is_empty() {
        return s.to_string();
    }
    let start = s.len() - s.trim_start().len();
    let end = start + core.len();
    format!("{}{OPEN}{core}{CLOSE}{}", &s[..start], &s[end..])
}

/// Wraps every string (values, and object keys when ``keys``) of a JSON value.
fn wrap_json(value: &Value, mark: bool, keys: bool) -> Value {
    match value {
        Value::String(s) => Value::String(wrap(s, mark)),
        Value::Array(items) => {
            Value::Array(items.iter().map(|v| wrap_json(v, mark, keys)).collect())
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    (
                        if keys { wrap(k, mark) } else { k.clone() },
                        wrap_json(v, mark, keys),
                    )
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Wraps a JSON schema's strings: values everywhere, keys only where they are names
/// chosen by the client (under properties / $defs / definitions / patternProperties).
fn wrap_schema(value: &Value, mark: bool) -> Value {
    match value {
        Value::String(s) => Value::String(wrap(s, mark)),
        Value::Array(items) => Value::Array(items.iter().map(|v| wrap_schema(v, mark)).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let named = matches!(
                        k.as_str(),
                        "properties" | "$defs" | "definitions" | "patternProperties"
                    );
                    let inner = match (named, v) {
                        (true, Value::Object(props)) => Value::Object(
                            props
                                .iter()
                                .map(|(pk, pv)| (wrap(pk, mark), wrap_schema(pv, mark)))
                                .collect(),
                        ),
                        _ => wrap_schema(v, mark),
                    };
                    (k.clone(), inner)
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::System => "system",
        Role::Developer => "developer",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}

/// Whether the template treats tool-call ``arguments`` as a mapping: it pipes them
/// through ``tojson`` or checks ``arguments is string`` / ``is mapping`` itself.
fn wants_arguments_mapping(source: &str) -> bool {
    let compact: String = source.chars().filter(|c| !c.is_whitespace()).collect();
    compact.match_indices("arguments").any(|(at, word)| {
        // Past the subscript or call closers: ``.arguments``, ``['arguments']``, ``(x.arguments)``.
        let rest = compact[at + word.len()..].trim_start_matches(['\'', '"', ']', ')']);
        rest.starts_with("|tojson") || rest.starts_with("isstring") || rest.starts_with("ismapping")
    })
}

fn build_context(conversation: &Conversation, mark: bool, arguments_as_mapping: bool) -> Context {
    let mut messages = Vec::new();
    for message in &conversation.messages {
        let mut m = Map::new();
        m.insert("role".into(), json!(role_name(message.role)));
        let text_only = message
            .content
            .iter()
            .all(|p| matches!(p, ContentPart::Text { .. }));
        let content = if text_only {
            let text = message.joined_text();
            if text.is_empty() && message.role == Role::Assistant && !message.tool_calls.is_empty()
            {
                Value::Null
            } else {
                Value::String(wrap(&text, mark))
            }
        } else {
            Value::Array(
                message
                    .content
                    .iter()
                    .map(|p| match p {
                        ContentPart::Text { text } => {
                            json!({"type": "text", "text": wrap(text, mark)})
                        }
                        ContentPart::Image { url } => {
                            json!({"type": "image", "url": wrap(url, mark)})
                        }
                    })
                    .collect(),
            )
        };
        if !content.is_null() {
            m.insert("content".into(), content);
        }
        if let Some(reasoning) = &message.reasoning {
            m.insert(
                "reasoning_content".into(),
                Value::String(wrap(reasoning, mark)),
            );
        }
        if !message.tool_calls.is_empty() {
            let calls: Vec<Value> = message
                .tool_calls
                .iter()
                .map(|call| {
                    let parsed = serde_json::from_str::<Value>(&call.arguments).ok();
                    let arguments = match parsed {
                        Some(parsed) if arguments_as_mapping => wrap_json(&parsed, mark, true),
                        _ => Value::String(wrap(&call.arguments, mark)),
                    };
                    json!({
                        "type": "function",
                        "id": wrap(&call.id, mark),
                        "function": {"name": wrap(&call.name, mark), "arguments": arguments},
                    })
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(id) = &message.tool_call_id {
            m.insert("tool_call_id".into(), Value::String(wrap(id, mark)));
        }
        if let Some(name) = &message.name {
            m.insert("name".into(), Value::String(wrap(name, mark)));
        }
        if message.is_error {
            m.insert("is_error".into(), Value::Bool(true));
        }
        messages.push(Value::Object(m));
    }
    let tools = conversation
        .tools
        .iter()
        .map(|tool| {
            let mut function = Map::new();
            function.insert("name".into(), Value::String(wrap(&tool.name, mark)));
            if let Some(description) = &tool.description {
                function.insert("description".into(), Value::String(wrap(description, mark)));
            }
            function.insert("parameters".into(), wrap_schema(&tool.parameters, mark));
            json!({"type": "function", "function": Value::Object(function)})
        })
        .collect();
    Context {
        messages: Value::Array(messages),
        tools,
    }
}

/// A JSON object as a minijinja map that keeps its key order (as a Python dict does).
#[derive(Debug)]
struct OrderedMap(Vec<(String, JValue)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &JValue) -> Option<JValue> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(
            self.0
                .iter()
                .map(|(k, _)| JValue::from(k.as_str()))
                .collect(),
        )
    }
}

fn to_jinja(value: &Value) -> JValue {
    match value {
        Value::Null => JValue::from(()),
        Value::Bool(b) => JValue::from(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                JValue::from(i)
            } else if let Some(u) = n.as_u64() {
                JValue::from(u)
            } else {
                JValue::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => JValue::from(s.as_str()),
        Value::Array(items) => JValue::from(items.iter().map(to_jinja).collect::<Vec<_>>()),
        Value::Object(map) => JValue::from_object(OrderedMap(
            map.iter().map(|(k, v)| (k.clone(), to_jinja(v))).collect(),
        )),
    }
}

/// Splits the marked rendering into segments (marker depth > 0 is untrusted).
fn split_marked(marked: &str) -> Result<Prompt> {
    let mut prompt = Prompt::default();
    let mut depth: usize = 0;
    let mut current = String::new();
    let unbalanced = || {
        RecipeError::internal(
            "the chat template transforms request text (slices or splits it), so untrusted text cannot be \
             located in the prompt safely; refusing to render",
        )
    };
    for c in marked.chars() {
        match c {
            OPEN | CLOSE => {
                prompt.push(&current, depth == 0);
                current.clear();
                if c == OPEN {
                    depth += 1;
                } else {
                    depth = depth.checked_sub(1).ok_or_else(unbalanced)?;
                }
            }
            c => current.push(c),
        }
    }
    if depth != 0 {
        return Err(unbalanced());
    }
    prompt.push(&current, true);
    Ok(prompt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(
            strftime(1_709_211_909, "%d %b %Y %H:%M:%S %A %-d %B %j"),
            "29 Feb 2024 13:05:09 Thursday 29 February 060"
        );
    }

    #[test]
    fn generation_tags_become_blocks() {
        assert_eq!(
            strip_generation_tags("a{%- generation %}b{% endgeneration -%}c"),
            "a{%- if true %}b{% endif -%}c"
        );
    }
}
