//! Streaming parser: the model's generated text -> reasoning, answer text, tool calls.
//!
//! # Markers
//!
//! `｜` below is U+FF5C (FULLWIDTH VERTICAL LINE) and `▁` is U+2581 (LOWER ONE EIGHTH
//! BLOCK); the constants spell them as escapes so nobody "fixes" them to ASCII.
//!
//! - Reasoning (DeepSeek formats): `<think>` ... `</think>`.
//! - [`OutputFormat::DeepseekV3`] (V3 / R1 / V3.1):
//!   `<｜tool▁calls▁begin｜>` `<｜tool▁call▁begin｜>` `<｜tool▁sep｜>` `<｜tool▁call▁end｜>`
//!   `<｜tool▁calls▁end｜>`. V3/R1 write
//!   `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`,
//!   V3.1 writes `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`; both are
//!   accepted (a header of exactly `function` before the separator means the V3 form,
//!   so a V3.1 tool literally named `function` is misread).
//!   Confirmed against llama.cpp `common/chat-parsers/deepseek-v3-1.cpp` (preserved
//!   tokens list, ochafik/llama.cpp) and the vllm-mlx / vLLM-derived DeepSeek V3 and
//!   V3.1 tool parsers found by code search (same spellings, same two forms).
//! - [`OutputFormat::DeepseekV4`] (DSML, introduced by DeepSeek-V3.2):
//!   `<｜DSML｜function_calls>` ... `</｜DSML｜function_calls>` around
//!   `<｜DSML｜invoke name="NAME">` ... `</｜DSML｜invoke>` around
//!   `<｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>`.
//!   Confirmed against DeepSeek-V3.2's `encoding/encoding_dsv32.py` (copied into
//!   vLLM as `vllm/tokenizers/deepseek_v32_encoding.py`: `dsml_token = "｜DSML｜"`,
//!   `tool_calls_template = "<{dsml_token}function_calls>\n{tool_calls}\n</{dsml_token}function_calls>"`,
//!   `tool_call_template = '<{dsml_token}invoke name="{name}">\n{arguments}\n</{dsml_token}invoke>'`)
//!   and sglang's `DeepSeekV32Detector`. Several independent DeepSeek-V4 renderers
//!   found by code search wrap the invokes in `<｜DSML｜tool_calls>` instead of
//!   `function_calls`, so both wrappers are accepted (each closed by its own end tag),
//!   and so is DeepSeek-V4.1's spelling (its official adapter, ``deepseek-recipe``):
//!   `<｜DSML｜ calls>`, `<｜DSML｜ invoke`, `<｜DSML｜ parameter`, a space after the token.
//!   `string="true"` values are raw text (JSON-escaped here); `string="false"` values
//!   are JSON text (kept when they parse, else turned into a JSON string); a missing
//!   `string` attribute is treated like `"false"`.
//!
//! - Forced calls of a [`OutputFormat::Plain`] model ([`ForcedCall`], set by
//!   [`StreamParser::with_forced_call`] when the request's ``tool_choice`` was required or
//!   named and the engine constrained the output to one of these forms): a named tool's
//!   arguments object alone (vLLM's form for a named choice), a JSON array
//!   `[{"name": N, "parameters": ARGS}, ...]` (vLLM's form for "required"), or Hermes
//!   blocks `<tool_call>\n{"name": N, "arguments": ARGS}\n</tool_call>` joined by newlines
//!   (models whose chat template writes `<tool_call>`). Without a forced call a plain
//!   model's output is all text: the parser does not guess at tool syntax.
//!
//! # Behaviour
//!
//! - Markers and stop strings may be split across pushes at any byte: the parser holds
//!   back only the shortest suffix of its buffer that could still grow into a marker
//!   (or a longer marker starting no later than a complete one), and emits everything
//!   else at once. Output is therefore the same for every chunking of the same text,
//!   up to how deltas of the same kind are split into events.
//! - `<think>` opens reasoning only before any non-whitespace answer text; `</think>`
//!   is only recognized inside reasoning. With `starts_in_reasoning` the output begins
//!   inside reasoning (the prompt already ended with `<think>`).
//! - DeepSeek formats drop whitespace at the start of reasoning, of answer text (start
//!   of output, after `</think>`, after a tool call) and of V3 arguments. `Plain` is
//!   passed through verbatim (except stop sequences).
//! - DeepSeek formats hold back whitespace at the end of answer text until more text
//!   comes: it is dropped when a tool call section follows (`Checking.\n\n<｜DSML｜…`
//!   gives `Checking.`) and emitted before a stop sequence or at `finish`.
//! - Stop sequences are matched in answer text only (not in reasoning or inside tool
//!   calls). On a match the text before it is emitted, then [`OutputEvent::Stopped`],
//!   and nothing more is ever emitted.
//! - Tool call ids are `{prefix}_{index}` with prefix `call` unless
//!   [`StreamParser::with_id_prefix`] sets one; the model writes no ids, and ids must
//!   be unique across a conversation, so callers should pass a per-request prefix
//!   (e.g. `call_<request id>` or `toolu_<request id>`). `index` counts calls from 0.
//! - Arguments: V3 formats stream the model's JSON text as is (a V3 fenced block ends
//!   at the closing "\n```"). DSML streams a JSON object assembled from the
//!   parameters: `{` at the invoke, `"P": ` + value per parameter (`, ` between), `}` at
//!   the invoke's end; string values stream escaped, JSON values come whole at their
//!   closing tag. A call that produced no argument text gets `{}`.
//! - Forced calls of a plain model: the arguments of a named tool stream as the model
//!   writes them (the call starts with the output); a JSON-list item or a Hermes block is
//!   emitted whole when it closes, its arguments the model's own text. Around Hermes
//!   blocks whitespace goes as in DeepSeek formats (the newline between blocks is
//!   dropped); between list items whitespace and the list's `[`, `,` and `]` are dropped.
//!   Other text (which the grammar does not allow) is answer text.
//! - Malformed markup at `finish` never panics: a call whose name was not complete yet
//!   is emitted as answer text (its raw markup, markers included); a call whose name
//!   was known is closed best-effort (DSML closes an open string and the object, V3
//!   arguments are left as the model wrote them) and gets its `ToolCallEnd`.
//!   `<｜tool▁call▁end｜>` before any `<｜tool▁sep｜>` makes the raw markup text too.
//!   A forced call cut off (the output ran out of tokens) is closed the same way: a
//!   JSON-list item or Hermes block whose name is complete becomes that call with the
//!   arguments written so far, one whose name is not is answer text.

/// Which markup the model writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputFormat {
    /// No reasoning or tool syntax (e.g. SmolLM2): everything is answer text.
    Plain,
    /// `<think>` reasoning; V3/R1 and V3.1 tool calls.
    DeepseekV3,
    /// `<think>` reasoning; DSML tool calls.
    DeepseekV4,
}

impl OutputFormat {
    pub fn parse(name: &str) -> Option<OutputFormat> {
        match name {
            "plain" => Some(OutputFormat::Plain),
            "deepseek_v3" | "deepseek_v31" | "deepseek_r1" => Some(OutputFormat::DeepseekV3),
            "deepseek_v4" | "deepseek_v32" | "dsml" => Some(OutputFormat::DeepseekV4),
            _ => None,
        }
    }
}

/// The form in which a plain model writes the tool call its request forced (see the
/// module doc); the grammar that constrained its output wrote exactly this form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForcedCall {
    /// The whole output is this tool's arguments object.
    Arguments { name: String },
    /// A JSON array of `{"name": N, "parameters": ARGS}` objects.
    JsonList,
    /// `<tool_call>\n{"name": N, "arguments": ARGS}\n</tool_call>` blocks.
    Hermes,
}

/// What the parser found, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    Reasoning(String),
    Text(String),
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolCallArguments {
        index: usize,
        delta: String,
    },
    ToolCallEnd {
        index: usize,
    },
    /// A stop sequence matched in answer text; nothing follows.
    Stopped {
        stop: String,
    },
}

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
pub const V3_CALLS_BEGIN: &str = "<\u{FF5C}tool\u{2581}calls\u{2581}begin\u{FF5C}>";
pub const V3_CALLS_END: &str = "<\u{FF5C}tool\u{2581}calls\u{2581}end\u{FF5C}>";
pub const V3_CALL_BEGIN: &str = "<\u{FF5C}tool\u{2581}call\u{2581}begin\u{FF5C}>";
pub const V3_CALL_END: &str = "<\u{FF5C}tool\u{2581}call\u{2581}end\u{FF5C}>";
pub const V3_SEP: &str = "<\u{FF5C}tool\u{2581}sep\u{FF5C}>";
const V3_FENCE_OPEN: &str = "```json";
const V3_FENCE_CLOSE: &str = "\n```";
const TAG_CLOSE: &str = ">";
pub const HERMES_OPEN: &str = "<tool_call>";
pub const HERMES_CLOSE: &str = "</tool_call>";

/// One DSML spelling: its section, invoke and parameter markers (the invoke and
/// parameter openers are followed by attributes and `>`). V3.2 wraps the invokes in
/// ``function_calls``, V4 in ``tool_calls``, V4.1 in `` calls`` with `` invoke`` and
/// `` parameter`` (a space after the DSML token). One section uses one spelling
/// throughout. The renderer writes the same markers (``render::deepseek_v4``).
#[derive(Debug, PartialEq, Eq)]
pub struct Dsml {
    pub calls_begin: &'static str,
    pub calls_end: &'static str,
    pub invoke: &'static str,
    pub invoke_end: &'static str,
    pub parameter: &'static str,
    pub parameter_end: &'static str,
}

pub const DSML_V32: Dsml = Dsml {
    calls_begin: "<\u{FF5C}DSML\u{FF5C}function_calls>",
    calls_end: "</\u{FF5C}DSML\u{FF5C}function_calls>",
    invoke: "<\u{FF5C}DSML\u{FF5C}invoke",
    invoke_end: "</\u{FF5C}DSML\u{FF5C}invoke>",
    parameter: "<\u{FF5C}DSML\u{FF5C}parameter",
    parameter_end: "</\u{FF5C}DSML\u{FF5C}parameter>",
};

pub const DSML_V4: Dsml = Dsml {
    calls_begin: "<\u{FF5C}DSML\u{FF5C}tool_calls>",
    calls_end: "</\u{FF5C}DSML\u{FF5C}tool_calls>",
    ..DSML_V32
};

pub const DSML_V41: Dsml = Dsml {
    calls_begin: "<\u{FF5C}DSML\u{FF5C} calls>",
    calls_end: "</\u{FF5C}DSML\u{FF5C} calls>",
    invoke: "<\u{FF5C}DSML\u{FF5C} invoke",
    invoke_end: "</\u{FF5C}DSML\u{FF5C} invoke>",
    parameter: "<\u{FF5C}DSML\u{FF5C} parameter",
    parameter_end: "</\u{FF5C}DSML\u{FF5C} parameter>",
};

/// Every spelling the parser accepts.
const DSML_SPELLINGS: [&Dsml; 3] = [&DSML_V32, &DSML_V4, &DSML_V41];

type Dialect = &'static Dsml;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Answer,
    Reasoning,
    V3Section,
    V3Header,
    V3Name,
    V3Args { fenced: bool },
    V3AfterArgs,
    DsmlSection { dialect: Dialect },
    DsmlInvokeTag { dialect: Dialect },
    DsmlInvoke { dialect: Dialect },
    DsmlParamTag { dialect: Dialect },
    DsmlParamValue { dialect: Dialect, string: bool },
    // A plain model's forced call (see `ForcedCall`): the arguments of the named tool; a
    // JSON list between items and inside one (`json` scans it); a Hermes block.
    ForcedArguments,
    JsonList,
    JsonItem,
    HermesCall,
}

/// Where a scan of JSON text stands: nesting depth, inside a string, after a backslash.
#[derive(Debug, Clone, Copy, Default)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Takes one character; true when it closed the outermost value.
    fn step(&mut self, c: char) -> bool {
        if self.in_string {
            match (self.escaped, c) {
                (true, _) => self.escaped = false,
                (false, '\\') => self.escaped = true,
                (false, '"') => self.in_string = false,
                _ => {}
            }
            return false;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mk {
    ThinkOpen,
    ThinkClose,
    V3CallsBegin,
    V3CallsEnd,
    V3CallBegin,
    V3CallEnd,
    V3Sep,
    FenceOpen,
    FenceClose,
    DsmlBegin { dialect: Dialect },
    DsmlEnd,
    DsmlInvoke,
    DsmlInvokeEnd,
    DsmlParam,
    DsmlParamEnd,
    TagClose,
    HermesOpen,
    HermesClose,
    Stop(usize),
}

/// Incremental parser for one choice's generated text.
#[derive(Debug, Clone)]
pub struct StreamParser {
    format: OutputFormat,
    stops: Vec<String>,
    id_prefix: String,
    state: State,
    buf: String,
    pending_bytes: Vec<u8>,
    /// `<think>` may still open reasoning (no answer text, tool call or think yet).
    think_allowed: bool,
    /// Whitespace at the start of the current text / reasoning / arguments is dropped.
    leading: bool,
    /// Collected header, name, tag attributes or JSON parameter value.
    acc: String,
    /// Raw markup of a tool call whose start has not been emitted yet.
    raw: String,
    next_index: usize,
    /// The open call: (index, whether any argument text was emitted).
    call: Option<(usize, bool)>,
    params: usize,
    /// Answer whitespace held back: dropped if a tool call section follows.
    pending_ws: String,
    /// The call a plain model's request forced, and the scan of its JSON list.
    forced: Option<ForcedCall>,
    json: JsonScan,
    done: bool,
}

impl StreamParser {
    pub fn new(format: OutputFormat, stop: Vec<String>, starts_in_reasoning: bool) -> StreamParser {
        let reasoning = starts_in_reasoning && format != OutputFormat::Plain;
        StreamParser {
            format,
            stops: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            id_prefix: "call".to_string(),
            state: if reasoning {
                State::Reasoning
            } else {
                State::Answer
            },
            buf: String::new(),
            pending_bytes: Vec::new(),
            think_allowed: !reasoning,
            leading: true,
            acc: String::new(),
            raw: String::new(),
            next_index: 0,
            call: None,
            params: 0,
            pending_ws: String::new(),
            forced: None,
            json: JsonScan::default(),
            done: false,
        }
    }

    /// Reads a plain model's output as the tool call its request forced, in the form
    /// the output was constrained to (see [`ForcedCall`]). DeepSeek formats parse their
    /// own markup whatever the request, so for them this changes nothing.
    pub fn with_forced_call(mut self, forced: ForcedCall) -> StreamParser {
        if self.format != OutputFormat::Plain {
            return self;
        }
        self.state = match forced {
            ForcedCall::Arguments { .. } => State::ForcedArguments,
            ForcedCall::JsonList => State::JsonList,
            ForcedCall::Hermes => State::Answer,
        };
        self.forced = Some(forced);
        self
    }

    /// Starts where the prompt left the answer: inside a DSML tool-call block when the
    /// prompt ends with its opening (a required or named tool choice pre-fills it), in
    /// reasoning when it ends with `<think>` (the format allowing).
    pub fn after_prompt(mut self, prompt: &str) -> StreamParser {
        if self.format == OutputFormat::Plain {
            return self;
        }
        if prompt.ends_with(THINK_OPEN) {
            self.state = State::Reasoning;
            self.think_allowed = false;
        }
        if self.format == OutputFormat::DeepseekV4 {
            let opened = DSML_SPELLINGS.into_iter().find(|d| {
                prompt
                    .strip_suffix('\n')
                    .is_some_and(|p| p.ends_with(d.calls_begin))
            });
            if let Some(dialect) = opened {
                self.state = State::DsmlSection { dialect };
                self.think_allowed = false;
            }
        }
        self
    }

    /// Tool call ids become `{prefix}_{index}`.
    pub fn with_id_prefix(mut self, prefix: impl Into<String>) -> StreamParser {
        self.id_prefix = prefix.into();
        self
    }

    pub fn format(&self) -> OutputFormat {
        self.format
    }

    /// True once a stop sequence matched or `finish` was called: nothing more comes.
    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if !self.pending_bytes.is_empty() {
            // An incomplete UTF-8 sequence followed by text: it can never complete.
            self.pending_bytes.clear();
            self.buf.push('\u{FFFD}');
        }
        self.buf.push_str(text);
        self.process(&mut out, false);
        out
    }

    /// Raw bytes: an incomplete UTF-8 sequence at the end is held until the next call;
    /// invalid bytes become U+FFFD (as `String::from_utf8_lossy` does).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.pending_bytes.extend_from_slice(bytes);
        let pending = std::mem::take(&mut self.pending_bytes);
        let mut rest: &[u8] = &pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    self.buf.push_str(s);
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // SAFETY-free: from_utf8 said this prefix is valid.
                    self.buf
                        .push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            self.buf.push('\u{FFFD}');
                            rest = &after[n..];
                        }
                        None => {
                            self.pending_bytes = after.to_vec();
                            break;
                        }
                    }
                }
            }
        }
        self.process(&mut out, false);
        out
    }

    /// End of output: flushes held-back text and closes anything left open.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if !self.pending_bytes.is_empty() {
            self.pending_bytes.clear();
            self.buf.push('\u{FFFD}');
        }
        self.process(&mut out, true);
        if self.done {
            return out;
        }
        match self.state {
            State::V3Header | State::V3Name | State::DsmlInvokeTag { .. } => {
                let raw = std::mem::take(&mut self.raw);
                self.state = State::Answer;
                self.emit_text(&mut out, &raw);
            }
            State::V3Args { .. } | State::V3AfterArgs => self.end_call(&mut out),
            State::DsmlInvoke { .. } | State::DsmlParamTag { .. } => {
                self.args(&mut out, "}");
                self.end_call(&mut out);
            }
            State::DsmlParamValue { string, .. } => {
                self.close_param(&mut out, string);
                self.args(&mut out, "}");
                self.end_call(&mut out);
            }
            State::ForcedArguments => {
                self.start_forced(&mut out);
                self.end_call(&mut out);
            }
            State::JsonItem => {
                let item = std::mem::take(&mut self.acc);
                self.forced_item(&mut out, &item, "parameters", false);
            }
            State::HermesCall => {
                let block = std::mem::take(&mut self.raw);
                let body = std::mem::take(&mut self.acc);
                self.state = State::Answer;
                match call_object(&body, "arguments", false) {
                    Some((name, arguments)) => self.whole_call(&mut out, name, arguments),
                    None => self.emit_text(&mut out, &block),
                }
            }
            _ => {}
        }
        self.flush_ws(&mut out);
        self.done = true;
        out
    }

    fn markers(&self) -> Vec<(&str, Mk)> {
        let mut m: Vec<(&str, Mk)> = Vec::new();
        let v3 = self.format == OutputFormat::DeepseekV3;
        let v4 = self.format == OutputFormat::DeepseekV4;
        match self.state {
            State::Answer => {
                if self.format != OutputFormat::Plain && self.think_allowed {
                    m.push((THINK_OPEN, Mk::ThinkOpen));
                }
                if v3 {
                    m.push((V3_CALLS_BEGIN, Mk::V3CallsBegin));
                    m.push((V3_CALL_BEGIN, Mk::V3CallBegin));
                }
                if v4 {
                    for dialect in DSML_SPELLINGS {
                        m.push((dialect.calls_begin, Mk::DsmlBegin { dialect }));
                    }
                }
                if self.forced == Some(ForcedCall::Hermes) {
                    m.push((HERMES_OPEN, Mk::HermesOpen));
                }
                for (i, s) in self.stops.iter().enumerate() {
                    m.push((s.as_str(), Mk::Stop(i)));
                }
            }
            State::HermesCall => m.push((HERMES_CLOSE, Mk::HermesClose)),
            State::ForcedArguments | State::JsonList | State::JsonItem => {}
            State::Reasoning => m.push((THINK_CLOSE, Mk::ThinkClose)),
            State::V3Section => {
                m.push((V3_CALL_BEGIN, Mk::V3CallBegin));
                m.push((V3_CALLS_END, Mk::V3CallsEnd));
            }
            State::V3Header => {
                m.push((V3_SEP, Mk::V3Sep));
                m.push((V3_CALL_END, Mk::V3CallEnd));
            }
            State::V3Name => {
                m.push((V3_FENCE_OPEN, Mk::FenceOpen));
                m.push((V3_CALL_END, Mk::V3CallEnd));
            }
            State::V3Args { fenced } => {
                if fenced {
                    m.push((V3_FENCE_CLOSE, Mk::FenceClose));
                }
                m.push((V3_CALL_END, Mk::V3CallEnd));
            }
            State::V3AfterArgs => m.push((V3_CALL_END, Mk::V3CallEnd)),
            State::DsmlSection { dialect } => {
                m.push((dialect.invoke, Mk::DsmlInvoke));
                m.push((dialect.calls_end, Mk::DsmlEnd));
            }
            State::DsmlInvokeTag { .. } | State::DsmlParamTag { .. } => {
                m.push((TAG_CLOSE, Mk::TagClose))
            }
            State::DsmlInvoke { dialect } => {
                m.push((dialect.parameter, Mk::DsmlParam));
                m.push((dialect.invoke_end, Mk::DsmlInvokeEnd));
            }
            State::DsmlParamValue { dialect, .. } => {
                m.push((dialect.parameter_end, Mk::DsmlParamEnd))
            }
        }
        m
    }

    /// Whether marker `mk` may match at `pos` (only `<think>` depends on position).
    fn valid_at(&self, mk: Mk, pos: usize) -> bool {
        match mk {
            Mk::ThinkOpen => self.buf[..pos].trim().is_empty(),
            _ => true,
        }
    }

    fn process(&mut self, out: &mut Vec<OutputEvent>, at_end: bool) {
        loop {
            if self.done || self.buf.is_empty() {
                return;
            }
            // Earliest complete match (longest at a tie).
            let mut best: Option<(usize, usize, Mk)> = None;
            // Earliest position whose rest could still become a (longer) marker.
            let mut partial: Option<usize> = None;
            {
                let markers = self.markers();
                for &(m, mk) in &markers {
                    if let Some(p) = self.buf.find(m) {
                        if !self.valid_at(mk, p) {
                            continue;
                        }
                        let better = match best {
                            None => true,
                            Some((bp, bl, _)) => p < bp || (p == bp && m.len() > bl),
                        };
                        if better {
                            best = Some((p, m.len(), mk));
                        }
                    }
                }
                if !at_end {
                    let max = markers.iter().map(|(m, _)| m.len()).max().unwrap_or(0);
                    let from = self.buf.len().saturating_sub(max.saturating_sub(1));
                    for q in from..self.buf.len() {
                        if !self.buf.is_char_boundary(q) {
                            continue;
                        }
                        let rest = &self.buf[q..];
                        if markers.iter().any(|&(m, mk)| {
                            m.len() > rest.len() && m.starts_with(rest) && self.valid_at(mk, q)
                        }) {
                            partial = Some(q);
                            break;
                        }
                    }
                }
            }
            match (best, partial) {
                (Some((p, _, _)), Some(q)) if q <= p => {
                    self.emit_prefix(out, q);
                    return;
                }
                (Some((p, len, mk)), _) => {
                    self.emit_prefix(out, p);
                    let marker: String = self.buf[..len].to_string();
                    self.buf.replace_range(..len, "");
                    self.transition(out, mk, &marker);
                }
                (None, Some(q)) => {
                    self.emit_prefix(out, q);
                    return;
                }
                (None, None) => {
                    let n = self.buf.len();
                    self.emit_prefix(out, n);
                    return;
                }
            }
        }
    }

    /// Emits `buf[..n]` as the current state's content and removes it from the buffer.
    fn emit_prefix(&mut self, out: &mut Vec<OutputEvent>, n: usize) {
        if n == 0 {
            return;
        }
        let content: String = self.buf.drain(..n).collect();
        self.content(out, &content);
    }

    fn content(&mut self, out: &mut Vec<OutputEvent>, s: &str) {
        match self.state {
            State::Answer | State::V3Section | State::DsmlSection { .. } => self.emit_text(out, s),
            State::Reasoning => {
                let s = self.trim_leading(s);
                if !s.is_empty() {
                    push_merge(out, OutputEvent::Reasoning(s));
                }
            }
            State::V3Header | State::V3Name | State::DsmlInvokeTag { .. } => {
                self.acc.push_str(s);
                self.raw.push_str(s);
            }
            State::DsmlParamTag { .. } | State::DsmlParamValue { string: false, .. } => {
                self.acc.push_str(s)
            }
            State::V3Args { .. } => {
                let s = self.trim_leading(s);
                if !s.is_empty() {
                    self.args(out, &s);
                }
            }
            State::DsmlParamValue { string: true, .. } => {
                let escaped = json_escape(s);
                self.args(out, &escaped);
            }
            State::V3AfterArgs | State::DsmlInvoke { .. } => {}
            State::ForcedArguments => {
                self.start_forced(out);
                self.args(out, s);
            }
            State::JsonList | State::JsonItem => self.json_list(out, s),
            State::HermesCall => {
                self.acc.push_str(s);
                self.raw.push_str(s);
            }
        }
    }

    /// Starts the named call a plain model's output is the arguments of (once).
    fn start_forced(&mut self, out: &mut Vec<OutputEvent>) {
        if let (None, Some(ForcedCall::Arguments { name })) = (self.call, &self.forced) {
            let name = name.clone();
            self.start_call(out, name);
        }
    }

    /// A forced JSON list: each `{...}` item is collected and emitted when it closes.
    fn json_list(&mut self, out: &mut Vec<OutputEvent>, s: &str) {
        let mut text = String::new(); // outside the grammar's form: answer text
        for c in s.chars() {
            if self.state == State::JsonItem {
                self.acc.push(c);
                if self.json.step(c) {
                    let item = std::mem::take(&mut self.acc);
                    self.forced_item(out, &item, "parameters", true);
                }
            } else if c == '{' {
                if !text.is_empty() {
                    self.emit_text(out, &std::mem::take(&mut text));
                }
                self.state = State::JsonItem;
                self.json = JsonScan::default();
                self.json.step(c);
                self.acc.push(c);
            } else if !(c.is_whitespace() || matches!(c, '[' | ',' | ']')) {
                text.push(c);
            }
        }
        if !text.is_empty() {
            self.emit_text(out, &text);
        }
    }

    /// One JSON-list item (`complete` or cut off at the end): its call, or its text.
    fn forced_item(&mut self, out: &mut Vec<OutputEvent>, item: &str, key: &str, complete: bool) {
        self.state = State::JsonList;
        match call_object(item, key, complete) {
            Some((name, arguments)) => self.whole_call(out, name, arguments),
            None => self.emit_text(out, item),
        }
    }

    fn whole_call(&mut self, out: &mut Vec<OutputEvent>, name: String, arguments: String) {
        self.start_call(out, name);
        self.args(out, &arguments);
        self.end_call(out);
    }

    /// Plain text is passed through as is, unless it surrounds a forced call, whose
    /// whitespace goes as DeepSeek formats' does.
    fn verbatim(&self) -> bool {
        self.format == OutputFormat::Plain && self.forced.is_none()
    }

    fn trim_leading(&mut self, s: &str) -> String {
        if self.verbatim() || !self.leading {
            return s.to_string();
        }
        let t = s.trim_start();
        if !t.is_empty() {
            self.leading = false;
        }
        t.to_string()
    }

    fn emit_text(&mut self, out: &mut Vec<OutputEvent>, s: &str) {
        let s = self.trim_leading(s);
        if s.is_empty() {
            return;
        }
        if self.state == State::Answer {
            self.think_allowed = false;
        }
        if self.verbatim() || self.state != State::Answer {
            push_merge(out, OutputEvent::Text(s));
            return;
        }
        let mut full = std::mem::take(&mut self.pending_ws);
        full.push_str(&s);
        let body_len = full.trim_end().len();
        self.pending_ws = full[body_len..].to_string();
        full.truncate(body_len);
        if !full.is_empty() {
            push_merge(out, OutputEvent::Text(full));
        }
    }

    /// Emits held-back answer whitespace (before a stop, at the end).
    fn flush_ws(&mut self, out: &mut Vec<OutputEvent>) {
        let ws = std::mem::take(&mut self.pending_ws);
        if !ws.is_empty() {
            push_merge(out, OutputEvent::Text(ws));
        }
    }

    fn args(&mut self, out: &mut Vec<OutputEvent>, delta: &str) {
        if let Some((index, any)) = self.call.as_mut() {
            if !delta.is_empty() {
                *any = true;
                let index = *index;
                push_merge(
                    out,
                    OutputEvent::ToolCallArguments {
                        index,
                        delta: delta.to_string(),
                    },
                );
            }
        }
    }

    fn start_call(&mut self, out: &mut Vec<OutputEvent>, name: String) {
        let index = self.next_index;
        self.next_index += 1;
        self.raw.clear();
        self.acc.clear();
        self.call = Some((index, false));
        self.params = 0;
        self.leading = true;
        out.push(OutputEvent::ToolCallStart {
            index,
            id: format!("{}_{}", self.id_prefix, index),
            name,
        });
    }

    fn end_call(&mut self, out: &mut Vec<OutputEvent>) {
        if let Some((index, any)) = self.call {
            if !any {
                self.args(out, "{}");
            }
            out.push(OutputEvent::ToolCallEnd { index });
        }
        self.call = None;
        self.leading = true;
    }

    fn close_param(&mut self, out: &mut Vec<OutputEvent>, string: bool) {
        if string {
            self.args(out, "\"");
        } else {
            let value = std::mem::take(&mut self.acc);
            let value = value.trim();
            let json = if serde_json::from_str::<serde_json::Value>(value).is_ok() {
                value.to_string()
            } else {
                serde_json::Value::String(value.to_string()).to_string()
            };
            self.args(out, &json);
        }
    }

    fn transition(&mut self, out: &mut Vec<OutputEvent>, mk: Mk, marker: &str) {
        match (self.state, mk) {
            (_, Mk::Stop(i)) => {
                self.flush_ws(out);
                out.push(OutputEvent::Stopped {
                    stop: self.stops[i].clone(),
                });
                self.done = true;
                self.buf.clear();
            }
            (_, Mk::ThinkOpen) => {
                self.state = State::Reasoning;
                self.think_allowed = false;
                self.leading = true;
            }
            (_, Mk::ThinkClose) => {
                self.state = State::Answer;
                self.leading = true;
            }
            (_, Mk::V3CallsBegin) => {
                self.pending_ws.clear();
                self.state = State::V3Section;
                self.think_allowed = false;
                self.leading = true;
            }
            (_, Mk::V3CallsEnd) => {
                self.state = State::Answer;
                self.leading = true;
            }
            (_, Mk::V3CallBegin) => {
                self.pending_ws.clear();
                self.state = State::V3Header;
                self.think_allowed = false;
                self.acc.clear();
                self.raw = marker.to_string();
            }
            (State::V3Header, Mk::V3Sep) => {
                let header = self.acc.trim().to_string();
                if header == "function" {
                    self.raw.push_str(marker);
                    self.acc.clear();
                    self.state = State::V3Name;
                } else {
                    self.start_call(out, header);
                    self.state = State::V3Args { fenced: false };
                }
            }
            (State::V3Header, Mk::V3CallEnd) => {
                // No separator: not a call we can name; give the markup back as text.
                self.raw.push_str(marker);
                let raw = std::mem::take(&mut self.raw);
                self.acc.clear();
                self.state = State::V3Section;
                self.emit_text(out, &raw);
            }
            (State::V3Name, Mk::FenceOpen) => {
                let name = self.acc.trim().to_string();
                self.start_call(out, name);
                self.state = State::V3Args { fenced: true };
            }
            (State::V3Name, Mk::V3CallEnd) => {
                let name = self.acc.trim().to_string();
                self.start_call(out, name);
                self.end_call(out);
                self.state = State::V3Section;
            }
            (_, Mk::FenceClose) => self.state = State::V3AfterArgs,
            (_, Mk::V3CallEnd) => {
                self.end_call(out);
                self.state = State::V3Section;
            }
            (_, Mk::DsmlBegin { dialect }) => {
                self.pending_ws.clear();
                self.state = State::DsmlSection { dialect };
                self.think_allowed = false;
                self.leading = true;
            }
            (_, Mk::DsmlEnd) => {
                self.state = State::Answer;
                self.leading = true;
            }
            (State::DsmlSection { dialect }, Mk::DsmlInvoke) => {
                self.state = State::DsmlInvokeTag { dialect };
                self.acc.clear();
                self.raw = marker.to_string();
            }
            (State::DsmlInvokeTag { dialect }, Mk::TagClose) => {
                let name = attr(&self.acc, "name").unwrap_or_else(|| self.acc.trim().to_string());
                self.start_call(out, name);
                self.args(out, "{");
                self.state = State::DsmlInvoke { dialect };
            }
            (State::DsmlInvoke { dialect }, Mk::DsmlParam) => {
                self.acc.clear();
                self.state = State::DsmlParamTag { dialect };
            }
            (State::DsmlInvoke { dialect }, Mk::DsmlInvokeEnd) => {
                self.args(out, "}");
                self.end_call(out);
                self.state = State::DsmlSection { dialect };
            }
            (State::DsmlParamTag { dialect }, Mk::TagClose) => {
                let tag = std::mem::take(&mut self.acc);
                let name = attr(&tag, "name").unwrap_or_default();
                let string = attr(&tag, "string").as_deref() == Some("true");
                let mut delta = String::new();
                if self.params > 0 {
                    delta.push_str(", ");
                }
                delta.push_str(&serde_json::Value::String(name).to_string());
                delta.push_str(": ");
                if string {
                    delta.push('"');
                }
                self.params += 1;
                self.args(out, &delta);
                self.state = State::DsmlParamValue { dialect, string };
            }
            (State::DsmlParamValue { dialect, string }, Mk::DsmlParamEnd) => {
                self.close_param(out, string);
                self.state = State::DsmlInvoke { dialect };
            }
            (_, Mk::HermesOpen) => {
                self.pending_ws.clear();
                self.state = State::HermesCall;
                self.acc.clear();
                self.raw = marker.to_string();
            }
            (_, Mk::HermesClose) => {
                self.raw.push_str(marker);
                let block = std::mem::take(&mut self.raw);
                let body = std::mem::take(&mut self.acc);
                self.state = State::Answer;
                match call_object(&body, "arguments", true) {
                    Some((name, arguments)) => self.whole_call(out, name, arguments),
                    None => self.emit_text(out, &block),
                }
            }
            // Every marker is only offered in the states handled above.
            _ => {}
        }
    }
}

/// Appends an event, merging it into the previous one when both are deltas of the same kind.
fn push_merge(out: &mut Vec<OutputEvent>, event: OutputEvent) {
    match (out.last_mut(), &event) {
        (Some(OutputEvent::Text(a)), OutputEvent::Text(b)) => a.push_str(b),
        (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b)) => a.push_str(b),
        (
            Some(OutputEvent::ToolCallArguments { index: i, delta: a }),
            OutputEvent::ToolCallArguments { index: j, delta: b },
        ) if i == j => a.push_str(b),
        _ => out.push(event),
    }
}

/// Merges adjacent deltas of the same kind (what two chunkings of one output agree on).
pub fn merge_deltas(events: impl IntoIterator<Item = OutputEvent>) -> Vec<OutputEvent> {
    let mut out = Vec::new();
    for event in events {
        push_merge(&mut out, event);
    }
    out
}

/// The inside of a JSON string literal for `s` (escaping is per character, so
/// escaping chunks and concatenating equals escaping the whole).
fn json_escape(s: &str) -> String {
    let quoted = serde_json::Value::String(s.to_string()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

/// A forced call's object, `{"name": N, "KEY": ARGS}` in that order (the grammar's
/// layout; any JSON whitespace between tokens): N and ARGS as the model wrote them. Cut off
/// (`complete` false): once N is complete, ARGS as far as they go (empty before they
/// start). Another layout of a complete object is read as JSON (ARGS re-serialised);
/// anything else is None.
fn call_object(text: &str, key: &str, complete: bool) -> Option<(String, String)> {
    let rest = text.trim_start().strip_prefix('{')?.trim_start();
    let named = rest
        .strip_prefix("\"name\"")
        .and_then(|r| r.trim_start().strip_prefix(':'))
        .map(str::trim_start)
        .and_then(|r| {
            let mut names = serde_json::Deserializer::from_str(r).into_iter::<String>();
            let name = names.next()?.ok()?;
            Some((name, &r[names.byte_offset()..]))
        });
    if let Some((name, rest)) = named {
        let arguments = rest
            .trim_start()
            .strip_prefix(',')
            .map(str::trim_start)
            .and_then(|r| r.strip_prefix(&format!("\"{key}\"")))
            .and_then(|r| r.trim_start().strip_prefix(':'))
            .map(str::trim_start);
        match (arguments, complete) {
            (Some(arguments), true) => {
                if let Some(arguments) = arguments.trim_end().strip_suffix('}') {
                    return Some((name, arguments.trim_end().to_string()));
                }
            }
            (Some(arguments), false) => return Some((name, arguments.to_string())),
            (None, false) => return Some((name, String::new())),
            (None, true) => {}
        }
    }
    if !complete {
        return None;
    }
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = value.get(key).map(|v| v.to_string()).unwrap_or_default();
    Some((name, arguments))
}

/// `key="value"` from a tag's attribute text.
fn attr(tag: &str, key: &str) -> Option<String> {
    let needle = format!("{key}=\"");
    let mut from = 0;
    while let Some(i) = tag[from..].find(&needle) {
        let at = from + i;
        let before_ok = at == 0 || tag[..at].ends_with(|c: char| c.is_whitespace());
        let start = at + needle.len();
        if before_ok {
            let end = tag[start..]
                .find('"')
                .map(|e| start + e)
                .unwrap_or(tag.len());
            return Some(tag[start..end].to_string());
        }
        from = start;
    }
    None
}

/// Parses a whole output at once (what a non-streaming request does).
pub fn parse_all(
    format: OutputFormat,
    stop: Vec<String>,
    starts_in_reasoning: bool,
    text: &str,
) -> Vec<OutputEvent> {
    let mut parser = StreamParser::new(format, stop, starts_in_reasoning);
    let mut events = parser.push(text);
    events.extend(parser.finish());
    merge_deltas(events)
}
