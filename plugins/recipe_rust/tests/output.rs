//! Output side: parser events per format, response bodies and SSE sequences per protocol,
//! and chunking invariance (property tests).

use powertrain_recipe::output::parser::{merge_deltas, parse_all};
use powertrain_recipe::output::{
    FinishReason, ForcedCall, OutputEvent, OutputFormat, ResponseBuilder, SseWriter, StreamParser,
    Usage,
};
use powertrain_recipe::Protocol;
use proptest::prelude::*;
use serde_json::{json, Value};

use OutputEvent::*;

const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const SEP: &str = "<｜tool▁sep｜>";

fn parse_chunks(
    format: OutputFormat,
    stops: &[&str],
    sir: bool,
    chunks: &[&str],
) -> Vec<OutputEvent> {
    let mut p = StreamParser::new(format, stops.iter().map(|s| s.to_string()).collect(), sir);
    let mut events = Vec::new();
    for c in chunks {
        events.extend(p.push(c));
    }
    events.extend(p.finish());
    merge_deltas(events)
}

fn one_shot(format: OutputFormat, stops: &[&str], sir: bool, text: &str) -> Vec<OutputEvent> {
    parse_all(
        format,
        stops.iter().map(|s| s.to_string()).collect(),
        sir,
        text,
    )
}

fn start(index: usize, name: &str) -> OutputEvent {
    ToolCallStart {
        index,
        id: format!("call_{index}"),
        name: name.into(),
    }
}

fn args(index: usize, delta: &str) -> OutputEvent {
    ToolCallArguments {
        index,
        delta: delta.into(),
    }
}

fn v3_two_calls() -> String {
    format!(
        "Checking.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{CALL_END}\n{CALL_BEGIN}function{SEP}get_time\n```json\n{{\"tz\": \"CET\"}}\n```{CALL_END}{CALLS_END}"
    )
}

fn v31_two_calls() -> String {
    format!(
        "Checking.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{\"city\": \"Paris\"}}{CALL_END}{CALL_BEGIN}get_time{SEP}{{\"tz\": \"CET\"}}{CALL_END}{CALLS_END}"
    )
}

fn dsml_two_calls(wrapper: &str) -> String {
    format!(
        "Checking.\n\n<｜DSML｜{wrapper}>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"tz\" string=\"true\">CET</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜{wrapper}>"
    )
}

fn two_calls_events() -> Vec<OutputEvent> {
    vec![
        Text("Checking.".into()),
        start(0, "get_weather"),
        args(0, "{\"city\": \"Paris\"}"),
        ToolCallEnd { index: 0 },
        start(1, "get_time"),
        args(1, "{\"tz\": \"CET\"}"),
        ToolCallEnd { index: 1 },
    ]
}

fn reasoning_events() -> Vec<OutputEvent> {
    vec![
        Reasoning("Let me think.".into()),
        Text("The answer is 4.".into()),
    ]
}

// ---------------------------------------------------------------- parser goldens

#[test]
fn plain_is_verbatim() {
    let text = "  <think>not special</think> {CALLS_BEGIN}\n";
    assert_eq!(
        one_shot(OutputFormat::Plain, &[], false, text),
        vec![Text(text.into())]
    );
    // starts_in_reasoning has no meaning for Plain.
    assert_eq!(
        one_shot(OutputFormat::Plain, &[], true, "hi"),
        vec![Text("hi".into())]
    );
}

// ---------------------------------------------------------------- forced calls (plain models)

/// A plain parser reading `forced`, fed `chunks`; events merged.
fn forced_chunks(forced: ForcedCall, stops: &[&str], chunks: &[&str]) -> Vec<OutputEvent> {
    let mut p = StreamParser::new(
        OutputFormat::Plain,
        stops.iter().map(|s| s.to_string()).collect(),
        false,
    )
    .with_forced_call(forced);
    let mut events = Vec::new();
    for c in chunks {
        events.extend(p.push(c));
    }
    events.extend(p.finish());
    merge_deltas(events)
}

/// Every char as its own chunk gives the same events as the whole text.
fn forced_all_ways(forced: ForcedCall, text: &str) -> Vec<OutputEvent> {
    let whole = forced_chunks(forced.clone(), &[], &[text]);
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(|s| s.as_str()).collect();
    assert_eq!(forced_chunks(forced, &[], &refs), whole, "{text:?}");
    whole
}

fn whole_call(index: usize, name: &str, arguments: &str) -> Vec<OutputEvent> {
    vec![
        start(index, name),
        args(index, arguments),
        ToolCallEnd { index },
    ]
}

#[test]
fn forced_arguments_are_the_named_tools_call() {
    let named = || ForcedCall::Arguments {
        name: "get_weather".into(),
    };
    let text = r#"{"city": "Paris", "days": 3}"#;
    assert_eq!(
        forced_all_ways(named(), text),
        whole_call(0, "get_weather", text)
    );
    // The call starts with the first text and its arguments stream as they come.
    let mut p = StreamParser::new(OutputFormat::Plain, vec![], false).with_forced_call(named());
    assert_eq!(
        p.push(r#"{"city": "#),
        vec![start(0, "get_weather"), args(0, r#"{"city": "#)]
    );
    assert_eq!(p.push(r#""Lima"}"#), vec![args(0, r#""Lima"}"#)]);
    assert_eq!(p.finish(), vec![ToolCallEnd { index: 0 }]);
    // No output at all: still the call, with empty arguments. Stop strings are not
    // looked for inside a call.
    assert_eq!(
        forced_all_ways(named(), ""),
        whole_call(0, "get_weather", "{}")
    );
    assert_eq!(
        forced_chunks(named(), &["}"], &[r#"{"a": 1}"#]),
        whole_call(0, "get_weather", r#"{"a": 1}"#)
    );
}

#[test]
fn forced_json_list_gives_one_call_per_item() {
    let text = r#"[{"name": "get_weather", "parameters": {"city": "Pa}r]is\"{"}}, {"name": "get_time", "parameters": {}}]"#;
    let mut expected = whole_call(0, "get_weather", r#"{"city": "Pa}r]is\"{"}"#);
    expected.extend(whole_call(1, "get_time", "{}"));
    assert_eq!(forced_all_ways(ForcedCall::JsonList, text), expected);
    // Whitespace anywhere JSON allows it; another key order is read as JSON.
    let text = "[ {\"name\" :\"f\" ,\n \"parameters\": {\"x\": [1, 2]} } ]";
    assert_eq!(
        forced_all_ways(ForcedCall::JsonList, text),
        whole_call(0, "f", r#"{"x": [1, 2]}"#)
    );
    let text = r#"[{"parameters": {"x": 1}, "name": "f"}]"#;
    assert_eq!(
        forced_all_ways(ForcedCall::JsonList, text),
        whole_call(0, "f", r#"{"x":1}"#)
    );
    // A call is emitted as soon as its item closes.
    let mut p = StreamParser::new(OutputFormat::Plain, vec![], false)
        .with_forced_call(ForcedCall::JsonList);
    assert_eq!(p.push(r#"[{"name": "f", "parameters": {"#), vec![]);
    assert_eq!(p.push(r#"}}, {"#), whole_call(0, "f", "{}"));
}

#[test]
fn forced_json_list_cut_off_closes_a_named_call_and_gives_back_the_rest() {
    // Out of tokens inside the arguments: the call, with what was written.
    let text = r#"[{"name": "get_weather", "parameters": {"city": "Par"#;
    assert_eq!(
        forced_all_ways(ForcedCall::JsonList, text),
        whole_call(0, "get_weather", r#"{"city": "Par"#)
    );
    // Right after the name: the call with empty arguments.
    assert_eq!(
        forced_all_ways(ForcedCall::JsonList, r#"[{"name": "f", "param"#),
        whole_call(0, "f", "{}")
    );
    // Inside the name: no call, the item's text.
    assert_eq!(
        forced_all_ways(ForcedCall::JsonList, r#"[{"name": "get_wea"#),
        vec![Text(r#"{"name": "get_wea"#.into())]
    );
    // Text the grammar would not allow is text; an item that is no call is text too.
    assert_eq!(
        forced_all_ways(ForcedCall::JsonList, r#"Sure! [{"x": 1}]"#),
        vec![Text(r#"Sure!{"x": 1}"#.into())]
    );
}

#[test]
fn forced_hermes_blocks() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"</tool\"}}\n</tool_call>";
    // A `</tool_call>` inside the JSON string ends the block: Hermes has no escape for
    // it, and the grammar forbids it there.
    assert_eq!(
        forced_all_ways(ForcedCall::Hermes, text),
        whole_call(0, "get_weather", "{\"city\": \"</tool\"}")
    );
    let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
    let mut expected = whole_call(0, "f", "{\"a\": 1}");
    expected.extend(whole_call(1, "g", "{}"));
    assert_eq!(forced_all_ways(ForcedCall::Hermes, text), expected);
    // Cut off inside the arguments, or before the name is complete.
    assert_eq!(
        forced_all_ways(
            ForcedCall::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": "
        ),
        whole_call(0, "f", "{\"a\": ")
    );
    assert_eq!(
        forced_all_ways(ForcedCall::Hermes, "<tool_call>\n{\"na"),
        vec![Text("<tool_call>\n{\"na".into())]
    );
}

#[test]
fn a_forced_call_is_text_without_the_flag_and_ignored_by_deepseek_formats() {
    let text = r#"[{"name": "f", "parameters": {}}]"#;
    assert_eq!(
        one_shot(OutputFormat::Plain, &[], false, text),
        vec![Text(text.into())]
    );
    for format in [OutputFormat::DeepseekV3, OutputFormat::DeepseekV4] {
        let parser =
            StreamParser::new(format, vec![], false).with_forced_call(ForcedCall::JsonList);
        let mut parser = parser;
        let mut events = parser.push(text);
        events.extend(parser.finish());
        assert_eq!(merge_deltas(events), vec![Text(text.into())], "{format:?}");
    }
}

#[test]
fn reasoning_then_text_all_formats() {
    for format in [OutputFormat::DeepseekV3, OutputFormat::DeepseekV4] {
        let text = "<think>\nLet me think.</think>\n\nThe answer is 4.";
        assert_eq!(
            one_shot(format, &[], false, text),
            reasoning_events(),
            "{format:?}"
        );
        // Thinking already opened by the prompt.
        let text = "Let me think.</think>\n\nThe answer is 4.";
        assert_eq!(
            one_shot(format, &[], true, text),
            reasoning_events(),
            "{format:?}"
        );
        // Unclosed reasoning is still reasoning.
        assert_eq!(
            one_shot(format, &[], true, "hmm"),
            vec![Reasoning("hmm".into())]
        );
        // <think> after answer text is text.
        assert_eq!(
            one_shot(format, &[], false, "a <think>b"),
            vec![Text("a <think>b".into())]
        );
    }
}

#[test]
fn v3_r1_form_two_calls() {
    assert_eq!(
        one_shot(OutputFormat::DeepseekV3, &[], false, &v3_two_calls()),
        two_calls_events()
    );
}

#[test]
fn v31_form_two_calls() {
    assert_eq!(
        one_shot(OutputFormat::DeepseekV3, &[], false, &v31_two_calls()),
        two_calls_events()
    );
    // Without the outer begin/end markers too.
    let bare = format!("Checking.{CALL_BEGIN}get_weather{SEP}{{\"city\": \"Paris\"}}{CALL_END}");
    assert_eq!(
        one_shot(OutputFormat::DeepseekV3, &[], false, &bare),
        two_calls_events()[..4].to_vec()
    );
}

#[test]
fn dsml_two_calls_both_wrappers() {
    for wrapper in ["function_calls", "tool_calls"] {
        assert_eq!(
            one_shot(
                OutputFormat::DeepseekV4,
                &[],
                false,
                &dsml_two_calls(wrapper)
            ),
            two_calls_events()
        );
    }
}

#[test]
fn dsml_v41_spelling_one_shot_and_char_by_char() {
    // DeepSeek-V4.1 writes a space after the DSML token: "<｜DSML｜ calls>" and
    // "<｜DSML｜ invoke" / "<｜DSML｜ parameter" (its official adapter's encoding).
    let text = dsml_two_calls("tool_calls")
        .replace("｜DSML｜tool_calls", "｜DSML｜ calls")
        .replace("｜DSML｜invoke", "｜DSML｜ invoke")
        .replace("｜DSML｜parameter", "｜DSML｜ parameter");
    assert_eq!(
        one_shot(OutputFormat::DeepseekV4, &[], false, &text),
        two_calls_events()
    );
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chunks: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        parse_chunks(OutputFormat::DeepseekV4, &[], false, &chunks),
        two_calls_events()
    );
    // A V4 invoke inside a V4.1 section is not markup of that section: it stays text
    // of the call's arguments, never a second call.
    let mixed = text.replacen(
        "<｜DSML｜ invoke name=\"get_time\">",
        "<｜DSML｜invoke name=\"get_time\">",
        1,
    );
    let calls = one_shot(OutputFormat::DeepseekV4, &[], false, &mixed)
        .into_iter()
        .filter(|e| matches!(e, ToolCallStart { .. }))
        .count();
    assert_eq!(calls, 1);
}

#[test]
fn dsml_typed_parameters() {
    let text = "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"s\" string=\"true\">a \"q\"\nb</｜DSML｜parameter>\n<｜DSML｜parameter name=\"n\" string=\"false\"> 42 </｜DSML｜parameter>\n<｜DSML｜parameter name=\"o\" string=\"false\">{\"k\": [1, true]}</｜DSML｜parameter>\n<｜DSML｜parameter name=\"bad\" string=\"false\">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
    let events = one_shot(OutputFormat::DeepseekV4, &[], false, text);
    assert_eq!(
        events,
        vec![
            start(0, "f"),
            args(0, "{\"s\": \"a \\\"q\\\"\\nb\", \"n\": 42, \"o\": {\"k\": [1, true]}, \"bad\": \"not json\"}"),
            ToolCallEnd { index: 0 },
        ]
    );
    let ToolCallArguments { delta, .. } = &events[1] else {
        unreachable!()
    };
    let v: Value = serde_json::from_str(delta).unwrap();
    assert_eq!(
        v,
        json!({"s": "a \"q\"\nb", "n": 42, "o": {"k": [1, true]}, "bad": "not json"})
    );
    // No parameters: "{}".
    let text = "<｜DSML｜function_calls><｜DSML｜invoke name=\"f\"></｜DSML｜invoke></｜DSML｜function_calls>";
    assert_eq!(
        one_shot(OutputFormat::DeepseekV4, &[], false, text),
        vec![start(0, "f"), args(0, "{}"), ToolCallEnd { index: 0 }]
    );
}

#[test]
fn reasoning_then_tool_call_then_text() {
    let text = format!(
        "<think>plan</think>{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{}}{CALL_END}{CALLS_END}\n\nDone."
    );
    assert_eq!(
        one_shot(OutputFormat::DeepseekV3, &[], false, &text),
        vec![
            Reasoning("plan".into()),
            start(0, "f"),
            args(0, "{}"),
            ToolCallEnd { index: 0 },
            Text("Done.".into())
        ]
    );
}

#[test]
fn id_prefix() {
    let mut p =
        StreamParser::new(OutputFormat::DeepseekV3, vec![], false).with_id_prefix("toolu_abc");
    let mut ev = p.push(&v31_two_calls());
    ev.extend(p.finish());
    let ids: Vec<_> = ev
        .iter()
        .filter_map(|e| {
            if let ToolCallStart { id, .. } = e {
                Some(id.clone())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(ids, vec!["toolu_abc_0", "toolu_abc_1"]);
}

#[test]
fn stop_sequences() {
    for format in [
        OutputFormat::Plain,
        OutputFormat::DeepseekV3,
        OutputFormat::DeepseekV4,
    ] {
        let expected = vec![Text("Hello".into()), Stopped { stop: "END".into() }];
        assert_eq!(one_shot(format, &["END"], false, "HelloEND more"), expected);
        // Split across chunks at every position.
        let text = "HelloEND more";
        for i in 0..=text.len() {
            assert_eq!(
                parse_chunks(format, &["END"], false, &[&text[..i], &text[i..]]),
                expected,
                "{format:?} {i}"
            );
        }
        // Nothing after Stopped, even on later pushes.
        let mut p = StreamParser::new(format, vec!["END".into()], false);
        let first = p.push("HelloEN");
        assert_eq!(first, vec![Text("Hello".into())]);
        assert_eq!(p.push("D and more"), vec![Stopped { stop: "END".into() }]);
        assert!(p.push("x").is_empty());
        assert!(p.finish().is_empty());
        // A held-back partial that never completes is flushed at finish.
        assert_eq!(
            parse_chunks(format, &["END"], false, &["Hello", "EN"]),
            vec![Text("HelloEN".into())]
        );
    }
    // Earliest stop wins; at the same position the longest.
    assert_eq!(
        one_shot(OutputFormat::Plain, &["b", "ab", "abc"], false, "xabcd"),
        vec![Text("x".into()), Stopped { stop: "abc".into() }]
    );
    // Stops do not apply inside reasoning.
    assert_eq!(
        one_shot(
            OutputFormat::DeepseekV3,
            &["STOP"],
            false,
            "<think>STOP</think>okSTOPno"
        ),
        vec![
            Reasoning("STOP".into()),
            Text("ok".into()),
            Stopped {
                stop: "STOP".into()
            }
        ]
    );
}

#[test]
fn holds_back_only_possible_marker_prefixes() {
    let mut p = StreamParser::new(OutputFormat::DeepseekV3, vec![], true);
    assert_eq!(p.push("abc</thi"), vec![Reasoning("abc".into())]);
    // Trailing answer whitespace waits to see whether a tool call follows.
    assert_eq!(p.push("nk>Hi <"), vec![Text("Hi".into())]);
    assert_eq!(p.push("b>"), vec![Text(" <b>".into())]);
    let mut p = StreamParser::new(OutputFormat::DeepseekV3, vec![], false);
    // "<｜tool" could still become a tool marker.
    assert_eq!(p.push("x<｜tool"), vec![Text("x".into())]);
    assert_eq!(p.push("▁sep｜>y"), vec![Text("<｜tool▁sep｜>y".into())]);
}

#[test]
fn malformed_markup_at_finish() {
    // Name never completed: raw markup comes back as text.
    let text = format!("Hi{CALLS_BEGIN}{CALL_BEGIN}get_wea");
    assert_eq!(
        one_shot(OutputFormat::DeepseekV3, &[], false, &text),
        vec![Text(format!("Hi{CALL_BEGIN}get_wea"))]
    );
    // Name known, arguments cut off: best-effort call.
    let text = format!("{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{\"a\": 1");
    assert_eq!(
        one_shot(OutputFormat::DeepseekV3, &[], false, &text),
        vec![
            start(0, "f"),
            args(0, "{\"a\": 1"),
            ToolCallEnd { index: 0 }
        ]
    );
    // DSML cut inside a string value: closed into valid JSON.
    let text = "<｜DSML｜function_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"a\" string=\"true\">hel";
    let events = one_shot(OutputFormat::DeepseekV4, &[], false, text);
    assert_eq!(
        events,
        vec![
            start(0, "f"),
            args(0, "{\"a\": \"hel\"}"),
            ToolCallEnd { index: 0 }
        ]
    );
    // DSML invoke tag cut: text.
    let text = "ok<｜DSML｜function_calls><｜DSML｜invoke na";
    assert_eq!(
        one_shot(OutputFormat::DeepseekV4, &[], false, text),
        vec![Text("ok<｜DSML｜invoke na".into())]
    );
    // call_end before any separator: text.
    let text = format!("{CALLS_BEGIN}{CALL_BEGIN}oops{CALL_END}{CALLS_END}");
    assert_eq!(
        one_shot(OutputFormat::DeepseekV3, &[], false, &text),
        vec![Text(format!("{CALL_BEGIN}oops{CALL_END}"))]
    );
}

#[test]
fn push_bytes_utf8() {
    let text = "héllo ｜ wörld";
    let bytes = text.as_bytes();
    let mut p = StreamParser::new(OutputFormat::Plain, vec![], false);
    let mut ev = Vec::new();
    for b in bytes {
        ev.extend(p.push_bytes(std::slice::from_ref(b)));
    }
    ev.extend(p.finish());
    assert_eq!(merge_deltas(ev), vec![Text(text.into())]);
    // Invalid and truncated bytes become U+FFFD.
    let mut p = StreamParser::new(OutputFormat::Plain, vec![], false);
    let mut ev = p.push_bytes(b"a\xffb\xe2\x82");
    ev.extend(p.finish());
    assert_eq!(merge_deltas(ev), vec![Text("a\u{FFFD}b\u{FFFD}".into())]);
}

// ---------------------------------------------------------------- response bodies

fn build(events: &[OutputEvent], protocol: Protocol, finish: &FinishReason) -> Value {
    let mut b = ResponseBuilder::new();
    b.extend(events);
    let usage = Usage {
        prompt_tokens: 10,
        completion_tokens: 5,
        cached_prompt_tokens: 4,
        reasoning_tokens: 2,
    };
    let id = match protocol {
        Protocol::ChatCompletions => "chatcmpl-1",
        Protocol::Responses => "resp_1",
        Protocol::AnthropicMessages => "msg_1",
    };
    b.build(protocol, id, "m", 1700000000, finish, &usage)
}

#[test]
fn chat_completion_bodies() {
    let body = build(
        &reasoning_events(),
        Protocol::ChatCompletions,
        &FinishReason::Stop,
    );
    assert_eq!(
        body,
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Let me think."}, "logprobs": null, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2}},
        })
    );
    let body = build(
        &two_calls_events(),
        Protocol::ChatCompletions,
        &FinishReason::ToolCalls,
    );
    assert_eq!(
        body["choices"][0],
        json!({"index": 0, "message": {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}},
        ]}, "logprobs": null, "finish_reason": "tool_calls"})
    );
    let calls_only = &two_calls_events()[1..];
    assert_eq!(
        build(
            calls_only,
            Protocol::ChatCompletions,
            &FinishReason::ToolCalls
        )["choices"][0]["message"]["content"],
        Value::Null
    );
    let stop = one_shot(OutputFormat::Plain, &["END"], false, "HelloEND");
    let mut b = ResponseBuilder::new();
    b.extend(&stop);
    assert_eq!(
        b.finish_reason(false),
        FinishReason::StopSequence("END".into())
    );
    assert_eq!(
        build(&stop, Protocol::ChatCompletions, &b.finish_reason(false))["choices"][0]
            ["finish_reason"],
        "stop"
    );
    assert_eq!(
        build(&stop, Protocol::ChatCompletions, &FinishReason::Length)["choices"][0]
            ["finish_reason"],
        "length"
    );
}

#[test]
fn responses_bodies() {
    let body = build(
        &reasoning_events(),
        Protocol::Responses,
        &FinishReason::Stop,
    );
    assert_eq!(
        body,
        json!({
            "id": "resp_1", "object": "response", "created_at": 1700000000, "status": "completed", "error": null, "incomplete_details": null, "model": "m",
            "output": [
                {"id": "rs_1_0", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Let me think."}]},
                {"id": "msg_1_1", "type": "message", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "The answer is 4.", "annotations": [], "logprobs": []}]},
            ],
            "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 15},
        })
    );
    let body = build(
        &two_calls_events(),
        Protocol::Responses,
        &FinishReason::ToolCalls,
    );
    assert_eq!(
        body["output"][1],
        json!({"id": "fc_1_1", "type": "function_call", "status": "completed", "call_id": "call_0", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"})
    );
    assert_eq!(body["output"][2]["call_id"], "call_1");
    let body = build(
        &reasoning_events(),
        Protocol::Responses,
        &FinishReason::Length,
    );
    assert_eq!(body["status"], "incomplete");
    assert_eq!(
        body["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
}

#[test]
fn anthropic_bodies() {
    let body = build(
        &reasoning_events(),
        Protocol::AnthropicMessages,
        &FinishReason::Stop,
    );
    assert_eq!(
        body,
        json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "thinking", "thinking": "Let me think.", "signature": ""}, {"type": "text", "text": "The answer is 4."}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 6, "output_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4},
        })
    );
    let body = build(
        &two_calls_events(),
        Protocol::AnthropicMessages,
        &FinishReason::ToolCalls,
    );
    assert_eq!(
        body["content"],
        json!([
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "call_0", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "call_1", "name": "get_time", "input": {"tz": "CET"}},
        ])
    );
    assert_eq!(body["stop_reason"], "tool_use");
    let body = build(
        &[Text("Hello".into())],
        Protocol::AnthropicMessages,
        &FinishReason::StopSequence("END".into()),
    );
    assert_eq!(
        (body["stop_reason"].clone(), body["stop_sequence"].clone()),
        (json!("stop_sequence"), json!("END"))
    );
    assert_eq!(
        build(&[], Protocol::AnthropicMessages, &FinishReason::Length)["stop_reason"],
        "max_tokens"
    );
}

/// Every format's markup for the same output gives the same bodies.
#[test]
fn all_formats_agree_per_protocol() {
    let outputs = [
        (OutputFormat::DeepseekV3, v3_two_calls()),
        (OutputFormat::DeepseekV3, v31_two_calls()),
        (OutputFormat::DeepseekV4, dsml_two_calls("function_calls")),
        (OutputFormat::DeepseekV4, dsml_two_calls("tool_calls")),
    ];
    for protocol in [
        Protocol::ChatCompletions,
        Protocol::Responses,
        Protocol::AnthropicMessages,
    ] {
        let expected = build(&two_calls_events(), protocol, &FinishReason::ToolCalls);
        for (format, text) in &outputs {
            let events = one_shot(*format, &[], false, text);
            assert_eq!(
                build(&events, protocol, &FinishReason::ToolCalls),
                expected,
                "{format:?} {protocol:?}"
            );
        }
    }
}

// ---------------------------------------------------------------- SSE

fn sse(
    protocol: Protocol,
    events: &[OutputEvent],
    finish: &FinishReason,
    include_usage: bool,
) -> Vec<String> {
    let id = match protocol {
        Protocol::ChatCompletions => "chatcmpl-1",
        Protocol::Responses => "resp_1",
        Protocol::AnthropicMessages => "msg_1",
    };
    let mut w = SseWriter::new(protocol, id, "m", 1700000000)
        .with_include_usage(include_usage)
        .with_prompt_usage(10, 4);
    let mut frames = w.start();
    for e in events {
        frames.extend(w.events(std::slice::from_ref(e)));
    }
    let usage = Usage {
        prompt_tokens: 10,
        completion_tokens: 5,
        cached_prompt_tokens: 4,
        reasoning_tokens: 2,
    };
    frames.extend(w.finish(finish, &usage));
    frames
}

/// (event name or "", parsed data or the raw data string).
fn split(frame: &str) -> (String, Value) {
    assert!(frame.ends_with("\n\n"), "{frame:?}");
    let mut event = String::new();
    let mut data = Value::Null;
    for line in frame.trim_end().lines() {
        if let Some(e) = line.strip_prefix("event: ") {
            event = e.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            data = serde_json::from_str(d).unwrap_or(Value::String(d.to_string()));
        } else {
            panic!("bad line {line:?}");
        }
    }
    (event, data)
}

#[test]
fn chat_sse_exact() {
    let frames = sse(
        Protocol::ChatCompletions,
        &two_calls_events(),
        &FinishReason::ToolCalls,
        true,
    );
    let chunk = |delta: Value, finish: Value| {
        format!(
            "data: {}\n\n",
            serde_json::to_string(&json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}], "usage": null})).unwrap()
        )
    };
    let expected = vec![
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"content": "Checking."}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": \"Paris\"}"}}]}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 1, "id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": ""}}]}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"tz\": \"CET\"}"}}]}), Value::Null),
        chunk(json!({}), json!("tool_calls")),
        format!("data: {}\n\n", serde_json::to_string(&json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2}}})).unwrap()),
        "data: [DONE]\n\n".to_string(),
    ];
    assert_eq!(frames, expected);
    // Reasoning, and no usage chunk (nor usage: null) without include_usage.
    let frames = sse(
        Protocol::ChatCompletions,
        &reasoning_events(),
        &FinishReason::Stop,
        false,
    );
    let data: Vec<Value> = frames.iter().map(|f| split(f).1).collect();
    assert_eq!(data.len(), 5);
    assert_eq!(
        data[1]["choices"][0]["delta"],
        json!({"reasoning_content": "Let me think."})
    );
    assert_eq!(
        data[2]["choices"][0]["delta"],
        json!({"content": "The answer is 4."})
    );
    assert_eq!(data[3]["choices"][0]["finish_reason"], "stop");
    assert!(data[3].get("usage").is_none());
    assert_eq!(data[4], json!("[DONE]"));
}

#[test]
fn responses_sse_sequence() {
    let events = vec![
        Reasoning("Let ".into()),
        Reasoning("me think.".into()),
        Text("The answer is 4.".into()),
    ];
    let frames = sse(Protocol::Responses, &events, &FinishReason::Stop, false);
    let parsed: Vec<(String, Value)> = frames.iter().map(|f| split(f)).collect();
    let names: Vec<&str> = parsed.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (name, data)) in parsed.iter().enumerate() {
        assert_eq!(data["type"], json!(name));
        assert_eq!(data["sequence_number"], json!(i));
    }
    assert_eq!(parsed[0].1["response"]["status"], "in_progress");
    assert_eq!(
        parsed[11].1,
        json!({"type": "response.output_text.delta", "item_id": "msg_1_1", "output_index": 1, "content_index": 0, "delta": "The answer is 4.", "logprobs": [], "sequence_number": 11})
    );
    assert_eq!(parsed[6].1["text"], "Let me think.");
    // The final response equals the non-streaming body.
    assert_eq!(
        parsed[15].1["response"],
        build(&events, Protocol::Responses, &FinishReason::Stop)
    );

    let frames = sse(
        Protocol::Responses,
        &two_calls_events(),
        &FinishReason::ToolCalls,
        false,
    );
    let parsed: Vec<(String, Value)> = frames.iter().map(|f| split(f)).collect();
    let names: Vec<&str> = parsed.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(
        names[2..],
        [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(
        parsed[8].1["item"],
        json!({"id": "fc_1_1", "type": "function_call", "status": "in_progress", "call_id": "call_0", "name": "get_weather", "arguments": ""})
    );
    assert_eq!(parsed[10].1["arguments"], "{\"city\": \"Paris\"}");
    assert_eq!(
        parsed[16].1["response"],
        build(
            &two_calls_events(),
            Protocol::Responses,
            &FinishReason::ToolCalls
        )
    );
    // Length -> response.incomplete.
    let frames = sse(
        Protocol::Responses,
        &[Text("x".into())],
        &FinishReason::Length,
        false,
    );
    assert_eq!(split(frames.last().unwrap()).0, "response.incomplete");
}

#[test]
fn responses_reasoning_summary_bodies_and_sse() {
    let events = vec![
        Reasoning("Let ".into()),
        Reasoning("me think.".into()),
        Text("The answer is 4.".into()),
    ];
    let usage = Usage {
        prompt_tokens: 10,
        completion_tokens: 5,
        cached_prompt_tokens: 4,
        reasoning_tokens: 2,
    };
    let mut b = ResponseBuilder::new();
    b.set_reasoning_summary(true);
    b.extend(&events);
    let body = b.build(
        Protocol::Responses,
        "resp_1",
        "m",
        1700000000,
        &FinishReason::Stop,
        &usage,
    );
    // The reasoning is the item's summary; no content part, as the API shapes a
    // summarised reasoning item. The message item is unchanged.
    assert_eq!(
        body["output"],
        json!([
            {"id": "rs_1_0", "type": "reasoning", "summary": [{"type": "summary_text", "text": "Let me think."}]},
            {"id": "msg_1_1", "type": "message", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "The answer is 4.", "annotations": [], "logprobs": []}]},
        ])
    );
    // Other protocols ignore the setting.
    let mut plain = ResponseBuilder::new();
    plain.extend(&events);
    for protocol in [Protocol::ChatCompletions, Protocol::AnthropicMessages] {
        assert_eq!(
            b.build(protocol, "x", "m", 0, &FinishReason::Stop, &usage),
            plain.build(protocol, "x", "m", 0, &FinishReason::Stop, &usage)
        );
    }

    let mut w =
        SseWriter::new(Protocol::Responses, "resp_1", "m", 1700000000).with_reasoning_summary(true);
    let mut frames = w.start();
    for e in &events {
        frames.extend(w.events(std::slice::from_ref(e)));
    }
    frames.extend(w.finish(&FinishReason::Stop, &usage));
    let parsed: Vec<(String, Value)> = frames.iter().map(|f| split(f)).collect();
    let names: Vec<&str> = parsed.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_summary_part.added",
            "response.reasoning_summary_text.delta",
            "response.reasoning_summary_text.delta",
            "response.reasoning_summary_text.done",
            "response.reasoning_summary_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (name, data)) in parsed.iter().enumerate() {
        assert_eq!(data["type"], json!(name));
        assert_eq!(data["sequence_number"], json!(i));
    }
    assert_eq!(
        parsed[2].1["item"],
        json!({"id": "rs_1_0", "type": "reasoning", "summary": []})
    );
    assert_eq!(
        parsed[3].1,
        json!({"type": "response.reasoning_summary_part.added", "item_id": "rs_1_0", "output_index": 0, "summary_index": 0,
            "part": {"type": "summary_text", "text": ""}, "sequence_number": 3})
    );
    assert_eq!(
        parsed[5].1,
        json!({"type": "response.reasoning_summary_text.delta", "item_id": "rs_1_0", "output_index": 0, "summary_index": 0,
            "delta": "me think.", "sequence_number": 5})
    );
    assert_eq!(
        parsed[6].1,
        json!({"type": "response.reasoning_summary_text.done", "item_id": "rs_1_0", "output_index": 0, "summary_index": 0,
            "text": "Let me think.", "sequence_number": 6})
    );
    assert_eq!(
        parsed[7].1["part"],
        json!({"type": "summary_text", "text": "Let me think."})
    );
    assert_eq!(parsed[8].1["item"], body["output"][0]);
    assert_eq!(parsed[15].1["response"], body);
}

#[test]
fn anthropic_sse_sequence() {
    let mut events = reasoning_events();
    events.extend(two_calls_events().into_iter().skip(1));
    let frames = sse(
        Protocol::AnthropicMessages,
        &events,
        &FinishReason::ToolCalls,
        false,
    );
    let parsed: Vec<(String, Value)> = frames.iter().map(|f| split(f)).collect();
    for (name, data) in &parsed {
        assert_eq!(data["type"], json!(name));
    }
    let data: Vec<Value> = parsed.iter().map(|(_, d)| d.clone()).collect();
    assert_eq!(
        data,
        vec![
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 6, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}}}),
            json!({"type": "ping"}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me think."}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": ""}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "The answer is 4."}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "call_0", "name": "get_weather", "input": {}}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": \"Paris\"}"}}),
            json!({"type": "content_block_stop", "index": 2}),
            json!({"type": "content_block_start", "index": 3, "content_block": {"type": "tool_use", "id": "call_1", "name": "get_time", "input": {}}}),
            json!({"type": "content_block_delta", "index": 3, "delta": {"type": "input_json_delta", "partial_json": "{\"tz\": \"CET\"}"}}),
            json!({"type": "content_block_stop", "index": 3}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                "usage": {"input_tokens": 6, "output_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}}),
            json!({"type": "message_stop"}),
        ]
    );
    let frames = sse(
        Protocol::AnthropicMessages,
        &[Text("Hello".into())],
        &FinishReason::StopSequence("END".into()),
        false,
    );
    assert_eq!(
        split(&frames[frames.len() - 2]).1["delta"],
        json!({"stop_reason": "stop_sequence", "stop_sequence": "END"})
    );
    // A thinking block closed by the end of the output gets its signature_delta too.
    let frames = sse(
        Protocol::AnthropicMessages,
        &[Reasoning("Hmm".into())],
        &FinishReason::Length,
        false,
    );
    let data: Vec<Value> = frames.iter().map(|f| split(f).1).collect();
    assert_eq!(
        data[3..6],
        [
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hmm"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": ""}}),
            json!({"type": "content_block_stop", "index": 0}),
        ]
    );
    assert_eq!(data[6]["delta"]["stop_reason"], "max_tokens");
    // Without thinking there is no signature_delta.
    let frames = sse(
        Protocol::AnthropicMessages,
        &[Text("Hello".into())],
        &FinishReason::Stop,
        false,
    );
    assert!(!frames.concat().contains("signature_delta"));
}

/// Streaming a parsed stop-sequence output end to end, each protocol.
#[test]
fn stop_sequence_end_to_end() {
    let mut parser = StreamParser::new(OutputFormat::DeepseekV3, vec!["STOP".into()], false);
    for protocol in [
        Protocol::ChatCompletions,
        Protocol::Responses,
        Protocol::AnthropicMessages,
    ] {
        let mut p = parser.clone();
        let mut w = SseWriter::new(protocol, "x", "m", 0);
        let mut b = ResponseBuilder::new();
        let mut frames = w.start();
        for piece in ["Hello wo", "rld. ST", "OP igno", "red"] {
            let ev = p.push(piece);
            b.extend(&ev);
            frames.extend(w.events(&ev));
        }
        let ev = p.finish();
        b.extend(&ev);
        frames.extend(w.events(&ev));
        let finish = b.finish_reason(false);
        assert_eq!(finish, FinishReason::StopSequence("STOP".into()));
        frames.extend(w.finish(&finish, &Usage::default()));
        assert_eq!(b.text(), "Hello world. ");
        let all = frames.concat();
        assert!(!all.contains("ignored") && !all.contains("STOP i"), "{all}");
    }
    parser.finish();
}

// ---------------------------------------------------------------- properties

fn fragments() -> Vec<&'static str> {
    vec![
        "<think>",
        "</think>",
        "<",
        "</",
        "<th",
        "think>",
        ">",
        "\n",
        " ",
        "```",
        "```json",
        "\n```",
        "json",
        CALLS_BEGIN,
        CALLS_END,
        CALL_BEGIN,
        CALL_END,
        SEP,
        "<｜tool▁call",
        "<｜",
        "｜>",
        "▁",
        "function",
        "<｜DSML｜function_calls>",
        "</｜DSML｜function_calls>",
        "<｜DSML｜tool_calls>",
        "</｜DSML｜tool_calls>",
        "<｜DSML｜invoke name=\"f\">",
        "<｜DSML｜invoke",
        " name=\"g\"",
        "</｜DSML｜invoke>",
        "<｜DSML｜parameter name=\"p\" string=\"true\">",
        "<｜DSML｜parameter name=\"q\" string=\"false\">",
        "<｜DSML｜parameter",
        "</｜DSML｜parameter>",
        "\"",
        "{\"a\": 1}",
        "[1,2]",
        "STOP",
        "ST",
        "OP",
        "é",
        "\\",
        "hello",
        "x",
    ]
}

fn output_text() -> impl Strategy<Value = String> {
    let frag = prop_oneof![
        3 => proptest::sample::select(fragments()).prop_map(|s| s.to_string()),
        1 => "[a-z \n\"{}<>|]{0,6}",
        1 => any::<String>().prop_map(|s| s.chars().take(4).collect::<String>()),
    ];
    proptest::collection::vec(frag, 0..24).prop_map(|v| v.concat())
}

fn forced_forms() -> impl Strategy<Value = ForcedCall> {
    prop_oneof![
        Just(ForcedCall::Arguments { name: "f".into() }),
        Just(ForcedCall::JsonList),
        Just(ForcedCall::Hermes),
    ]
}

fn forced_text() -> impl Strategy<Value = String> {
    let frag = prop_oneof![
        3 => proptest::sample::select(vec![
            "[", "]", ", ", "{", "}", "\"", "\\", "\n", " ", ":",
            "{\"name\": \"f\", \"parameters\": ",
            "{\"name\": \"g\", \"arguments\": ",
            "{\"a\": [1, {\"b\": \"}]\"}]}",
            "\"name\"", "\"parameters\"", "\"arguments\"",
            "<tool_call>", "</tool_call>", "<tool_", "call>", "</",
            "é", "hello",
        ])
        .prop_map(|s| s.to_string()),
        1 => "[a-z \n\"{}<>\\[\\],:]{0,6}",
    ];
    proptest::collection::vec(frag, 0..24).prop_map(|v| v.concat())
}

fn formats() -> impl Strategy<Value = OutputFormat> {
    prop_oneof![
        Just(OutputFormat::Plain),
        Just(OutputFormat::DeepseekV3),
        Just(OutputFormat::DeepseekV4)
    ]
}

/// Splits `s` at the given byte offsets (moved down to char boundaries).
fn split_at_chars(s: &str, cuts: &[usize]) -> Vec<String> {
    let mut cuts: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let mut c = c % (s.len() + 1);
            while !s.is_char_boundary(c) {
                c -= 1;
            }
            c
        })
        .collect();
    cuts.sort();
    let mut out = Vec::new();
    let mut prev = 0;
    for c in cuts {
        out.push(s[prev..c].to_string());
        prev = c;
    }
    out.push(s[prev..].to_string());
    out
}

fn check_invariants(events: &[OutputEvent]) {
    // Starts and ends pair up, in order; Stopped is last.
    let mut open: Option<usize> = None;
    let mut next = 0;
    for (i, e) in events.iter().enumerate() {
        match e {
            ToolCallStart { index, .. } => {
                assert!(open.is_none());
                assert_eq!(*index, next);
                next += 1;
                open = Some(*index);
            }
            ToolCallArguments { index, .. } => assert_eq!(open, Some(*index)),
            ToolCallEnd { index } => {
                assert_eq!(open, Some(*index));
                open = None;
            }
            Stopped { .. } => assert_eq!(i, events.len() - 1),
            Text(s) | Reasoning(s) => assert!(!s.is_empty()),
        }
    }
    assert!(open.is_none(), "unclosed call in {events:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn chunked_equals_one_shot(
        format in formats(),
        text in output_text(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        sir in any::<bool>(),
        use_stop in any::<bool>(),
    ) {
        let stops: &[&str] = if use_stop { &["STOP", "</"] } else { &[] };
        let whole = one_shot(format, stops, sir, &text);
        check_invariants(&whole);
        let chunks = split_at_chars(&text, &cuts);
        let refs: Vec<&str> = chunks.iter().map(|s| s.as_str()).collect();
        prop_assert_eq!(parse_chunks(format, stops, sir, &refs), whole.clone());
        // Byte by byte through push_bytes.
        let mut p = StreamParser::new(format, stops.iter().map(|s| s.to_string()).collect(), sir);
        let mut ev = Vec::new();
        for b in text.as_bytes() {
            ev.extend(p.push_bytes(std::slice::from_ref(b)));
        }
        ev.extend(p.finish());
        prop_assert_eq!(merge_deltas(ev), whole);
    }

    #[test]
    fn forced_calls_chunked_equals_one_shot(
        forced in forced_forms(),
        text in forced_text(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let whole = forced_chunks(forced.clone(), &[], &[&text]);
        check_invariants(&whole);
        let chunks = split_at_chars(&text, &cuts);
        let refs: Vec<&str> = chunks.iter().map(|s| s.as_str()).collect();
        prop_assert_eq!(forced_chunks(forced.clone(), &[], &refs), whole.clone());
        let mut p = StreamParser::new(OutputFormat::Plain, vec![], false).with_forced_call(forced);
        let mut ev = Vec::new();
        for b in text.as_bytes() {
            ev.extend(p.push_bytes(std::slice::from_ref(b)));
        }
        ev.extend(p.finish());
        prop_assert_eq!(merge_deltas(ev), whole);
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        format in formats(),
        text in output_text(),
        noise in proptest::collection::vec(any::<u8>(), 0..16),
        at in any::<usize>(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
        sir in any::<bool>(),
    ) {
        let mut bytes = text.into_bytes();
        let at = at % (bytes.len() + 1);
        bytes.splice(at..at, noise);
        let lossy = String::from_utf8_lossy(&bytes).into_owned();
        let whole = one_shot(format, &["STOP"], sir, &lossy);
        check_invariants(&whole);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort();
        let mut p = StreamParser::new(format, vec!["STOP".into()], sir);
        let mut ev = Vec::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([bytes.len()]) {
            ev.extend(p.push_bytes(&bytes[prev..c]));
            prev = c;
        }
        ev.extend(p.finish());
        prop_assert_eq!(merge_deltas(ev), whole.clone());
        // Every protocol renders it without panicking; the streamed Responses body equals the built one.
        let mut b = ResponseBuilder::new();
        b.extend(&whole);
        let finish = b.finish_reason(false);
        for protocol in [Protocol::ChatCompletions, Protocol::Responses, Protocol::AnthropicMessages] {
            let mut w = SseWriter::new(protocol, "resp_x", "m", 0);
            let mut frames = w.start();
            frames.extend(w.events(&whole));
            frames.extend(w.finish(&finish, &Usage::default()));
            let body = b.build(protocol, "resp_x", "m", 0, &finish, &Usage::default());
            if protocol == Protocol::Responses {
                let (_, last) = split(frames.last().unwrap());
                prop_assert_eq!(&last["response"], &body);
            }
        }
    }
}

fn logprob(token: &str) -> Value {
    json!({"token": token, "logprob": -0.5, "bytes": token.as_bytes(), "top_logprobs": []})
}

#[test]
fn sse_logprobs_ride_with_the_text_they_belong_to() {
    let usage = Usage {
        prompt_tokens: 3,
        completion_tokens: 3,
        cached_prompt_tokens: 0,
        reasoning_tokens: 0,
    };
    // Chat, choice 1 of 2: a step whose text the parser held back writes nothing; its
    // token's entry goes out with the next chunk that carries text, and what is left
    // goes on the finish chunk. This choice does not end the stream.
    let mut w = SseWriter::new(Protocol::ChatCompletions, "c", "m", 0).with_choice(1, false);
    let mut frames = w.start();
    w.add_logprobs(vec![logprob("<")]);
    frames.extend(w.events(&[]));
    w.add_logprobs(vec![logprob("a")]);
    frames.extend(w.events(&[Text("<a".into())]));
    w.add_logprobs(vec![logprob("!")]);
    frames.extend(w.finish(&FinishReason::Stop, &usage));
    let chunks: Vec<Value> = frames.iter().map(|f| split(f).1).collect();
    assert_eq!(chunks.len(), 3, "{frames:?}"); // role, text, finish: no usage, no [DONE]
    assert!(chunks.iter().all(|c| c["choices"][0]["index"] == json!(1)));
    assert_eq!(chunks[0]["choices"][0]["logprobs"], Value::Null);
    assert_eq!(
        chunks[1]["choices"][0]["logprobs"]["content"],
        json!([logprob("<"), logprob("a")])
    );
    assert_eq!(
        chunks[2]["choices"][0]["logprobs"]["content"],
        json!([logprob("!")])
    );

    // Responses: reasoning carries none; the first text delta takes what is pending,
    // the final response's output_text part has every entry.
    let mut w = SseWriter::new(Protocol::Responses, "r", "m", 0);
    let mut frames = w.start();
    w.add_logprobs(vec![logprob("think")]);
    frames.extend(w.events(&[Reasoning("think".into())]));
    w.add_logprobs(vec![logprob("a")]);
    frames.extend(w.events(&[Text("a".into())]));
    w.add_logprobs(vec![logprob("b")]);
    frames.extend(w.finish(&FinishReason::Stop, &usage));
    let events: Vec<(String, Value)> = frames.iter().map(|f| split(f)).collect();
    let delta = events
        .iter()
        .find(|(e, _)| e == "response.output_text.delta")
        .unwrap();
    assert_eq!(delta.1["logprobs"], json!([logprob("think"), logprob("a")]));
    let (_, completed) = events.last().unwrap();
    let part = &completed["response"]["output"][1]["content"][0];
    assert_eq!(
        part["logprobs"],
        json!([logprob("think"), logprob("a"), logprob("b")])
    );
}
