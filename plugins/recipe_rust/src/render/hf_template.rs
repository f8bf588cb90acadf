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
//! call names, ids and arguments, tool names and descriptions, a tool schema's
//! strings and its keys other than JSON Schema keywords) is untrusted; only template
//! text is trusted. The template is rendered twice: once as is (the text
//! transformers would produce), once with each untrusted string's non-blank core
//! wrapped in two private-use marker characters (leading/trailing whitespace stays
//! outside, so ``strip``/``trim`` still give the same result). The marked rendering
//! must have balanced markers and, markers removed, equal the plain one; then the
//! markers give the untrusted byte ranges exactly. If the template transformed
//! untrusted text so that either check fails, rendering fails with an error instead
//! of guessing which text is safe. Untrusted text containing a marker character is
//! refused.
//!
//! Why two renderings, when the marked one alone gives the text once its markers are
//! stripped: balance alone misses the transformations that drop both markers of a
//! string. ``content[1:-1]`` or ``content[1]`` cut request characters out from between
//! the markers, and one rendering would take them for template text, free to spell a
//! special token. Run on the unmarked strings, the same template cuts at other
//! characters (the marked string is shifted by one), so the comparison refuses it. It
//! also refuses templates that branch on the exact text (``content == ...``,
//! ``content|length``), whose marked rendering is not the prompt transformers renders.
//! What neither check sees: a piece split out of the middle of a string
//! (``content.split(a)[1]``) is the same in both renderings and carries no marker.
//! Templates that split request text (Qwen3 and DeepSeek-V3 split assistant content
//! at ``</think>``) also print the string's last piece, whose lone
//! marker refuses the rendering; a template printing only a middle piece would not
//! be caught.

use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind as JErrorKind};
use serde_json::Value;

use super::{python_json_dumps, Prompt};
use crate::conversation::{ContentPart, Conversation, Message, ReasoningEffort, Role, Tool};
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
        let plain = self.render_text(conversation, add_generation_prompt, false)?;
        let marked = self.render_text(conversation, add_generation_prompt, true)?;
        split_marked(&marked, &plain)
    }

    /// The template's context: messages, tools and the template variables.
    fn context(
        &self,
        conversation: &Conversation,
        add_generation_prompt: bool,
        mark: bool,
    ) -> Result<JValue> {
        let mut messages = Vec::with_capacity(conversation.messages.len());
        for (i, message) in conversation.messages.iter().enumerate() {
            messages.push(
                message_value(message, mark, self.arguments_as_mapping)
                    .map_err(|Reserved| reserved(format!("messages[{i}]")))?,
            );
        }
        let tools = if conversation.tools.is_empty() {
            JValue::from(())
        } else {
            let mut tools = Vec::with_capacity(conversation.tools.len());
            for (i, tool) in conversation.tools.iter().enumerate() {
                tools.push(
                    tool_value(tool, mark).map_err(|Reserved| reserved(format!("tools[{i}]")))?,
                );
            }
            JValue::from(tools)
        };
        let token = |t: &Option<String>| t.as_deref().map(JValue::from).unwrap_or_default();
        let mut vars: Vec<(JValue, JValue)> = vec![
            ("messages".into(), JValue::from(messages)),
            ("tools".into(), tools),
            ("add_generation_prompt".into(), add_generation_prompt.into()),
            ("bos_token".into(), token(&self.bos_token)),
            ("eos_token".into(), token(&self.eos_token)),
        ];
        if let Some(enabled) = conversation.thinking.enabled {
            vars.push(("enable_thinking".into(), enabled.into()));
            vars.push(("thinking".into(), enabled.into()));
        }
        if let Some(effort) = conversation.thinking.effort {
            let name = match effort {
                ReasoningEffort::Minimal => "minimal",
                ReasoningEffort::Low => "low",
                ReasoningEffort::Medium => "medium",
                ReasoningEffort::High => "high",
                ReasoningEffort::Xhigh => "xhigh",
                ReasoningEffort::Max => "max",
            };
            vars.push(("reasoning_effort".into(), name.into()));
        }
        Ok(OrderedMap::value(vars))
    }

    fn render_text(
        &self,
        conversation: &Conversation,
        add_generation_prompt: bool,
        mark: bool,
    ) -> Result<String> {
        let context = self.context(conversation, add_generation_prompt, mark)?;
        let template = self
            .env
            .get_template("chat_template")
            .map_err(|e| RecipeError::internal(format!("chat template: {}", describe(&e))))?;
        template.render(context).map_err(|e| {
            let message = describe(&e);
            match message.find(RAISED) {
                Some(at) => {
                    RecipeError::invalid("messages", message[at + RAISED.len()..].to_string())
                }
                // A text-only template meets a list of parts it cannot handle: the
                // request's images are what it cannot render, not a server fault.
                None if conversation.image_count() > 0 => RecipeError::unsupported(
                    "messages",
                    format!("the model's chat template cannot render image parts: {message}"),
                ),
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
// Context building: request data straight to template values

/// An untrusted string held a reserved marker character.
struct Reserved;

fn has_marker(s: &str) -> bool {
    s.contains(OPEN) || s.contains(CLOSE)
}

/// An untrusted string as a template value: its non-blank core wrapped in markers
/// when ``mark`` (leading/trailing whitespace stays outside). Every untrusted string
/// goes through here, so this is where a marker character in request text is refused.
fn untrusted(s: &str, mark: bool) -> std::result::Result<JValue, Reserved> {
    if has_marker(s) {
        return Err(Reserved);
    }
    let core = s.trim();
    if !mark || core.is_empty() {
        return Ok(JValue::from(s));
    }
    let start = s.len() - s.trim_start().len();
    let end = start + core.len();
    let mut out = String::with_capacity(s.len() + 2 * OPEN.len_utf8());
    out.push_str(&s[..start]);
    out.push(OPEN);
    out.push_str(core);
    out.push(CLOSE);
    out.push_str(&s[end..]);
    Ok(JValue::from(out))
}

/// Which object keys of request JSON are untrusted text.
#[derive(Clone, Copy)]
enum Keys {
    /// Every key (tool-call arguments).
    All,
    /// A JSON schema's: every key but the JSON Schema keywords (``SCHEMA_KEYWORDS``),
    /// which templates look up (``param.type``) and which are fixed words no client
    /// chose. Names under properties / $defs / definitions / patternProperties are
    /// untrusted even when they spell a keyword.
    Schema,
}

/// JSON Schema keywords (drafts 4 to 2020-12, and OpenAPI's ``nullable``).
#[rustfmt::skip]
const SCHEMA_KEYWORDS: &[&str] = &[
    "$schema", "$id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary",
    "$comment", "$defs", "definitions", "type", "enum", "const", "properties",
    "patternProperties", "additionalProperties", "required", "items", "prefixItems",
    "additionalItems", "contains", "minContains", "maxContains", "allOf", "anyOf", "oneOf",
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties", "multipleOf", "maximum",
    "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern",
    "maxItems", "minItems", "uniqueItems", "maxProperties", "minProperties", "title",
    "description", "default", "deprecated", "readOnly", "writeOnly", "examples", "format",
    "contentEncoding", "contentMediaType", "contentSchema", "nullable",
];

/// Request JSON as a template value, every string untrusted (see ``Keys`` for keys).
fn json_value(value: &Value, mark: bool, keys: Keys) -> std::result::Result<JValue, Reserved> {
    Ok(match value {
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
        Value::String(s) => untrusted(s, mark)?,
        Value::Array(items) => JValue::from(
            items
                .iter()
                .map(|v| json_value(v, mark, keys))
                .collect::<std::result::Result<Vec<_>, _>>()?,
        ),
        Value::Object(map) => {
            let mut entries = Vec::with_capacity(map.len());
            for (k, v) in map {
                let entry = match keys {
                    Keys::All => (untrusted(k, mark)?, json_value(v, mark, keys)?),
                    Keys::Schema => {
                        let key = if SCHEMA_KEYWORDS.contains(&k.as_str()) {
                            JValue::from(k.as_str())
                        } else {
                            untrusted(k, mark)?
                        };
                        let names = matches!(
                            k.as_str(),
                            "properties" | "$defs" | "definitions" | "patternProperties"
                        );
                        let inner = match (names, v) {
                            (true, Value::Object(props)) => {
                                let mut named = Vec::with_capacity(props.len());
                                for (pk, pv) in props {
                                    named.push((untrusted(pk, mark)?, json_value(pv, mark, keys)?));
                                }
                                OrderedMap::value(named)
                            }
                            _ => json_value(v, mark, keys)?,
                        };
                        (key, inner)
                    }
                };
                entries.push(entry);
            }
            OrderedMap::value(entries)
        }
    })
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

/// One message as the HF message dict (see the module doc).
fn message_value(
    message: &Message,
    mark: bool,
    arguments_as_mapping: bool,
) -> std::result::Result<JValue, Reserved> {
    let text = |s: &str| untrusted(s, mark);
    let mut m: Vec<(JValue, JValue)> = Vec::with_capacity(4);
    m.push(("role".into(), role_name(message.role).into()));
    let text_only = message
        .content
        .iter()
        .all(|p| matches!(p, ContentPart::Text { .. }));
    if text_only {
        let joined = message.joined_text();
        let no_content =
            joined.is_empty() && message.role == Role::Assistant && !message.tool_calls.is_empty();
        if !no_content {
            m.push(("content".into(), text(&joined)?));
        }
    } else {
        let mut parts = Vec::with_capacity(message.content.len());
        for part in &message.content {
            parts.push(match part {
                ContentPart::Text { text: t } => OrderedMap::value(vec![
                    ("type".into(), "text".into()),
                    ("text".into(), text(t)?),
                ]),
                ContentPart::Image { url, .. } => OrderedMap::value(vec![
                    ("type".into(), "image".into()),
                    ("url".into(), text(url)?),
                ]),
            });
        }
        m.push(("content".into(), JValue::from(parts)));
    }
    if let Some(reasoning) = &message.reasoning {
        m.push(("reasoning_content".into(), text(reasoning)?));
    }
    if !message.tool_calls.is_empty() {
        let mut calls = Vec::with_capacity(message.tool_calls.len());
        for call in &message.tool_calls {
            let parsed = arguments_as_mapping
                .then(|| serde_json::from_str::<Value>(&call.arguments).ok())
                .flatten();
            let arguments = match parsed {
                Some(parsed) => json_value(&parsed, mark, Keys::All)?,
                None => text(&call.arguments)?,
            };
            let function = OrderedMap::value(vec![
                ("name".into(), text(&call.name)?),
                ("arguments".into(), arguments),
            ]);
            calls.push(OrderedMap::value(vec![
                ("type".into(), "function".into()),
                ("id".into(), text(&call.id)?),
                ("function".into(), function),
            ]));
        }
        m.push(("tool_calls".into(), JValue::from(calls)));
    }
    if let Some(id) = &message.tool_call_id {
        m.push(("tool_call_id".into(), text(id)?));
    }
    if let Some(name) = &message.name {
        m.push(("name".into(), text(name)?));
    }
    if message.is_error {
        m.push(("is_error".into(), true.into()));
    }
    Ok(OrderedMap::value(m))
}

/// One tool as ``{"type": "function", "function": {name, description?, parameters}}``.
fn tool_value(tool: &Tool, mark: bool) -> std::result::Result<JValue, Reserved> {
    let mut function = vec![("name".into(), untrusted(&tool.name, mark)?)];
    if let Some(description) = &tool.description {
        function.push(("description".into(), untrusted(description, mark)?));
    }
    function.push((
        "parameters".into(),
        json_value(&tool.parameters, mark, Keys::Schema)?,
    ));
    Ok(OrderedMap::value(vec![
        ("type".into(), "function".into()),
        ("function".into(), OrderedMap::value(function)),
    ]))
}

fn reserved(path: String) -> RecipeError {
    RecipeError::invalid(path, "contains the reserved characters U+10FFF0/U+10FFF1")
}

/// A JSON object as a minijinja map that keeps its key order (as a Python dict does).
/// Few keys, so lookup is a linear scan.
#[derive(Debug)]
struct OrderedMap(Vec<(JValue, JValue)>);

impl OrderedMap {
    fn value(entries: Vec<(JValue, JValue)>) -> JValue {
        JValue::from_object(OrderedMap(entries))
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &JValue) -> Option<JValue> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }
}

/// Splits the marked rendering into segments (marker depth > 0 is untrusted), checking
/// on the way that its text, markers removed, is ``plain`` (see the module doc).
fn split_marked(marked: &str, plain: &str) -> Result<Prompt> {
    let refuse = || {
        RecipeError::internal(
            "the chat template transforms request text (slices, splits or compares it), so untrusted text \
             cannot be located in the prompt safely; refusing to render",
        )
    };
    let mut prompt = Prompt::default();
    let mut depth: usize = 0;
    let mut start = 0; // of the current piece in ``marked``
    let mut at_plain = 0; // where the current piece must be in ``plain``
    let mut piece_end = |prompt: &mut Prompt, piece: &str, trusted: bool| {
        let end = at_plain + piece.len();
        if plain.get(at_plain..end) != Some(piece) {
            return Err(refuse());
        }
        at_plain = end;
        prompt.push(piece, trusted);
        Ok(())
    };
    // Both markers are four UTF-8 bytes that differ only in the last.
    let (open, close) = (OPEN.to_string(), CLOSE.to_string());
    let lead = open.as_bytes()[0];
    let bytes = marked.as_bytes();
    for at in memchr::memchr_iter(lead, bytes) {
        let marker = &bytes[at..bytes.len().min(at + 4)];
        let opens = marker == open.as_bytes();
        if !opens && marker != close.as_bytes() {
            continue;
        }
        piece_end(&mut prompt, &marked[start..at], depth == 0)?;
        start = at + 4;
        depth = if opens {
            depth + 1
        } else {
            depth.checked_sub(1).ok_or_else(refuse)?
        };
    }
    if depth != 0 {
        return Err(refuse());
    }
    piece_end(&mut prompt, &marked[start..], true)?;
    if at_plain != plain.len() {
        return Err(refuse());
    }
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
