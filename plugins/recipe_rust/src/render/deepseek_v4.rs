//! DeepSeek-V4's native chat encoder (the model ships no Jinja chat template).
//!
//! The oracle is DeepSeek's own adapter, ``deepseek-recipe`` on PyPI (its
//! ``DeepseekV4Encoding``): ``tests/test_official_parity.py`` renders a seeded corpus
//! of requests in all three protocols with both and requires the same prompt text and
//! token ids, apart from the differences listed in the recipe README. Earlier
//! sources: DeepSeek's reference ``encoding/encoding_dsv4.py`` and vLLM's wrapper.
//!
//! The format, as implemented:
//! - ``<｜begin▁of▁sentence｜>`` first. Thinking is on unless the request turns it off;
//!   in thinking mode a "Reasoning Effort" paragraph follows for efforts medium, high
//!   (the default) and xhigh ("Absolute maximum ...") and max ("Beyond maximum ..."),
//!   none for minimal and low.
//! - system: every system message's text, in order, joined by a blank line, opens the
//!   prompt wherever the messages stood; then ``"\n\n" + TOOLS_TEMPLATE`` with one JSON
//!   line per tool (``{"name", "description", "parameters"}``, an absent description
//!   as ``""``, Python ``json.dumps`` spacing, DeepSeek's float spelling) when the
//!   request has tools and ``tool_choice`` is not "none" (which leaves them out). With
//!   tools and no system text the system part is empty.
//! - user: ``<｜User｜>`` + text. ``developer`` messages are user text (as the official
//!   adapter reads a Responses developer item). Tool results are merged into user
//!   turns as ``<tool_result>..</tool_result>`` blocks (a tool message joins the
//!   preceding merged user turn, a user message joins a preceding merged turn too),
//!   blocks joined by ``"\n\n"``, tool results re-ordered to the order of the
//!   assistant's calls. A result with ``is_error`` is rendered like any other.
//! - after a user turn that is followed by an assistant turn or ends the prompt:
//!   ``<｜Assistant｜>`` + ``<think>`` (thinking mode, and the turn is the last user turn
//!   or thinking is not dropped) or ``</think>`` (otherwise).
//! - assistant: [reasoning + ``</think>`` in thinking mode when after the last user turn or
//!   thinking is not dropped] + content + [``"\n\n<｜DSML｜tool_calls>\n"`` + invokes joined
//!   by "\n" + ``"\n</｜DSML｜tool_calls>"``] + ``<｜end▁of▁sentence｜>``; an invoke is
//!   ``<｜DSML｜invoke name="N">\n`` + one ``<｜DSML｜parameter name="K"
//!   string="true|false">V</｜DSML｜parameter>\n`` per argument + ``</｜DSML｜invoke>``
//!   (strings as is, other values as JSON; arguments that are not JSON become one
//!   ``arguments`` string parameter).
//! - thinking is dropped (reasoning of assistant turns before the last user turn
//!   removed) when the prompt shows no tools.
//!
//! - response formats (Chat, Responses; Messages' ``output_config.format`` too): V4
//!   appends its ``json_object`` sentence or ``"\n\n## Response Format:\n\nYou MUST
//!   strictly adhere to the following schema to reply:\n"`` + the schema to the system
//!   text (after the tools).
//! - ``tool_choice`` required or named: only the named tool is listed, and the prompt
//!   ends with the opened block (``"\n\n<｜DSML｜tool_calls>\n"`` after ``</think>``);
//!   refused in thinking mode (the block cannot follow an open ``<think>``).
//! - content parts are joined by a blank line; an image is ``[Unsupported Image]``.
//!
//! V4.1 (``Version::V41``) differs in: a ``<｜System｜>`` token before each system
//! message, which stays where it stands (developer messages too); a first system
//! message (empty when the conversation has none) whenever thinking, tools or a
//! response format need it, its effort line ``Reasoning Effort: N (range 1-100, ...)``
//! with N 50 / 75 / 100; DSML spelled ``<｜DSML｜ calls>`` / `` invoke`` /
//! `` parameter``, parameters joined by newlines with one before ``</｜DSML｜ invoke>``;
//! Python's float spelling; ``json_object`` written as the schema
//! ``{"type": "json_object"}``; an image is the ``<｜image｜>`` token.
//!
//! Choices of ours: ``add_generation_prompt=false`` leaves out the trailing
//! ``<｜Assistant｜>`` + think token after a final user turn (the reference always adds
//! it). V3.2's encoder is the same apart from
//! the tool-call block name (``function_calls``) and is not rendered here.
//!
//! Trust: all message text, reasoning, tool names, argument names and values, and the
//! tool schema lines are untrusted segments; everything else is the format's own text.

use serde_json::{Map, Value};

use super::{deepseek_json_dumps, python_json_dumps, Prompt};
use crate::conversation::{
    ContentPart, Conversation, ReasoningEffort, ResponseFormat, Role, ToolChoice,
};
use crate::error::{RecipeError, Result};
use crate::output::parser::{Dsml, DSML_V4, DSML_V41};

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
pub const SYSTEM: &str = "<｜System｜>";
pub const IMAGE: &str = "<｜image｜>";

const REASONING_EFFORT_HIGH: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Beyond maximum \u{2014} exhaustive, relentless, and uncompromising.\n\
You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any surface symptom.\n\
Do not stop reasoning until you have independently verified the solution from multiple angles and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

/// The paragraph a thinking-mode prompt opens with for this effort: none for
/// minimal/low, "Absolute maximum" for medium/high/xhigh (and the default, high),
/// "Beyond maximum" for max; as DeepSeek's adapter maps each protocol's levels.
fn reasoning_effort_preamble(effort: Option<ReasoningEffort>) -> &'static str {
    match effort.unwrap_or(ReasoningEffort::High) {
        ReasoningEffort::Minimal | ReasoningEffort::Low => "",
        ReasoningEffort::Medium | ReasoningEffort::High | ReasoningEffort::Xhigh => {
            REASONING_EFFORT_HIGH
        }
        ReasoningEffort::Max => REASONING_EFFORT_MAX,
    }
}

/// Which of DeepSeek's two V4-family encodings: V4 (DeepSeek-V4-Pro) or V4.1
/// (DeepSeek-V4.1-Flash, the official adapter's ``DeepseekV41Encoding``).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V4,
    V41,
}

impl Version {
    /// The DSML markers this encoding writes (the stream parser reads the same ones).
    pub fn dsml(self) -> &'static Dsml {
        match self {
            Version::V4 => &DSML_V4,
            Version::V41 => &DSML_V41,
        }
    }

    /// JSON in tool schemas and argument values: V4 spells floats as DeepSeek's adapter
    /// does for it (``1e-7``), V4.1 as Python's ``json.dumps`` (``1e-07``).
    fn json(self, value: &Value) -> String {
        match self {
            Version::V4 => deepseek_json_dumps(value),
            Version::V41 => python_json_dumps(value, false, None, false),
        }
    }

    /// The reasoning-effort text that opens a thinking-mode prompt (see the module doc).
    fn effort_preamble(self, effort: Option<ReasoningEffort>) -> String {
        match self {
            Version::V4 => reasoning_effort_preamble(effort).to_string(),
            Version::V41 => {
                let level = match effort.unwrap_or(ReasoningEffort::High) {
                    ReasoningEffort::Minimal | ReasoningEffort::Low => 50,
                    ReasoningEffort::Medium | ReasoningEffort::High | ReasoningEffort::Xhigh => 75,
                    ReasoningEffort::Max => 100,
                };
                format!("Reasoning Effort: {level} (range 1-100, the higher the value, the more thorough the reasoning)\n\n")
            }
        }
    }
}

fn tools_template_head(tags: &Dsml) -> String {
    format!(
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"{c}\" block like the following:\n\n\
{c}\n\
{i} name=\"$TOOL_NAME\">\n\
{p} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE{pe}\n\
...\n\
{ie}\n\
{i} name=\"$TOOL_NAME2\">\n\
...\n\
{ie}\n\
{ce}\n\n\
String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n\
If thinking_mode is enabled (triggered by {ts}), you MUST output your complete reasoning inside {ts}...{te} BEFORE any tool calls or final response.\n\n\
Otherwise, output directly after {te} with tool calls or final response.\n\n\
### Available Tool Schemas\n\n",
        c = tags.calls_begin,
        ce = tags.calls_end,
        i = tags.invoke,
        ie = tags.invoke_end,
        p = tags.parameter,
        pe = tags.parameter_end,
        ts = THINK_START,
        te = THINK_END
    )
}

/// A message's content: its parts joined by a blank line (as DeepSeek's adapter joins
/// them), text untrusted. An image is V4's text placeholder "[Unsupported Image]" (V4
/// reads no images) or V4.1's ``<｜image｜>`` token, which the engine would expand
/// into the image's tokens; a model without a vision encoder refuses such a request
/// before it runs (``EngineRequest::images``).
fn content_prompt(parts: &[ContentPart], version: Version) -> Prompt {
    let mut content = Prompt::default();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            content.push_trusted("\n\n");
        }
        match part {
            ContentPart::Text { text } => content.push_untrusted(text),
            ContentPart::Image { .. } => match version {
                Version::V4 => content.push_trusted("[Unsupported Image]"),
                Version::V41 => content.push_trusted(IMAGE),
            },
        }
    }
    content
}

fn join_prompts(prompts: Vec<Prompt>, separator: &str) -> Prompt {
    let mut joined = Prompt::default();
    for (i, prompt) in prompts.into_iter().enumerate() {
        if i > 0 {
            joined.push_trusted(separator);
        }
        joined.extend(prompt);
    }
    joined
}

/// The system-text addition for a JSON response format: (the format's own text, the
/// schema text, untrusted since the client wrote it). V4 has its own sentence for
/// ``json_object``; V4.1 writes every format as a schema, ``json_object`` as
/// ``{"type": "json_object"}`` (as DeepSeek's adapter does).
fn response_format_instructions(
    format: &ResponseFormat,
    version: Version,
) -> Option<(String, String)> {
    const SCHEMA_HEAD: &str =
        "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";
    match (format, version) {
        (ResponseFormat::Text, _) => None,
        (ResponseFormat::JsonObject, Version::V4) => Some((
            "\n\nYou are a helpful assistant designed to output JSON.\n## Response Format:\n\nReply with JSON object ONLY.".into(),
            String::new(),
        )),
        (ResponseFormat::JsonObject, Version::V41) => Some((
            SCHEMA_HEAD.into(),
            r#"{"type": "json_object"}"#.into(),
        )),
        (ResponseFormat::JsonSchema { schema, .. }, _) => {
            Some((SCHEMA_HEAD.into(), version.json(schema)))
        }
    }
}

const TOOLS_TEMPLATE_TAIL: &str =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum R {
    System,
    User,
    Assistant,
}

#[derive(Debug, Clone)]
enum Block {
    Text(Prompt),
    ToolResult { id: String, content: Prompt },
}

#[derive(Debug, Clone)]
struct Msg {
    role: R,
    /// system/assistant text
    content: Prompt,
    /// user turns: text and tool-result blocks
    blocks: Vec<Block>,
    reasoning: Option<String>,
    tool_calls: Vec<(String, String, String)>, // (id, name, arguments)
    tools: Option<Vec<Value>>,
}

impl Msg {
    fn new(role: R) -> Msg {
        Msg {
            role,
            content: Prompt::default(),
            blocks: Vec::new(),
            reasoning: None,
            tool_calls: Vec::new(),
            tools: None,
        }
    }
}

/// Renders a conversation in DeepSeek-V4's format (see the module doc).
pub fn render_deepseek_v4(
    conversation: &Conversation,
    add_generation_prompt: bool,
) -> Result<Prompt> {
    render_v4_family(
        conversation,
        &ResponseFormat::Text,
        add_generation_prompt,
        Version::V4,
    )
}

/// Renders a conversation with its request's response format (the JSON formats add
/// instructions to the system text), in either encoding.
pub fn render_v4_family(
    conversation: &Conversation,
    response_format: &ResponseFormat,
    add_generation_prompt: bool,
    version: Version,
) -> Result<Prompt> {
    let tags = version.dsml();
    // Thinking is on unless the request turned it off (DeepSeek's adapter's default).
    let thinking = conversation.thinking.enabled.unwrap_or(true);
    // A required or named tool choice opens the tool-call block in the prompt, which
    // the thinking format has no place for (DeepSeek's adapter refuses it too).
    let forced_call = matches!(
        conversation.tool_choice,
        ToolChoice::Required | ToolChoice::Named(_)
    );
    if forced_call && thinking {
        return Err(RecipeError::unsupported(
            "tool_choice",
            "this model cannot be made to call a tool in thinking mode; turn thinking off (thinking: {\"type\": \"disabled\"}, or reasoning_effort \"none\") or use tool_choice \"auto\"",
        ));
    }

    // merge_tool_messages; system messages gathered (they open the prompt, in order)
    let mut messages: Vec<Msg> = Vec::new();
    let mut system: Vec<Prompt> = Vec::new();
    for message in &conversation.messages {
        let text = content_prompt(&message.content, version);
        match message.role {
            Role::System if version == Version::V4 => system.push(text),
            // V4.1 keeps system (and developer) messages where they stand.
            Role::System | Role::Developer if version == Version::V41 => {
                let mut m = Msg::new(R::System);
                m.content = text;
                messages.push(m);
            }
            Role::System | Role::User | Role::Developer | Role::Tool => {
                let block = if message.role == Role::Tool {
                    Block::ToolResult {
                        id: message.tool_call_id.clone().unwrap_or_default(),
                        content: text,
                    }
                } else {
                    Block::Text(text)
                };
                match messages.last_mut() {
                    Some(last) if last.role == R::User => last.blocks.push(block),
                    _ => {
                        let mut m = Msg::new(R::User);
                        m.blocks.push(block);
                        messages.push(m);
                    }
                }
            }
            Role::Assistant => {
                let mut m = Msg::new(R::Assistant);
                m.content = text;
                m.reasoning = message.reasoning.clone();
                m.tool_calls = message
                    .tool_calls
                    .iter()
                    .map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone()))
                    .collect();
                messages.push(m);
            }
        }
    }

    // One system message first: every system message's text, joined by a blank line;
    // the tools go on it (on an empty one when there is no system text), unless
    // tool_choice is "none", which leaves them out of the prompt.
    let tools_shown =
        !conversation.tools.is_empty() && conversation.tool_choice != ToolChoice::None;
    let instructions = response_format_instructions(response_format, version);
    // V4.1: the first message is a system message when the prompt needs one (an
    // empty one unless the conversation starts with one).
    let opening_needed = match version {
        Version::V4 => !system.is_empty() || tools_shown || instructions.is_some(),
        Version::V41 => {
            (thinking || tools_shown || instructions.is_some())
                && messages.first().map(|m| m.role) != Some(R::System)
        }
    };
    if opening_needed {
        let mut m = Msg::new(R::System);
        m.content = join_prompts(system, "\n\n");
        messages.insert(0, m);
    }
    if tools_shown {
        let tools: Vec<Value> = conversation
            .tools
            .iter()
            .filter(|t| match &conversation.tool_choice {
                ToolChoice::Named(name) => &t.name == name,
                _ => true,
            })
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), Value::String(t.name.clone()));
                let description = t.description.clone().unwrap_or_default();
                f.insert("description".into(), Value::String(description));
                f.insert("parameters".into(), t.parameters.clone());
                Value::Object(f)
            })
            .collect();
        messages[0].tools = Some(tools);
    }

    // sort_tool_results_by_call_order
    let mut order: Vec<(String, usize)> = Vec::new();
    for m in messages.iter_mut() {
        if m.role == R::Assistant && !m.tool_calls.is_empty() {
            order = m
                .tool_calls
                .iter()
                .enumerate()
                .filter(|(_, c)| !c.0.is_empty())
                .map(|(i, c)| (c.0.clone(), i))
                .collect();
        } else if m.role == R::User {
            let results: Vec<Block> = m
                .blocks
                .iter()
                .filter(|b| matches!(b, Block::ToolResult { .. }))
                .cloned()
                .collect();
            if results.len() > 1 && !order.is_empty() {
                let rank = |b: &Block| match b {
                    Block::ToolResult { id, .. } => order
                        .iter()
                        .find(|(k, _)| k == id)
                        .map(|(_, i)| *i)
                        .unwrap_or(0),
                    Block::Text(_) => 0,
                };
                let mut sorted = results;
                sorted.sort_by_key(rank); // stable, as Python's sorted
                let mut next = sorted.into_iter();
                for b in m.blocks.iter_mut() {
                    if matches!(b, Block::ToolResult { .. }) {
                        // As many sorted results as ToolResult slots: the same blocks, reordered.
                        if let Some(result) = next.next() {
                            *b = result;
                        }
                    }
                }
            }
        }
    }

    // Without tools in the prompt, reasoning before the last user turn (tool results
    // count as one) is dropped; with tools every turn keeps it (DeepSeek's adapter).
    let drop_thinking = !tools_shown;
    let last_user_idx = messages.iter().rposition(|m| m.role == R::User);
    if thinking && drop_thinking {
        // _drop_thinking_messages: reasoning of assistant turns before the last user turn goes.
        if let Some(last) = last_user_idx {
            for m in messages.iter_mut().take(last) {
                if m.role == R::Assistant {
                    m.reasoning = None;
                }
            }
        }
    }

    let mut prompt = Prompt::default();
    prompt.push_trusted(BOS);
    let n = messages.len();
    for (index, msg) in messages.iter().enumerate() {
        if version == Version::V41 && msg.role == R::System {
            prompt.push_trusted(SYSTEM);
        }
        if index == 0 && thinking {
            prompt.push_trusted(&version.effort_preamble(conversation.thinking.effort));
        }
        match msg.role {
            R::System => {
                prompt.extend(msg.content.clone());
                if let Some(tools) = &msg.tools {
                    prompt.push_trusted("\n\n");
                    prompt.push_trusted(&tools_template_head(tags));
                    for (i, tool) in tools.iter().enumerate() {
                        if i > 0 {
                            prompt.push_trusted("\n");
                        }
                        prompt.push_untrusted(&version.json(tool));
                    }
                    prompt.push_trusted(TOOLS_TEMPLATE_TAIL);
                }
                if index == 0 {
                    if let Some(text) = &instructions {
                        prompt.push_trusted(&text.0);
                        prompt.push_untrusted(&text.1);
                    }
                }
            }
            R::User => {
                prompt.push_trusted(USER);
                for (i, block) in msg.blocks.iter().enumerate() {
                    if i > 0 {
                        prompt.push_trusted("\n\n");
                    }
                    match block {
                        Block::Text(t) => prompt.extend(t.clone()),
                        Block::ToolResult { content, .. } => {
                            prompt.push_trusted("<tool_result>");
                            prompt.extend(content.clone());
                            prompt.push_trusted("</tool_result>");
                        }
                    }
                }
            }
            R::Assistant => {
                let keep_reasoning = !drop_thinking || last_user_idx.is_none_or(|l| index > l);
                if thinking && keep_reasoning {
                    prompt.push_untrusted(msg.reasoning.as_deref().unwrap_or(""));
                    prompt.push_trusted(THINK_END);
                }
                prompt.extend(msg.content.clone());
                if !msg.tool_calls.is_empty() {
                    prompt.push_trusted(&format!("\n\n{}\n", tags.calls_begin));
                    for (i, (_, name, arguments)) in msg.tool_calls.iter().enumerate() {
                        if i > 0 {
                            prompt.push_trusted("\n");
                        }
                        prompt.push_trusted(&format!("{} name=\"", tags.invoke));
                        prompt.push_untrusted(name);
                        prompt.push_trusted("\">\n");
                        let written = encode_arguments(&mut prompt, arguments, version)?;
                        // V4 ends each parameter with a newline, V4.1 joins them with one
                        // and adds one before the closing tag (so no arguments: "\n\n").
                        if written > 0 || version == Version::V41 {
                            prompt.push_trusted("\n");
                        }
                        prompt.push_trusted(tags.invoke_end);
                    }
                    prompt.push_trusted(&format!("\n{}", tags.calls_end));
                }
                prompt.push_trusted(EOS);
            }
        }
        let next_is_assistant = index + 1 < n && messages[index + 1].role == R::Assistant;
        if index + 1 < n && !next_is_assistant {
            continue;
        }
        if index + 1 == n && !add_generation_prompt {
            continue;
        }
        if msg.role == R::User {
            prompt.push_trusted(ASSISTANT);
            let open = thinking && (!drop_thinking || last_user_idx.is_some_and(|l| index >= l));
            prompt.push_trusted(if open { THINK_START } else { THINK_END });
            if index + 1 == n && forced_call && tools_shown {
                // The answer starts inside the tool-call block (the stream parser is
                // told so by the prompt's end).
                prompt.push_trusted(&format!("\n\n{}\n", tags.calls_begin));
            }
        }
    }
    Ok(prompt)
}

/// Writes the parameters of one invoke, joined by newlines; returns how many.
fn encode_arguments(prompt: &mut Prompt, arguments: &str, version: Version) -> Result<usize> {
    let tags = version.dsml();
    let parsed: Map<String, Value> = match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(map)) => map,
        Ok(_) => {
            return Err(RecipeError::invalid(
                "messages.tool_calls.arguments",
                "tool call arguments must be a JSON object",
            ))
        }
        Err(_) => {
            let mut map = Map::new();
            map.insert("arguments".into(), Value::String(arguments.to_string()));
            map
        }
    };
    for (i, (key, value)) in parsed.iter().enumerate() {
        if i > 0 {
            prompt.push_trusted("\n");
        }
        prompt.push_trusted(&format!("{} name=\"", tags.parameter));
        prompt.push_untrusted(key);
        let is_str = value.is_string();
        prompt.push_trusted(&format!(
            "\" string=\"{}\">",
            if is_str { "true" } else { "false" }
        ));
        match value {
            Value::String(s) => prompt.push_untrusted(s),
            other => prompt.push_untrusted(&version.json(other)),
        }
        prompt.push_trusted(tags.parameter_end);
    }
    Ok(parsed.len())
}
