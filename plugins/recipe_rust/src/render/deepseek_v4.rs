//! DeepSeek-V4's native chat encoder (the model ships no Jinja chat template).
//!
//! Followed: DeepSeek's reference ``encoding/encoding_dsv4.py`` (``encode_messages``
//! with ``merge_tool_messages``, ``sort_tool_results_by_call_order``,
//! ``_drop_thinking_messages`` and ``render_message``), read from the copy in the
//! public repository supermy/ds4rs (``encoding/encoding_dsv4.py``, commit 2ecc534c), and
//! vLLM's ``vllm/tokenizers/deepseek_v4.py`` ``apply_chat_template`` wrapper for how
//! an OpenAI-style request reaches it. The reference could not be run here (no
//! network), so the goldens in ``tests/render.rs`` are written by hand from it.
//!
//! The format, as implemented:
//! - ``<｜begin▁of▁sentence｜>`` first; in thinking mode with reasoning effort "max"
//!   the reference's "Reasoning Effort: Absolute maximum ..." paragraph follows it
//!   (other efforts add nothing: the reference accepts only max/high/None).
//! - system: its text, then ``"\n\n" + TOOLS_TEMPLATE`` with one JSON line per tool
//!   (``{"name", "description", "parameters"}``, Python ``json.dumps`` spacing) when the
//!   request has tools. Tools go on the conversation's first message when it is a system
//!   message, else on a new empty system message inserted first (vLLM always inserts
//!   one; attaching to an existing system prompt keeps the reference's own shape, a
//!   system message that carries ``tools``). ``developer`` messages are treated as
//!   system messages (OpenAI's meaning), not as DeepSeek's internal developer role.
//! - user: ``<｜User｜>`` + text. Tool results are merged into user turns as
//!   ``<tool_result>..</tool_result>`` blocks (a tool message joins the preceding
//!   merged user turn, a user message joins a preceding merged turn too), blocks
//!   joined by ``"\n\n"``, tool results re-ordered to the order of the assistant's calls.
//!   The format has no way to mark a failed tool call (the reference's ``tool_result``
//!   block has only content), so a result with ``is_error`` is rendered like any other:
//!   its text (typically the error message) is what tells the model.
//! - after a user turn that is followed by an assistant turn or ends the prompt:
//!   ``<｜Assistant｜>`` + ``<think>`` (thinking mode, and the turn is the last user turn
//!   or thinking is not dropped) or ``</think>`` (otherwise).
//! - assistant: [reasoning + ``</think>`` in thinking mode when after the last user turn or
//!   thinking is not dropped] + content + [``"\n\n<｜DSML｜tool_calls>\n"`` + invokes joined
//!   by "\n" + ``"\n</｜DSML｜tool_calls>"``] + ``<｜end▁of▁sentence｜>``; an invoke is
//!   ``<｜DSML｜invoke name="N">\n`` + parameters joined by "\n" + ``\n</｜DSML｜invoke>``,
//!   a parameter ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>``
//!   (strings as is, other values as JSON; arguments that are not JSON become one
//!   ``arguments`` string parameter).
//! - thinking is dropped (earlier turns' reasoning removed) when the last message is a
//!   user message and the request has no tools (vLLM's rule plus the reference's "tools
//!   keep all reasoning").
//!
//! Choices of ours: ``add_generation_prompt=false`` leaves out the trailing
//! ``<｜Assistant｜>`` + think token after a final user turn (the reference always adds
//! it); image parts are refused (V4 is text-only). V3.2's encoder is the same apart from
//! the tool-call block name (``function_calls``) and is not rendered here.
//!
//! Trust: all message text, reasoning, tool names, argument names and values, and the
//! tool schema lines are untrusted segments; everything else is the format's own text.

use serde_json::{Map, Value};

use super::{python_json_dumps, Prompt};
use crate::conversation::{ContentPart, Conversation, ReasoningEffort, Role};
use crate::error::{RecipeError, Result};

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
pub const DSML: &str = "｜DSML｜";

const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

fn tools_template_head() -> String {
    format!(
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<{d}tool_calls>\" block like the following:\n\n\
<{d}tool_calls>\n\
<{d}invoke name=\"$TOOL_NAME\">\n\
<{d}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{d}parameter>\n\
...\n\
</{d}invoke>\n\
<{d}invoke name=\"$TOOL_NAME2\">\n\
...\n\
</{d}invoke>\n\
</{d}tool_calls>\n\n\
String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n\
If thinking_mode is enabled (triggered by {ts}), you MUST output your complete reasoning inside {ts}...{te} BEFORE any tool calls or final response.\n\n\
Otherwise, output directly after {te} with tool calls or final response.\n\n\
### Available Tool Schemas\n\n",
        d = DSML,
        ts = THINK_START,
        te = THINK_END
    )
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
    Text(String),
    ToolResult { id: String, content: String },
}

#[derive(Debug, Clone)]
struct Msg {
    role: R,
    /// system/assistant text
    content: String,
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
            content: String::new(),
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
    let thinking = conversation.thinking.enabled.unwrap_or(false);
    let effort_max = conversation.thinking.effort == Some(ReasoningEffort::Max);

    // merge_tool_messages
    let mut messages: Vec<Msg> = Vec::new();
    for (i, message) in conversation.messages.iter().enumerate() {
        let mut text = String::new();
        for part in &message.content {
            match part {
                ContentPart::Text { text: t } => text.push_str(t),
                ContentPart::Image { .. } => {
                    return Err(RecipeError::unsupported(
                        format!("messages[{i}].content"),
                        "this model takes text only; image parts are not supported",
                    ))
                }
            }
        }
        match message.role {
            Role::System | Role::Developer => {
                let mut m = Msg::new(R::System);
                m.content = text;
                messages.push(m);
            }
            Role::User | Role::Tool => {
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

    // tools on the first system message, or on a new one
    if !conversation.tools.is_empty() {
        let tools: Vec<Value> = conversation
            .tools
            .iter()
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), Value::String(t.name.clone()));
                if let Some(d) = &t.description {
                    f.insert("description".into(), Value::String(d.clone()));
                }
                f.insert("parameters".into(), t.parameters.clone());
                Value::Object(f)
            })
            .collect();
        if messages.first().map(|m| m.role) != Some(R::System) {
            messages.insert(0, Msg::new(R::System));
        }
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

    let last_is_user = conversation.messages.last().map(|m| m.role) == Some(Role::User);
    let drop_thinking = last_is_user && conversation.tools.is_empty();
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
        if index == 0 && thinking && effort_max {
            prompt.push_trusted(REASONING_EFFORT_MAX);
        }
        match msg.role {
            R::System => {
                prompt.push_untrusted(&msg.content);
                if let Some(tools) = &msg.tools {
                    prompt.push_trusted("\n\n");
                    prompt.push_trusted(&tools_template_head());
                    for (i, tool) in tools.iter().enumerate() {
                        if i > 0 {
                            prompt.push_trusted("\n");
                        }
                        prompt.push_untrusted(&python_json_dumps(tool, false, None, false));
                    }
                    prompt.push_trusted(TOOLS_TEMPLATE_TAIL);
                }
            }
            R::User => {
                prompt.push_trusted(USER);
                for (i, block) in msg.blocks.iter().enumerate() {
                    if i > 0 {
                        prompt.push_trusted("\n\n");
                    }
                    match block {
                        Block::Text(t) => prompt.push_untrusted(t),
                        Block::ToolResult { content, .. } => {
                            prompt.push_trusted("<tool_result>");
                            prompt.push_untrusted(content);
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
                prompt.push_untrusted(&msg.content);
                if !msg.tool_calls.is_empty() {
                    prompt.push_trusted(&format!("\n\n<{DSML}tool_calls>\n"));
                    for (i, (_, name, arguments)) in msg.tool_calls.iter().enumerate() {
                        if i > 0 {
                            prompt.push_trusted("\n");
                        }
                        prompt.push_trusted(&format!("<{DSML}invoke name=\""));
                        prompt.push_untrusted(name);
                        prompt.push_trusted("\">\n");
                        encode_arguments(&mut prompt, arguments)?;
                        prompt.push_trusted(&format!("\n</{DSML}invoke>"));
                    }
                    prompt.push_trusted(&format!("\n</{DSML}tool_calls>"));
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
        }
    }
    Ok(prompt)
}

fn encode_arguments(prompt: &mut Prompt, arguments: &str) -> Result<()> {
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
        prompt.push_trusted(&format!("<{DSML}parameter name=\""));
        prompt.push_untrusted(key);
        let is_str = value.is_string();
        prompt.push_trusted(&format!(
            "\" string=\"{}\">",
            if is_str { "true" } else { "false" }
        ));
        match value {
            Value::String(s) => prompt.push_untrusted(s),
            other => prompt.push_untrusted(&python_json_dumps(other, false, None, false)),
        }
        prompt.push_trusted(&format!("</{DSML}parameter>"));
    }
    Ok(())
}
