//! Protocol parsing: the same conversation from all three protocols compares equal;
//! bad bodies fail with the exact path; nothing panics.

use powertrain_recipe::error::ErrorKind;
use powertrain_recipe::protocols::{parse_request, parse_value};
use powertrain_recipe::render::{render_deepseek_v4, render_v4_family, Version};
use powertrain_recipe::*;
use serde_json::{json, Value};

const CHAT: Protocol = Protocol::ChatCompletions;
const RESP: Protocol = Protocol::Responses;
const ANTH: Protocol = Protocol::AnthropicMessages;

fn ok(protocol: Protocol, body: &Value) -> EngineRequest {
    match parse_value(protocol, body) {
        Ok(r) => r,
        Err(e) => panic!("{protocol:?} rejected {body}: {e:?}"),
    }
}

/// Parses the three forms, asserts equal conversations and shared sampling settings.
fn same(chat: Value, responses: Value, anthropic: Value) -> Conversation {
    let c = ok(CHAT, &chat);
    let r = ok(RESP, &responses);
    let a = ok(ANTH, &anthropic);
    assert_eq!(c.conversation, r.conversation, "chat vs responses");
    assert_eq!(c.conversation, a.conversation, "chat vs anthropic");
    for (name, other) in [("responses", &r), ("anthropic", &a)] {
        assert_eq!(
            c.sampling.temperature, other.sampling.temperature,
            "temperature vs {name}"
        );
        assert_eq!(c.sampling.top_p, other.sampling.top_p, "top_p vs {name}");
        assert_eq!(
            c.sampling.max_tokens, other.sampling.max_tokens,
            "max_tokens vs {name}"
        );
        assert_eq!(c.stream, other.stream, "stream vs {name}");
        assert_eq!(c.model, other.model, "model vs {name}");
    }
    c.conversation
}

fn weather_tools_chat() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "description": "Local time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}])
}
fn weather_tools_responses() -> Value {
    json!([{"type": "function", "name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"type": "function", "name": "get_time", "description": "Local time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}])
}
fn weather_tools_anthropic() -> Value {
    json!([{"name": "get_weather", "description": "Current weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"name": "get_time", "description": "Local time",
        "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}])
}

// ---------------------------------------------------------------------------
// Cross-protocol equality.

#[test]
fn conv01_single_user_message() {
    let conv = same(
        json!({"model": "m", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64, "temperature": 0.5, "top_p": 0.9}),
        json!({"model": "m", "input": "Hello!", "max_output_tokens": 64, "temperature": 0.5, "top_p": 0.9}),
        json!({"model": "m", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64, "temperature": 0.5, "top_p": 0.9}),
    );
    assert_eq!(conv.messages, vec![Message::text(Role::User, "Hello!")]);
    assert_eq!(conv.tool_choice, ToolChoice::Auto);
}

#[test]
fn conv02_system_prompt() {
    let conv = same(
        json!({"model": "m", "max_tokens": 10, "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        json!({"model": "m", "max_output_tokens": 10, "instructions": "You are terse.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}),
        json!({"model": "m", "max_tokens": 10, "system": "You are terse.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    );
    assert_eq!(
        conv.messages[0],
        Message::text(Role::System, "You are terse.")
    );
}

#[test]
fn conv03_system_in_parts_joined_the_same_way() {
    let conv = same(
        json!({"model": "m", "max_tokens": 10, "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be kind. "}, {"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi"}]}),
        json!({"model": "m", "max_output_tokens": 10, "input": [
            {"role": "system", "content": [{"type": "input_text", "text": "Be kind. "}, {"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi"}]}),
        json!({"model": "m", "max_tokens": 10,
            "system": [{"type": "text", "text": "Be kind. "}, {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Hi"}]}),
    );
    // The parts stay apart: each encoder joins them its own way.
    assert_eq!(
        conv.messages[0].content,
        vec![
            ContentPart::Text {
                text: "Be kind. ".into()
            },
            ContentPart::Text {
                text: "Be brief.".into()
            }
        ]
    );
    assert_eq!(conv.messages[0].joined_text(), "Be kind. Be brief.");
}

#[test]
fn conv04_multi_turn() {
    let conv = same(
        json!({"model": "m", "max_tokens": 100, "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"}]}),
        json!({"model": "m", "max_output_tokens": 100, "instructions": "sys", "input": [
            {"role": "user", "content": "What is 2+2?"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "4.", "annotations": []}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And 3+3?"}]}]}),
        json!({"model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "sys"}], "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": [{"type": "text", "text": "4."}]},
            {"role": "user", "content": "And 3+3?"}]}),
    );
    assert_eq!(conv.messages.len(), 4);
    assert_eq!(conv.messages[2], Message::text(Role::Assistant, "4."));
}

#[test]
fn conv05_single_tool_call_round_trip() {
    let conv = same(
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_chat(), "tool_choice": "auto", "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{ \"city\" : \"Paris\" }"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
            {"role": "assistant", "content": "It is 18C and sunny."}]}),
        json!({"model": "m", "max_output_tokens": 50, "tools": weather_tools_responses(), "tool_choice": "auto", "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"},
            {"role": "assistant", "content": "It is 18C and sunny."}]}),
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_anthropic(), "tool_choice": {"type": "auto"}, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "18C, sunny"}]},
            {"role": "assistant", "content": "It is 18C and sunny."}]}),
    );
    let call = &conv.messages[1];
    assert_eq!(call.content, vec![]);
    assert_eq!(
        call.tool_calls,
        vec![ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: "{\"city\":\"Paris\"}".into()
        }]
    );
    let result = &conv.messages[2];
    assert_eq!(result.role, Role::Tool);
    assert_eq!(result.name.as_deref(), Some("get_weather"));
    assert_eq!(result.tool_call_id.as_deref(), Some("call_1"));
    assert_eq!(conv.tools.len(), 2);
}

#[test]
fn one_tool_call_at_most_is_carried_with_a_forced_choice_and_refused_under_auto() {
    let user = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let conv = same(
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_chat(), "messages": user,
            "tool_choice": "required", "parallel_tool_calls": false}),
        json!({"model": "m", "max_output_tokens": 50, "tools": weather_tools_responses(), "input": user,
            "tool_choice": "required", "parallel_tool_calls": false}),
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_anthropic(), "messages": user,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true}}),
    );
    assert!(conv.single_tool_call && conv.tool_choice == ToolChoice::Required);
    let named = ok(
        ANTH,
        &json!({"model": "m", "max_tokens": 50, "tools": weather_tools_anthropic(),
        "messages": user, "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": true}}),
    );
    assert!(named.conversation.single_tool_call);
    let parallel = ok(
        CHAT,
        &json!({"model": "m", "tools": weather_tools_chat(), "messages": user,
        "tool_choice": "required", "parallel_tool_calls": true}),
    );
    assert!(!parallel.conversation.single_tool_call);
    for (protocol, body, path) in [
        (
            CHAT,
            json!({"model": "m", "tools": weather_tools_chat(), "messages": user,
            "parallel_tool_calls": false}),
            "parallel_tool_calls",
        ),
        (
            RESP,
            json!({"model": "m", "tools": weather_tools_responses(), "input": user,
            "tool_choice": "auto", "parallel_tool_calls": false}),
            "parallel_tool_calls",
        ),
        (
            ANTH,
            json!({"model": "m", "max_tokens": 50, "tools": weather_tools_anthropic(), "messages": user,
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
            "tool_choice.disable_parallel_tool_use",
        ),
    ] {
        let e = parse_value(protocol, &body).unwrap_err();
        assert_eq!((e.path.as_str(), e.status()), (path, 400), "{}", e.message);
        assert!(e.message.contains("required"), "{}", e.message);
    }
    // Without tools there is nothing to limit.
    ok(
        CHAT,
        &json!({"model": "m", "messages": user, "parallel_tool_calls": false}),
    );
}

#[test]
fn conv06_parallel_tool_calls() {
    let conv = same(
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_chat(), "messages": [
            {"role": "user", "content": "Weather and time in Paris and Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
                {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "18C"},
            {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "25C"}]},
            {"role": "tool", "tool_call_id": "c", "content": "14:00"},
            {"role": "assistant", "content": "Paris 18C, Rome 25C, 14:00."}]}),
        json!({"model": "m", "max_output_tokens": 50, "tools": weather_tools_responses(), "input": [
            {"role": "user", "content": "Weather and time in Paris and Rome?"},
            {"type": "function_call", "id": "fc_1", "call_id": "a", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
            {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
            {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{\"tz\":\"CET\"}"},
            {"type": "function_call_output", "call_id": "a", "output": "18C"},
            {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "25C"}]},
            {"type": "function_call_output", "call_id": "c", "output": "14:00"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris 18C, Rome 25C, 14:00."}]}]}),
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_anthropic(), "messages": [
            {"role": "user", "content": "Weather and time in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "a", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "b", "name": "get_weather", "input": {"city": "Rome"}},
                {"type": "tool_use", "id": "c", "name": "get_time", "input": {"tz": "CET"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "a", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "25C"}]},
                {"type": "tool_result", "tool_use_id": "c", "content": "14:00", "is_error": false}]},
            {"role": "assistant", "content": "Paris 18C, Rome 25C, 14:00."}]}),
    );
    assert_eq!(conv.messages.len(), 6);
    assert_eq!(conv.messages[1].tool_calls.len(), 3);
    let names: Vec<_> = conv.messages[2..5]
        .iter()
        .map(|m| m.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(names, ["get_weather", "get_weather", "get_time"]);
}

#[test]
fn conv07_text_and_tool_call_in_one_assistant_turn() {
    let conv = same(
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_chat(), "tool_choice": "required", "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\",\"units\":{\"c\":true}}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "-3C"}]}),
        json!({"model": "m", "max_output_tokens": 50, "tools": weather_tools_responses(), "tool_choice": "required", "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
            {"type": "function_call", "call_id": "t1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"units\": {\"c\": true}}"},
            {"type": "function_call_output", "call_id": "t1", "output": "-3C"}]}),
        json!({"model": "m", "max_tokens": 50, "tools": weather_tools_anthropic(), "tool_choice": {"type": "any"}, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo", "units": {"c": true}}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "-3C"}]}]}]}),
    );
    assert_eq!(conv.tool_choice, ToolChoice::Required);
    assert_eq!(conv.messages[1].joined_text(), "Let me check.");
    assert_eq!(
        conv.messages[1].tool_calls[0].arguments,
        "{\"city\":\"Oslo\",\"units\":{\"c\":true}}"
    );
    assert_eq!(conv.messages.len(), 3);
}

#[test]
fn conv08_reasoning_history() {
    let conv = same(
        json!({"model": "m", "max_tokens": 500, "messages": [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "reasoning_content": "91 = 7 * 13.", "content": "No, 91 = 7 x 13."},
            {"role": "user", "content": "And 97?"}]}),
        json!({"model": "m", "max_output_tokens": 500, "input": [
            {"role": "user", "content": "Is 91 prime?"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "91 = 7 * 13."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "No, 91 = 7 x 13."}]},
            {"role": "user", "content": "And 97?"}]}),
        json!({"model": "m", "max_tokens": 500, "messages": [
            {"role": "user", "content": "Is 91 prime?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "91 = 7 * 13.", "signature": "sig"},
                {"type": "text", "text": "No, 91 = 7 x 13."}]},
            {"role": "user", "content": "And 97?"}]}),
    );
    assert_eq!(conv.messages[1].reasoning.as_deref(), Some("91 = 7 * 13."));
}

#[test]
fn conv09_reasoning_with_tool_calls_across_turns() {
    let conv = same(
        json!({"model": "m", "max_tokens": 500, "tools": weather_tools_chat(), "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Lima?"},
            {"role": "assistant", "reasoning_content": "Need the tool.", "tool_calls": [
                {"id": "w", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Lima\"}"}}]},
            {"role": "tool", "tool_call_id": "w", "content": "20C"},
            {"role": "assistant", "reasoning_content": "Got it.", "content": "20C in Lima."}]}),
        json!({"model": "m", "max_output_tokens": 500, "tools": weather_tools_responses(), "instructions": "Use tools.", "input": [
            {"role": "user", "content": "Weather in Lima?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
            {"type": "function_call", "call_id": "w", "name": "get_weather", "arguments": "{\"city\":\"Lima\"}"},
            {"type": "function_call_output", "call_id": "w", "output": "20C"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Got it."}]},
            {"role": "assistant", "content": "20C in Lima."}]}),
        json!({"model": "m", "max_tokens": 500, "tools": weather_tools_anthropic(), "system": "Use tools.", "messages": [
            {"role": "user", "content": "Weather in Lima?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need the tool.", "signature": "s"},
                {"type": "tool_use", "id": "w", "name": "get_weather", "input": {"city": "Lima"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "w", "content": "20C"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Got it.", "signature": "s"},
                {"type": "text", "text": "20C in Lima."}]}]}),
    );
    assert_eq!(
        conv.messages[2].reasoning.as_deref(),
        Some("Need the tool.")
    );
    assert_eq!(conv.messages[2].content, vec![]);
    assert_eq!(conv.messages[4].reasoning.as_deref(), Some("Got it."));
}

/// A 1x1 PNG, and a 2x3 GIF.
const PNG_1X1: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
const GIF_2X3: &str = "R0lGODlhAgADAIAAAP///wAAACwAAAAAAgADAAACAoRRADs=";

#[test]
fn conv10_remote_image_urls_are_refused_in_every_protocol() {
    let url = "https://example.com/cat.png";
    for (protocol, body, path) in [
        (
            CHAT,
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}]}]}),
            "messages[0].content[1].image_url.url",
        ),
        (
            RESP,
            json!({"model": "m", "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": url, "detail": "auto"}]}]}),
            "input[0].content[1].image_url",
        ),
        (
            ANTH,
            json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "url", "url": url}}]}]}),
            "messages[0].content[1].source.url",
        ),
    ] {
        let e = parse_value(protocol, &body).unwrap_err();
        assert_eq!((e.kind, e.path.as_str(), e.status()), (Uns, path, 400));
        assert!(e.message.contains("data URL"), "{}", e.message);
    }
}

#[test]
fn conv11_image_base64() {
    for (media, data, size) in [
        ("image/png", PNG_1X1, (1, 1)),
        ("image/gif", GIF_2X3, (2, 3)),
    ] {
        let data_url = format!("data:{media};base64,{data}");
        let conv = same(
            json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "Describe."}]}]}),
            json!({"model": "m", "max_output_tokens": 20, "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": data_url}, {"type": "input_text", "text": "Describe."}]}]}),
            json!({"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}},
                {"type": "text", "text": "Describe."}]}]}),
        );
        assert_eq!(
            conv.messages[0].content[0],
            ContentPart::Image {
                url: data_url.clone(),
                width: size.0,
                height: size.1,
                detail: powertrain_recipe::image_fit::ImageDetail::High,
                source: Default::default(),
            }
        );
        assert_eq!(
            ok(
                CHAT,
                &json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url}}]}]})
            )
            .images,
            1
        );
    }
}

#[test]
fn bad_images_are_400s_naming_the_part() {
    let chat = |url: String| {
        json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]})
    };
    let path = "messages[0].content[0].image_url.url";
    for (url, needle) in [
        ("data:image/png;base64,%%%%".to_string(), "base64"),
        ("data:image/png;base64,".to_string(), "empty"),
        (
            format!("data:image/jpeg;base64,{PNG_1X1}"),
            "not a valid image/jpeg",
        ),
        (format!("data:image/tiff;base64,{PNG_1X1}"), "media type"),
        (
            "data:image/png;base64,iVBORw0KGgo=".to_string(),
            "not a valid image/png",
        ),
        (format!("data:image/png,{PNG_1X1}"), "base64-encoded"),
        ("ftp://x/y.png".to_string(), "data URL"),
        (
            format!("data:image/png;base64,{}", "A".repeat(30 * 1024 * 1024)),
            "larger than",
        ),
    ] {
        let e = parse_value(CHAT, &chat(url)).unwrap_err();
        assert_eq!((e.path.as_str(), e.status()), (path, 400), "{}", e.message);
        assert!(e.message.contains(needle), "{needle}: {}", e.message);
    }
    let many: Vec<Value> = (0..33)
        .map(|_| json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{PNG_1X1}")}}))
        .collect();
    let e = parse_value(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": many}]}),
    )
    .unwrap_err();
    assert!(e.message.contains("at most 32"), "{}", e.message);
}

/// A PNG of ``width x height`` as far as its header goes (all the parser reads).
fn png_header_url(width: u32, height: u32) -> String {
    use base64::Engine;
    let mut bytes = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
    bytes.extend(width.to_be_bytes());
    bytes.extend(height.to_be_bytes());
    bytes.extend([8, 2, 0, 0, 0, 0, 0, 0, 0]);
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

#[test]
fn images_are_fitted_as_v41_preprocesses_them() {
    let image = |w: u32, h: u32, detail: &str| json!({"type": "image_url", "image_url": {"url": png_header_url(w, h), "detail": detail}});
    let request = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": [
            image(2000, 1000, "high"), image(2000, 1000, "low"), image(10, 10, "auto")]}]}),
    );
    let tokens: Vec<usize> = request.image_fits.iter().map(|f| f.tokens).collect();
    // The low-detail copy is shrunk to 512 px first; a tiny image is scaled up to 544x544.
    assert_eq!(request.images, 3);
    assert!(tokens[1] < tokens[0], "{tokens:?}");
    assert_eq!(tokens[2], 13 * 14 + 2);

    let e = parse_value(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": [image(4, 4, "medium")]}]}),
    )
    .unwrap_err();
    assert_eq!(e.path, "messages[0].content[0].image_url.detail");

    // 8192 px a side is the limit, 4096 once a request carries 15 images or more.
    let e = parse_value(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": [image(8193, 4, "high")]}]}),
    )
    .unwrap_err();
    assert!(e.message.contains("8192"), "{}", e.message);
    let mut many: Vec<Value> = (0..14).map(|_| image(5000, 4, "high")).collect();
    assert_eq!(
        ok(
            CHAT,
            &json!({"model": "m", "messages": [{"role": "user", "content": many.clone()}]})
        )
        .images,
        14
    );
    many.push(image(4, 4, "high"));
    let e = parse_value(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": many}]}),
    )
    .unwrap_err();
    assert!(
        e.message.contains("image 1 of 15") && e.message.contains("4096"),
        "{}",
        e.message
    );
}

#[test]
fn conv12_tool_result_then_user_text_in_one_anthropic_turn() {
    let conv = same(
        json!({"model": "m", "max_tokens": 20, "tools": weather_tools_chat(), "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "x", "content": "09:00"},
            {"role": "user", "content": "Thanks, and tomorrow?"}]}),
        json!({"model": "m", "max_output_tokens": 20, "tools": weather_tools_responses(), "input": [
            {"role": "user", "content": "Time?"},
            {"type": "function_call", "call_id": "x", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "x", "output": "09:00"},
            {"role": "user", "content": "Thanks, and tomorrow?"}]}),
        json!({"model": "m", "max_tokens": 20, "tools": weather_tools_anthropic(), "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "get_time", "input": {}}]},
            // the text block comes first on the wire; the tool result still goes first.
            {"role": "user", "content": [{"type": "text", "text": "Thanks, and tomorrow?"},
                {"type": "tool_result", "tool_use_id": "x", "content": "09:00"}]}]}),
    );
    let roles: Vec<Role> = conv.messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool, Role::User]);
}

#[test]
fn conv13_named_tool_choice_and_sampling() {
    let conv = same(
        json!({"model": "big", "max_tokens": 300, "temperature": 0.2, "top_p": 0.5, "stream": true,
            "tools": weather_tools_chat(), "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "messages": [{"role": "user", "content": "Time in Tokyo"}]}),
        json!({"model": "big", "max_output_tokens": 300, "temperature": 0.2, "top_p": 0.5, "stream": true,
            "tools": weather_tools_responses(), "tool_choice": {"type": "function", "name": "get_time"},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Time in Tokyo"}]}]}),
        json!({"model": "big", "max_tokens": 300, "temperature": 0.2, "top_p": 0.5, "stream": true,
            "tools": weather_tools_anthropic(), "tool_choice": {"type": "tool", "name": "get_time"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Time in Tokyo"}]}]}),
    );
    assert_eq!(conv.tool_choice, ToolChoice::Named("get_time".into()));
}

#[test]
fn a_named_tool_choice_of_an_undeclared_tool_names_it_and_the_declared_ones() {
    let bodies = [
        (
            CHAT,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                "tools": weather_tools_chat(), "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}),
            "tool_choice.function.name",
        ),
        (
            Protocol::Responses,
            json!({"model": "m", "input": "x",
                "tools": weather_tools_responses(), "tool_choice": {"type": "function", "name": "get_wether"}}),
            "tool_choice.name",
        ),
        (
            Protocol::AnthropicMessages,
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                "tools": weather_tools_anthropic(), "tool_choice": {"type": "tool", "name": "get_wether"}}),
            "tool_choice.name",
        ),
    ];
    for (protocol, body, path) in bodies {
        let e = parse_value(protocol, &body).expect_err("an undeclared tool is refused");
        assert_eq!((e.kind, e.path.as_str()), (Inv, path), "{protocol:?}");
        assert!(
            e.message.contains("\"get_wether\"")
                && e.message.contains("\"get_weather\", \"get_time\""),
            "{protocol:?}: {}",
            e.message
        );
    }
}

#[test]
fn conv14_thinking_settings_chat_and_anthropic() {
    let c = ok(
        CHAT,
        &json!({"model": "m", "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    let a = ok(
        ANTH,
        &json!({"model": "m", "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(c.conversation, a.conversation);
    assert_eq!(
        a.conversation.thinking,
        Thinking {
            enabled: Some(true),
            effort: None,
            budget_tokens: Some(2048),
            adaptive: false,
        }
    );

    let off = ok(
        CHAT,
        &json!({"model": "m", "chat_template_kwargs": {"thinking": false}, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(off.conversation.thinking.enabled, Some(false));
    let off_a = ok(
        ANTH,
        &json!({"model": "m", "max_tokens": 5, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(off_a.conversation.thinking.enabled, Some(false));

    let effort_c = ok(
        CHAT,
        &json!({"model": "m", "reasoning_effort": "high", "messages": [{"role": "user", "content": "hi"}]}),
    );
    let effort_r = ok(
        RESP,
        &json!({"model": "m", "reasoning": {"effort": "high", "summary": "auto"}, "input": "hi"}),
    );
    assert_eq!(effort_c.conversation, effort_r.conversation);
    assert_eq!(
        effort_c.conversation.thinking.effort,
        Some(ReasoningEffort::High)
    );
}

#[test]
fn developer_role_chat_and_responses() {
    let c = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}]}),
    );
    let r = ok(
        RESP,
        &json!({"model": "m", "input": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}]}),
    );
    assert_eq!(c.conversation, r.conversation);
    assert_eq!(c.conversation.messages[0].role, Role::Developer);
}

#[test]
fn response_formats_chat_and_responses() {
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let c = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": true}}}),
    );
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x",
        "text": {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": true}}}),
    );
    let expected = ResponseFormat::JsonSchema {
        name: "thing".into(),
        schema: schema.clone(),
        strict: true,
    };
    assert_eq!(c.response_format, expected);
    assert_eq!(r.response_format, expected);

    let c = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}),
    );
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}),
    );
    assert_eq!(c.response_format, ResponseFormat::JsonObject);
    assert_eq!(r.response_format, ResponseFormat::JsonObject);
    let c = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}}),
    );
    assert_eq!(c.response_format, ResponseFormat::Text);
}

#[test]
fn chat_sampling_fields() {
    let r = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "temperature": 0, "top_p": 1, "max_completion_tokens": 7, "stop": "END", "seed": 42, "n": 3,
        "logprobs": true, "top_logprobs": 5, "presence_penalty": 0.5, "frequency_penalty": -1,
        "metadata": {"k": "v"}, "user": "u1",
        "parallel_tool_calls": true, "store": false, "modalities": ["text"], "logit_bias": {}}),
    );
    let s = &r.sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.max_tokens, s.seed, s.n),
        (Some(0.0), Some(1.0), Some(7), Some(42), 3)
    );
    assert_eq!(s.stop, vec!["END".to_string()]);
    assert!(s.logprobs);
    assert_eq!(s.top_logprobs, Some(5));
    assert_eq!(
        (s.presence_penalty, s.frequency_penalty),
        (Some(0.5), Some(-1.0))
    );
    assert!(!r.stream && !r.include_usage);
    assert_eq!(r.metadata.get("k"), Some(&json!("v")));
    assert_eq!(r.user.as_deref(), Some("u1"));
    let r = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "stream": true, "stream_options": {"include_usage": true}, "n": 1, "logprobs": false}),
    );
    assert!(r.stream && r.include_usage);
    assert_eq!((r.sampling.n, r.sampling.logprobs), (1, false));
}

#[test]
fn chat_vllm_sampling_fields() {
    let r = ok(
        CHAT,
        &chat_with(
            json!({"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "max_tokens": 9,
        "min_tokens": 3, "ignore_eos": true, "stop_token_ids": [7, 8],
        "include_stop_str_in_output": true, "skip_special_tokens": false}),
        ),
    );
    let s = &r.sampling;
    assert_eq!(
        (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens),
        (Some(5), Some(0.1), Some(1.2), Some(3))
    );
    assert!(s.ignore_eos && s.include_stop_str_in_output && !s.skip_special_tokens);
    assert_eq!(s.stop_token_ids, vec![7, 8]);
    let biased = ok(
        CHAT,
        &chat_with(json!({"logit_bias": {"50256": -100, "7": 2.5}})),
    );
    let mut pairs = biased.sampling.logit_bias.clone();
    pairs.sort_by_key(|p| p.0);
    assert_eq!(pairs, vec![(7, 2.5), (50256, -100.0)]);
    let off = ok(CHAT, &chat_with(json!({"top_k": -1})));
    assert_eq!(off.sampling.top_k, Some(0));
    let absent = ok(CHAT, &chat_with(json!({})));
    assert!(!absent.sampling.ignore_eos && absent.sampling.stop_token_ids.is_empty());
    assert!(absent.sampling.skip_special_tokens); // vLLM's default
    let r = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b"]}),
    );
    assert_eq!(r.sampling.stop, vec!["a".to_string(), "b".to_string()]);
}

#[test]
fn anthropic_sampling_fields() {
    let r = ok(
        ANTH,
        &json!({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
        "top_k": 40, "stop_sequences": ["\n\nHuman:"], "metadata": {"user_id": "abc"}}),
    );
    assert_eq!(r.sampling.top_k, Some(40));
    assert_eq!(r.sampling.stop, vec!["\n\nHuman:".to_string()]);
    assert_eq!(r.user.as_deref(), Some("abc"));
    assert!(r.include_usage);
}

#[test]
fn null_optional_fields_are_absent() {
    let r = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "tool_calls": null, "reasoning_content": null}],
        "temperature": null, "tools": null, "stop": null}),
    );
    assert_eq!(r.sampling.temperature, None);
    assert_eq!(
        r.conversation.messages[1],
        Message::text(Role::Assistant, "y")
    );
}

// ---------------------------------------------------------------------------
// Errors: kind and exact path.

use ErrorKind::{InvalidRequest as Inv, Unsupported as Uns};

fn check_errors(protocol: Protocol, cases: Vec<(Value, ErrorKind, &str)>) {
    for (body, kind, path) in cases {
        match parse_value(protocol, &body) {
            Ok(_) => panic!("{protocol:?} accepted {body}"),
            Err(e) => {
                assert_eq!(
                    (e.kind, e.path.as_str()),
                    (kind, path),
                    "{protocol:?} {body}: {}",
                    e.describe()
                );
            }
        }
    }
}

fn chat_with(extra: Value) -> Value {
    let mut base = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    base
}

#[test]
fn chat_errors() {
    let call = |args: &str| json!({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]});
    check_errors(
        CHAT,
        vec![
            (json!([1]), Inv, ""),
            (
                json!({"messages": [{"role": "user", "content": "x"}]}),
                Inv,
                "model",
            ),
            (json!({"model": "m"}), Inv, "messages"),
            (json!({"model": "m", "messages": []}), Inv, "messages"),
            (json!({"model": "m", "messages": {}}), Inv, "messages"),
            (chat_with(json!({"bogus": 1})), Inv, "bogus"),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}]}),
                Inv,
                "messages[1].role",
            ),
            (
                json!({"model": "m", "messages": [{"content": "x"}]}),
                Inv,
                "messages[0].role",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x", "extra": 1}]}),
                Inv,
                "messages[0].extra",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": 5}]}),
                Inv,
                "messages[0].content",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"},
            {"role": "user", "content": [{"type": "video", "url": "u"}]}]}),
                Inv,
                "messages[2].content[0].type",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
                Inv,
                "messages[0].content[0].text",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}),
                Uns,
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "m", "messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
                Inv,
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "m", "messages": [{"role": "tool", "tool_call_id": "nope", "content": "r"}]}),
                Inv,
                "messages[0].tool_call_id",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, call("{bad json")]}),
                Inv,
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, call("")]}),
                Inv,
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bad name", "arguments": "{}"}}]}]}),
                Inv,
                "messages[0].tool_calls[0].function.name",
            ),
            (chat_with(json!({"temperature": 2.5})), Inv, "temperature"),
            (chat_with(json!({"temperature": -0.1})), Inv, "temperature"),
            (chat_with(json!({"temperature": "hot"})), Inv, "temperature"),
            (chat_with(json!({"top_p": 0})), Inv, "top_p"),
            (chat_with(json!({"top_p": 1.01})), Inv, "top_p"),
            (chat_with(json!({"max_tokens": 0})), Inv, "max_tokens"),
            (
                chat_with(json!({"max_completion_tokens": -1})),
                Inv,
                "max_completion_tokens",
            ),
            (chat_with(json!({"max_tokens": 1.5})), Inv, "max_tokens"),
            (chat_with(json!({"n": 0})), Inv, "n"),
            (
                chat_with(json!({"logprobs": true, "top_logprobs": 21})),
                Inv,
                "top_logprobs",
            ),
            (chat_with(json!({"top_logprobs": 2})), Inv, "top_logprobs"),
            (chat_with(json!({"stop": [1]})), Inv, "stop[0]"),
            (chat_with(json!({"top_k": -2})), Inv, "top_k"),
            (chat_with(json!({"logit_bias": []})), Inv, "logit_bias"),
            (
                chat_with(json!({"logit_bias": {"abc": 1}})),
                Inv,
                "logit_bias.abc",
            ),
            (
                chat_with(json!({"logit_bias": {"5": 101}})),
                Inv,
                "logit_bias.5",
            ),
            (
                chat_with(json!({"logit_bias": {"5": "1"}})),
                Inv,
                "logit_bias.5",
            ),
            (chat_with(json!({"top_k": "5"})), Inv, "top_k"),
            (chat_with(json!({"min_p": 1.5})), Inv, "min_p"),
            (
                chat_with(json!({"repetition_penalty": 0})),
                Inv,
                "repetition_penalty",
            ),
            (
                chat_with(json!({"max_tokens": 2, "min_tokens": 3})),
                Inv,
                "min_tokens",
            ),
            (chat_with(json!({"ignore_eos": "yes"})), Inv, "ignore_eos"),
            (
                chat_with(json!({"stop_token_ids": [1, -1]})),
                Inv,
                "stop_token_ids[1]",
            ),
            (
                chat_with(json!({"include_stop_str_in_output": 1})),
                Inv,
                "include_stop_str_in_output",
            ),
            (
                chat_with(json!({"skip_special_tokens": "no"})),
                Inv,
                "skip_special_tokens",
            ),
            (
                chat_with(json!({"stream_options": {"include_usage": true}})),
                Inv,
                "stream_options",
            ),
            (
                chat_with(json!({"tools": [{"type": "function", "function": {"name": ""}}]})),
                Inv,
                "tools[0].function.name",
            ),
            (
                chat_with(
                    json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
                ),
                Inv,
                "tools[0].function.parameters",
            ),
            (
                chat_with(
                    json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}),
                ),
                Inv,
                "tools[1].function.name",
            ),
            (
                chat_with(json!({"tools": [{"type": "retrieval"}]})),
                Inv,
                "tools[0].type",
            ),
            (
                chat_with(
                    json!({"tool_choice": {"type": "function", "function": {"name": "missing"}}}),
                ),
                Inv,
                "tool_choice.function.name",
            ),
            (
                chat_with(json!({"tool_choice": "required"})),
                Inv,
                "tool_choice",
            ),
            (
                chat_with(json!({"tool_choice": "sometimes"})),
                Inv,
                "tool_choice",
            ),
            (
                chat_with(json!({"response_format": {"type": "yaml"}})),
                Inv,
                "response_format.type",
            ),
            (
                chat_with(
                    json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}),
                ),
                Inv,
                "response_format.json_schema.schema",
            ),
            (
                chat_with(json!({"audio": {"voice": "alloy"}})),
                Uns,
                "audio",
            ),
            (
                chat_with(json!({"modalities": ["text", "audio"]})),
                Uns,
                "modalities[1]",
            ),
            (
                chat_with(json!({"prediction": {"type": "content", "content": "x"}})),
                Uns,
                "prediction",
            ),
            (
                chat_with(json!({"web_search_options": {}})),
                Uns,
                "web_search_options",
            ),
            (chat_with(json!({"store": true})), Uns, "store"),
            (
                chat_with(json!({"thinking": {"type": "maybe"}})),
                Inv,
                "thinking.type",
            ),
            (
                chat_with(
                    json!({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": false}}),
                ),
                Inv,
                "chat_template_kwargs.thinking",
            ),
            (
                chat_with(json!({"chat_template_kwargs": {"foo": 1}})),
                Inv,
                "chat_template_kwargs.foo",
            ),
            (
                chat_with(json!({"reasoning_effort": "extreme"})),
                Inv,
                "reasoning_effort",
            ),
            (chat_with(json!({"metadata": {"k": 1}})), Inv, "metadata.k"),
        ],
    );
}

#[test]
fn responses_errors() {
    let base = |input: Value| json!({"model": "m", "input": input});
    let with = |extra: Value| {
        let mut b = json!({"model": "m", "input": "x"});
        if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        b
    };
    check_errors(
        RESP,
        vec![
            (json!("x"), Inv, ""),
            (json!({"input": "x"}), Inv, "model"),
            (json!({"model": "m"}), Inv, "input"),
            (base(json!([])), Inv, "input"),
            (base(json!(3)), Inv, "input"),
            (with(json!({"foo": 1})), Inv, "foo"),
            (
                base(
                    json!([{"role": "user", "content": "x"}, {"type": "function_call", "name": "f", "arguments": "{}"}]),
                ),
                Inv,
                "input[1].call_id",
            ),
            (
                base(
                    json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]),
                ),
                Inv,
                "input[0].arguments",
            ),
            (
                base(json!([{"type": "function_call_output", "call_id": "c", "output": "r"}])),
                Inv,
                "input[0].call_id",
            ),
            (base(json!([{"type": "telepathy"}])), Inv, "input[0].type"),
            (
                base(json!([{"type": "web_search_call", "id": "w"}])),
                Uns,
                "input[0].type",
            ),
            (
                base(json!([{"role": "robot", "content": "x"}])),
                Inv,
                "input[0].role",
            ),
            (
                base(
                    json!([{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_video"}]}]),
                ),
                Inv,
                "input[0].content[1].type",
            ),
            (
                base(
                    json!([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
                ),
                Uns,
                "input[0].content[0].type",
            ),
            (
                base(
                    json!([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
                ),
                Uns,
                "input[0].content[0].file_id",
            ),
            (
                base(json!([{"type": "reasoning", "summary": [], "encrypted_content": "xx"}])),
                Uns,
                "input[0].encrypted_content",
            ),
            (base(json!([{"content": "x"}])), Inv, "input[0].type"),
            (
                base(
                    json!([{"role": "assistant", "content": [{"type": "input_image", "image_url": format!("data:image/png;base64,{PNG_1X1}")}]}]),
                ),
                Inv,
                "input[0].content",
            ),
            (
                with(json!({"previous_response_id": "resp_1"})),
                Uns,
                "previous_response_id",
            ),
            (with(json!({"store": true})), Uns, "store"),
            (with(json!({"background": true})), Uns, "background"),
            (
                with(json!({"tools": [{"type": "web_search"}]})),
                Uns,
                "tools[0].type",
            ),
            (
                with(
                    json!({"tools": [{"type": "function", "name": "ok"}, {"type": "function", "name": "no spaces"}]}),
                ),
                Inv,
                "tools[1].name",
            ),
            (
                with(json!({"tools": [{"type": "function", "name": "f", "parameters": []}]})),
                Inv,
                "tools[0].parameters",
            ),
            (
                with(json!({"tool_choice": {"type": "function", "name": "g"}})),
                Inv,
                "tool_choice.name",
            ),
            (with(json!({"temperature": 3})), Inv, "temperature"),
            (
                with(json!({"max_output_tokens": 0})),
                Inv,
                "max_output_tokens",
            ),
            (
                with(json!({"text": {"format": {"type": "json_schema", "schema": {}}}})),
                Inv,
                "text.format.name",
            ),
            (
                with(json!({"text": {"format": {"type": "xml"}}})),
                Inv,
                "text.format.type",
            ),
            (
                with(json!({"reasoning": {"effort": "huge"}})),
                Inv,
                "reasoning.effort",
            ),
            (
                with(json!({"include": ["reasoning.encrypted_content"]})),
                Uns,
                "include[0]",
            ),
        ],
    );
}

#[test]
fn anthropic_errors() {
    let with = |extra: Value| {
        let mut b =
            json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]});
        if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        b
    };
    let msgs = |m: Value| json!({"model": "m", "max_tokens": 10, "messages": m});
    check_errors(
        ANTH,
        vec![
            (json!(null), Inv, ""),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                Inv,
                "max_tokens",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
                Inv,
                "model",
            ),
            (msgs(json!([])), Inv, "messages"),
            (
                with(json!({"frequency_penalty": 1})),
                Inv,
                "frequency_penalty",
            ),
            (with(json!({"temperature": 1.5})), Inv, "temperature"),
            (with(json!({"top_k": 0})), Inv, "top_k"),
            (with(json!({"max_tokens": 0})), Inv, "max_tokens"),
            (with(json!({"stop_sequences": "x"})), Inv, "stop_sequences"),
            (
                with(json!({"system": [{"type": "image"}]})),
                Inv,
                "system[0].type",
            ),
            (
                with(json!({"metadata": {"user_id": "a", "session": "b"}})),
                Inv,
                "metadata.session",
            ),
            (with(json!({"container": "c"})), Uns, "container"),
            (with(json!({"mcp_servers": []})), Uns, "mcp_servers"),
            (
                with(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]})),
                Uns,
                "tools[0].type",
            ),
            (
                with(json!({"tools": [{"name": "f"}]})),
                Inv,
                "tools[0].input_schema",
            ),
            (
                with(json!({"tools": [{"name": "", "input_schema": {}}]})),
                Inv,
                "tools[0].name",
            ),
            (
                with(json!({"tool_choice": {"type": "tool", "name": "f"}})),
                Inv,
                "tool_choice.name",
            ),
            (
                with(json!({"tool_choice": {"type": "any"}})),
                Inv,
                "tool_choice",
            ),
            (
                with(json!({"thinking": {"type": "enabled", "budget_tokens": 5}})),
                Inv,
                "thinking.budget_tokens",
            ),
            (
                with(json!({"thinking": {"type": "enabled", "budget_tokens": 2048}})),
                Inv,
                "thinking.budget_tokens",
            ),
            (
                with(json!({"thinking": {"type": "enabled"}})),
                Inv,
                "thinking.budget_tokens",
            ),
            (
                msgs(json!([{"role": "system", "content": "x"}])),
                Inv,
                "messages[0].role",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "hologram"}]}]),
                ),
                Inv,
                "messages[2].content[1].type",
            ),
            (
                msgs(json!([{"role": "user", "content": [{"type": "document", "source": {}}]}])),
                Uns,
                "messages[0].content[0].type",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zz", "content": "r"}]}]),
                ),
                Inv,
                "messages[0].content[0].tool_use_id",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
                ),
                Inv,
                "messages[0].content[0].type",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "[]"}]}]),
                ),
                Inv,
                "messages[1].content[0].input",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AA"}}]}]),
                ),
                Inv,
                "messages[0].content[0].source.media_type",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
                ),
                Uns,
                "messages[0].content[0].source.type",
            ),
            (
                msgs(
                    json!([{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]),
                ),
                Uns,
                "messages[0].content[0].type",
            ),
            (
                msgs(json!([{"role": "user", "content": "x", "name": "bob"}])),
                Inv,
                "messages[0].name",
            ),
        ],
    );
}

#[test]
fn openai_cache_and_safety_identifiers_are_carried() {
    let chat = ok(
        CHAT,
        &chat_with(
            json!({"prompt_cache_key": "tenant-7", "safety_identifier": "hash-42",
            "user": "legacy-user", "prompt_cache_retention": "in_memory"}),
        ),
    );
    let responses = ok(
        RESP,
        &json!({"model": "m", "input": "x", "prompt_cache_key": "tenant-7", "safety_identifier": "hash-42",
            "user": "legacy-user", "prompt_cache_retention": "in_memory"}),
    );
    for r in [&chat, &responses] {
        assert_eq!(r.prompt_cache_key.as_deref(), Some("tenant-7"));
        assert_eq!(r.safety_identifier.as_deref(), Some("hash-42"));
        assert_eq!(r.user.as_deref(), Some("legacy-user"));
        // They change nothing the engine sees.
        assert_eq!(
            r.conversation.messages,
            vec![Message::text(Role::User, "x")]
        );
        assert_eq!(r.sampling, SamplingSettings::default());
    }
    // Serialised for the Python side, and absent when not given.
    let text = serde_json::to_value(&chat).unwrap();
    assert_eq!(text["prompt_cache_key"], json!("tenant-7"));
    assert_eq!(text["safety_identifier"], json!("hash-42"));
    let plain = serde_json::to_value(ok(CHAT, &chat_with(json!({})))).unwrap();
    assert!(plain.get("prompt_cache_key").is_none() && plain.get("safety_identifier").is_none());
    let back: EngineRequest = serde_json::from_value(text).unwrap();
    assert_eq!(back, chat);

    for protocol in [CHAT, RESP] {
        let with = |extra: Value| {
            let mut b = if protocol == CHAT {
                chat_with(json!({}))
            } else {
                json!({"model": "m", "input": "x"})
            };
            if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
                for (k, v) in e {
                    o.insert(k.clone(), v.clone());
                }
            }
            b
        };
        check_errors(
            protocol,
            vec![
                (
                    with(json!({"prompt_cache_key": 7})),
                    Inv,
                    "prompt_cache_key",
                ),
                (
                    with(json!({"safety_identifier": ["a"]})),
                    Inv,
                    "safety_identifier",
                ),
                (
                    with(json!({"prompt_cache_retention": "24h"})),
                    Uns,
                    "prompt_cache_retention",
                ),
                (
                    with(json!({"prompt_cache_retention": "forever"})),
                    Inv,
                    "prompt_cache_retention",
                ),
            ],
        );
    }
}

#[test]
fn responses_logprobs_and_include() {
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "top_logprobs": 5,
            "include": ["message.output_text.logprobs", "web_search_call.action.sources", "message.input_image.image_url"]}),
    );
    assert!(r.sampling.logprobs);
    assert_eq!(r.sampling.top_logprobs, Some(5));
    // The same settings as Chat Completions' logprobs + top_logprobs.
    let c = ok(
        CHAT,
        &chat_with(json!({"logprobs": true, "top_logprobs": 5})),
    );
    assert_eq!(
        (c.sampling.logprobs, c.sampling.top_logprobs),
        (r.sampling.logprobs, r.sampling.top_logprobs)
    );
    // The include alone: chosen tokens' logprobs, no alternatives.
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "include": ["message.output_text.logprobs"]}),
    );
    assert_eq!((r.sampling.logprobs, r.sampling.top_logprobs), (true, None));
    // top_logprobs without the include returns nothing in OpenAI's API either.
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "top_logprobs": 3, "include": []}),
    );
    assert_eq!(
        (r.sampling.logprobs, r.sampling.top_logprobs),
        (false, None)
    );

    let with = |extra: Value| {
        let mut b = json!({"model": "m", "input": "x"});
        if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        b
    };
    check_errors(
        RESP,
        vec![
            (with(json!({"top_logprobs": 21})), Inv, "top_logprobs"),
            (with(json!({"top_logprobs": -1})), Inv, "top_logprobs"),
            (with(json!({"top_logprobs": "5"})), Inv, "top_logprobs"),
            (
                with(json!({"include": "message.output_text.logprobs"})),
                Inv,
                "include",
            ),
            (
                with(json!({"include": ["file_search_call.results", 3]})),
                Inv,
                "include[1]",
            ),
            (
                with(json!({"include": ["message.output_text.logprobs", "everything"]})),
                Inv,
                "include[1]",
            ),
            (
                with(
                    json!({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}),
                ),
                Uns,
                "include[1]",
            ),
        ],
    );
    let e = parse_value(
        RESP,
        &with(json!({"include": ["reasoning.encrypted_content"]})),
    )
    .unwrap_err();
    assert!(e.message.contains("encrypted reasoning"), "{}", e.message);
    assert_eq!(e.status(), 400);
}

#[test]
fn streaming_takes_several_choices_and_logprobs() {
    for stream in [false, true] {
        let r = ok(
            CHAT,
            &chat_with(json!({"stream": stream, "n": 4, "logprobs": true, "top_logprobs": 2})),
        );
        assert_eq!(
            (
                r.stream,
                r.sampling.n,
                r.sampling.logprobs,
                r.sampling.top_logprobs
            ),
            (stream, 4, true, Some(2))
        );
    }
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "hi", "stream": true, "include": ["message.output_text.logprobs"], "top_logprobs": 3}),
    );
    assert!(r.stream && r.sampling.logprobs);
    let r = ok(CHAT, &chat_with(json!({"stream": false, "n": 2})));
    assert_eq!(r.sampling.n, 2);
}

#[test]
fn responses_reasoning_summary_setting() {
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "reasoning": {"effort": "high", "summary": "detailed"}}),
    );
    assert_eq!(r.reasoning_summary, Some(ReasoningSummary::Detailed));
    assert_eq!(r.conversation.thinking.effort, Some(ReasoningEffort::High));
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "reasoning": {"generate_summary": "concise"}}),
    );
    assert_eq!(r.reasoning_summary, Some(ReasoningSummary::Concise));
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "reasoning": {"effort": "low"}}),
    );
    assert_eq!(r.reasoning_summary, None);
    assert!(serde_json::to_value(&r)
        .unwrap()
        .get("reasoning_summary")
        .is_none());
    let r = ok(
        RESP,
        &json!({"model": "m", "input": "x", "reasoning": {"summary": "auto"}}),
    );
    assert_eq!(
        serde_json::to_value(&r).unwrap()["reasoning_summary"],
        json!("auto")
    );
    check_errors(
        RESP,
        vec![
            (
                json!({"model": "m", "input": "x", "reasoning": {"summary": "auto", "generate_summary": "detailed"}}),
                Inv,
                "reasoning.generate_summary",
            ),
            (
                json!({"model": "m", "input": "x", "reasoning": {"summary": "brief"}}),
                Inv,
                "reasoning.summary",
            ),
        ],
    );
}

fn anthropic_with(extra: Value) -> Value {
    let mut b =
        json!({"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "x"}]});
    if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            o.insert(k.clone(), v.clone());
        }
    }
    b
}

#[test]
fn anthropic_adaptive_thinking_and_output_config() {
    let r = ok(
        ANTH,
        &anthropic_with(json!({"thinking": {"type": "adaptive"}})),
    );
    assert_eq!(
        r.conversation.thinking,
        Thinking {
            enabled: Some(true),
            effort: None,
            budget_tokens: None,
            adaptive: true,
        }
    );
    let r = ok(
        ANTH,
        &anthropic_with(
            json!({"thinking": {"type": "adaptive", "display": "summarized"}, "output_config": {"effort": "low"}}),
        ),
    );
    assert_eq!(
        r.conversation.thinking,
        Thinking {
            enabled: Some(true),
            effort: Some(ReasoningEffort::Low),
            budget_tokens: None,
            adaptive: true,
        }
    );
    let r = ok(
        ANTH,
        &anthropic_with(json!({"thinking": {"type": "disabled"}})),
    );
    assert_eq!(
        r.conversation.thinking,
        Thinking {
            enabled: Some(false),
            ..Thinking::default()
        }
    );
    // Adaptive is not the fixed-budget form, whose settings stay as they were.
    let r = ok(
        ANTH,
        &anthropic_with(
            json!({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "summarized"}}),
        ),
    );
    assert!(!r.conversation.thinking.adaptive);
    assert_eq!(r.conversation.thinking.budget_tokens, Some(1024));
    // Effort alone, read as Chat's reasoning_effort (DeepSeek's adapter reads all three
    // protocols' effort fields alike); "none" turns thinking off unless it was set.
    let chat = ok(CHAT, &chat_with(json!({"reasoning_effort": "high"})));
    let r = ok(
        ANTH,
        &anthropic_with(json!({"output_config": {"effort": "high"}})),
    );
    assert_eq!(r.conversation.thinking, chat.conversation.thinking);
    for (effort, level) in [
        ("xhigh", ReasoningEffort::Xhigh),
        ("max", ReasoningEffort::Max),
    ] {
        let r = ok(
            ANTH,
            &anthropic_with(json!({"output_config": {"effort": effort}})),
        );
        assert_eq!(r.conversation.thinking.effort, Some(level));
    }
    let r = ok(
        ANTH,
        &anthropic_with(json!({"output_config": {"effort": "none"}})),
    );
    assert_eq!(r.conversation.thinking.enabled, Some(false));
    let r = ok(
        ANTH,
        &anthropic_with(
            json!({"output_config": {"effort": "none"}, "thinking": {"type": "adaptive"}}),
        ),
    );
    assert_eq!(r.conversation.thinking.enabled, Some(true));
    // Structured output: a strict JSON-schema format.
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let r = ok(
        ANTH,
        &anthropic_with(
            json!({"output_config": {"format": {"type": "json_schema", "schema": schema.clone()}}, "cache_control": {"type": "ephemeral"}}),
        ),
    );
    assert_eq!(
        r.response_format,
        ResponseFormat::JsonSchema {
            name: "output".into(),
            schema,
            strict: true
        }
    );
    check_errors(
        ANTH,
        vec![
            (
                anthropic_with(json!({"thinking": {"type": "adaptive", "budget_tokens": 2048}})),
                Inv,
                "thinking.budget_tokens",
            ),
            (
                anthropic_with(json!({"thinking": {"type": "adaptive", "display": "omitted"}})),
                Uns,
                "thinking.display",
            ),
            (
                anthropic_with(
                    json!({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "hidden"}}),
                ),
                Inv,
                "thinking.display",
            ),
            (
                anthropic_with(json!({"thinking": {"type": "between_tools"}})),
                Uns,
                "thinking.type",
            ),
            (
                anthropic_with(json!({"thinking": {"type": "sometimes"}})),
                Inv,
                "thinking.type",
            ),
            (
                anthropic_with(json!({"thinking": {"type": "disabled", "budget_tokens": 1024}})),
                Inv,
                "thinking.budget_tokens",
            ),
            (
                anthropic_with(json!({"output_config": {"effort": "extreme"}})),
                Inv,
                "output_config.effort",
            ),
            (
                anthropic_with(json!({"output_config": {"verbosity": "low"}})),
                Inv,
                "output_config.verbosity",
            ),
            (
                anthropic_with(json!({"output_config": {"format": {"type": "xml"}}})),
                Inv,
                "output_config.format.type",
            ),
            (
                anthropic_with(json!({"output_config": {"format": {"type": "json_schema"}}})),
                Inv,
                "output_config.format.schema",
            ),
            (
                anthropic_with(json!({"cache_control": "yes"})),
                Inv,
                "cache_control",
            ),
        ],
    );
}

#[test]
fn anthropic_tool_result_errors_are_carried() {
    let body = |is_error: Value| {
        json!({"model": "m", "max_tokens": 10, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                                               {"type": "tool_use", "id": "t2", "name": "get_time", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "upstream timeout", "is_error": is_error},
                {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "12:00"}]},
            ]},
        ]})
    };
    let r = ok(ANTH, &body(json!(true)));
    let results: Vec<&Message> = r
        .conversation
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .collect();
    assert_eq!(
        results[0],
        &Message {
            tool_call_id: Some("t1".into()),
            name: Some("get_weather".into()),
            is_error: true,
            ..Message::text(Role::Tool, "upstream timeout")
        }
    );
    assert!(!results[1].is_error);
    let json_form = serde_json::to_value(&r.conversation.messages).unwrap();
    assert_eq!(json_form[2]["is_error"], json!(true));
    assert!(json_form[3].get("is_error").is_none());
    // false is the same as absent.
    let r_false = ok(ANTH, &body(json!(false)));
    assert!(r_false.conversation.messages.iter().all(|m| !m.is_error));
    assert_ne!(r_false.conversation, r.conversation);
    let e = parse_value(ANTH, &body(json!("yes"))).unwrap_err();
    assert_eq!(
        (e.kind, e.path.as_str()),
        (Inv, "messages[2].content[0].is_error")
    );
}

#[test]
fn bad_json_reports_line_and_column() {
    let e = parse_request(CHAT, b"{\n  \"model\": \"m\",\n  oops\n}").unwrap_err();
    assert_eq!((e.kind, e.path.as_str()), (Inv, ""));
    assert!(e.message.contains("line 3"), "{}", e.message);
    assert!(e.message.contains("column"), "{}", e.message);
    let e = parse_request(ANTH, b"").unwrap_err();
    assert_eq!(e.path, "");
    let r = parse_request(RESP, br#"{"model": "m", "input": "hi"}"#).unwrap();
    assert_eq!(r.protocol, RESP);
}

#[test]
fn error_bodies_have_protocol_shapes() {
    let body = chat_with(json!({"prediction": {"type": "content", "content": "x"}}));
    let e = parse_value(CHAT, &body).unwrap_err();
    let b = e.body(CHAT);
    assert_eq!(b["error"]["param"], json!("prediction"));
    assert_eq!(b["error"]["type"], json!("invalid_request_error"));
    assert_eq!(b["error"]["code"], json!("unsupported_parameter"));
    assert!(b["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("drop the field"));
    assert_eq!(e.status(), 400);

    let e = parse_value(RESP, &json!({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": "r"}]})).unwrap_err();
    let b = e.body(RESP);
    assert_eq!(b["error"]["param"], json!("input[0].call_id"));
    assert_eq!(b["error"]["code"], Value::Null);

    let e = parse_value(ANTH, &json!({"model": "m", "messages": []})).unwrap_err();
    let b = e.body(ANTH);
    assert_eq!(b["type"], json!("error"));
    assert_eq!(b["error"]["type"], json!("invalid_request_error"));
    assert!(b["error"]["message"]
        .as_str()
        .unwrap_or("")
        .starts_with("max_tokens: "));
    assert_eq!(b.as_object().map(|o| o.len()), Some(2));
}

// ---------------------------------------------------------------------------
// Never panics.

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    const KEYS: &[&str] = &[
        "model",
        "messages",
        "input",
        "role",
        "content",
        "type",
        "text",
        "tool_calls",
        "tool_call_id",
        "id",
        "function",
        "name",
        "arguments",
        "tools",
        "tool_choice",
        "parameters",
        "input_schema",
        "system",
        "instructions",
        "max_tokens",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stop",
        "n",
        "thinking",
        "budget_tokens",
        "call_id",
        "output",
        "summary",
        "tool_use_id",
        "image_url",
        "url",
        "source",
        "data",
        "media_type",
        "response_format",
        "json_schema",
        "schema",
        "text",
        "format",
        "reasoning",
        "effort",
        "reasoning_content",
        "stream",
        "stream_options",
        "metadata",
        "user_id",
        "logprobs",
        "top_logprobs",
        "chat_template_kwargs",
        "input",
        "thinking",
        "signature",
        "is_error",
    ];
    const STRINGS: &[&str] = &[
        "user",
        "assistant",
        "system",
        "developer",
        "tool",
        "function",
        "text",
        "image_url",
        "image",
        "tool_use",
        "tool_result",
        "thinking",
        "message",
        "function_call",
        "function_call_output",
        "reasoning",
        "input_text",
        "output_text",
        "input_image",
        "summary_text",
        "reasoning_text",
        "auto",
        "none",
        "required",
        "any",
        "enabled",
        "disabled",
        "json_schema",
        "json_object",
        "base64",
        "url",
        "image/png",
        "{}",
        "{\"a\":1}",
        "c1",
        "f",
        "",
        "high",
    ];

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            (-3.0f64..3.0).prop_map(|f| json!(f)),
            prop::sample::select(STRINGS).prop_map(|s| json!(s)),
            ".{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(6, 96, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((prop::sample::select(KEYS), inner), 0..8).prop_map(
                    |pairs| {
                        Value::Object(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                    }
                ),
            ]
        })
    }

    /// Mostly-valid bodies with one subtree replaced, so parsing gets deep.
    fn near_valid() -> impl Strategy<Value = Value> {
        let bases = vec![
            json!({"model": "m", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]}),
            json!({"model": "m", "input": [{"role": "user", "content": "x"}, {"type": "reasoning", "summary": []}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1", "output": "r"}]}),
            json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "r"}]}]}),
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{PNG_1X1}")}}]}]}),
            json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1X1}}]}]}),
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                {"type": "input_image", "image_url": format!("data:image/png;base64,{PNG_1X1}")}]}]}),
        ];
        (
            prop::sample::select(bases),
            prop::sample::select(KEYS),
            json_value(),
            0usize..4,
        )
            .prop_map(|(mut base, key, value, depth)| {
                // Replace a field at some depth along the last value of each level.
                plant(&mut base, depth, key, value);
                base
            })
    }

    fn plant(target: &mut Value, depth: usize, key: &str, value: Value) {
        if depth > 0 {
            let next = match target {
                Value::Object(map) => map.values_mut().last(),
                Value::Array(items) => items.last_mut(),
                _ => None,
            };
            if let Some(next) = next {
                return plant(next, depth - 1, key, value);
            }
        }
        if let Value::Object(map) = target {
            map.insert(key.to_string(), value);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_json_never_panics(v in json_value()) {
            for p in [CHAT, RESP, ANTH] {
                parsed_or_refused(p, parse_value(p, &v));
                if let Ok(bytes) = serde_json::to_vec(&v) {
                    parsed_or_refused(p, parse_request(p, &bytes));
                }
            }
        }

        #[test]
        fn near_valid_never_panics(v in near_valid()) {
            for p in [CHAT, RESP, ANTH] {
                parsed_or_refused(p, parse_value(p, &v));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            for p in [CHAT, RESP, ANTH] {
                parsed_or_refused(p, parse_request(p, &bytes));
            }
        }
    }

    /// A body is either a request, which then renders in both DeepSeek encodings or is
    /// refused, or a typed 4xx whose body a client can read; never a panic or a 5xx.
    fn parsed_or_refused(p: Protocol, result: powertrain_recipe::Result<EngineRequest>) {
        let refused = |e: &RecipeError| {
            assert!(matches!(e.kind, Inv | Uns), "{e:?}");
            assert!((400..500).contains(&e.status()), "{e:?}");
            let _ = e.body(p);
        };
        match result {
            Err(e) => refused(&e),
            Ok(request) => {
                for rendered in [
                    render_deepseek_v4(&request.conversation, true),
                    render_v4_family(
                        &request.conversation,
                        &ResponseFormat::Text,
                        true,
                        Version::V41,
                    ),
                ] {
                    if let Err(e) = rendered {
                        refused(&e);
                    }
                }
            }
        }
    }
}

#[test]
fn deep_nesting_and_huge_arrays_are_refused_or_parsed_without_overflow() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let nested = format!(
        "{{\"model\": \"m\", \"messages\": {}1{}}}",
        "{\"content\": ".repeat(50_000),
        "}".repeat(50_000)
    );
    for p in [CHAT, RESP, ANTH] {
        for text in [&deep, &nested] {
            let e = parse_request(p, text.as_bytes()).unwrap_err();
            assert_eq!((e.kind, e.status()), (Inv, 400), "{e:?}");
        }
    }
    // 100,000 messages: parsed and rendered in one piece, no recursion.
    let messages: Vec<Value> = (0..100_000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "x"}))
        .collect();
    let request = ok(CHAT, &json!({"model": "m", "messages": messages}));
    assert!(render_deepseek_v4(&request.conversation, true).is_ok());
}

#[test]
fn strict_tools_are_carried_from_every_protocol() {
    let schema =
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let chat = ok(
        CHAT,
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": schema, "strict": true}},
                  {"type": "function", "function": {"name": "t", "parameters": schema}}]}),
    );
    let responses = ok(
        RESP,
        &json!({"model": "m", "input": "hi",
        "tools": [{"type": "function", "name": "w", "parameters": schema, "strict": true},
                  {"type": "function", "name": "t", "parameters": schema}]}),
    );
    let anthropic = ok(
        ANTH,
        &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "w", "input_schema": schema, "strict": true}, {"name": "t", "input_schema": schema}]}),
    );
    for request in [&chat, &responses, &anthropic] {
        let strict: Vec<bool> = request
            .conversation
            .tools
            .iter()
            .map(|t| t.strict)
            .collect();
        assert_eq!(strict, vec![true, false]);
    }
    let e = parse_value(
        ANTH,
        &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "w", "input_schema": schema, "strict": "yes"}]}),
    )
    .unwrap_err();
    assert_eq!(e.path, "tools[0].strict");
}

#[test]
fn structured_outputs_extension_is_parsed_and_checked() {
    let base = |extra: Value| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let cases = [
        (
            json!({"regex": "[0-9]+"}),
            StructuredOutputs::Regex("[0-9]+".into()),
        ),
        (
            json!({"grammar": "start: \"a\""}),
            StructuredOutputs::Grammar("start: \"a\"".into()),
        ),
        (
            json!({"choice": ["yes", "no"]}),
            StructuredOutputs::Choice(vec!["yes".into(), "no".into()]),
        ),
        (
            json!({"json": {"type": "object"}}),
            StructuredOutputs::Json(json!({"type": "object"})),
        ),
    ];
    for (value, want) in cases {
        let request = ok(CHAT, &base(json!({"structured_outputs": value})));
        assert_eq!(request.structured_outputs, Some(want));
    }
    let anthropic = ok(
        ANTH,
        &json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"regex": "a+"}}),
    );
    assert_eq!(
        anthropic.structured_outputs,
        Some(StructuredOutputs::Regex("a+".into()))
    );
    let responses = ok(
        RESP,
        &json!({"model": "m", "input": "hi", "structured_outputs": {"choice": ["x"]}}),
    );
    assert_eq!(
        responses.structured_outputs,
        Some(StructuredOutputs::Choice(vec!["x".into()]))
    );

    for (extra, path) in [
        (
            json!({"structured_outputs": {"regex": "a", "grammar": "b"}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"pattern": "a"}}),
            "structured_outputs.pattern",
        ),
        (
            json!({"structured_outputs": {"choice": []}}),
            "structured_outputs.choice",
        ),
        (
            json!({"structured_outputs": {"choice": ["a", 3]}}),
            "structured_outputs.choice[1]",
        ),
        (
            json!({"structured_outputs": {"regex": 5}}),
            "structured_outputs.regex",
        ),
        (
            json!({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let e = parse_value(CHAT, &base(extra.clone())).unwrap_err();
        assert_eq!(e.path, path, "{extra}");
    }
    // Absent from the serialized request unless given.
    let plain = serde_json::to_value(ok(CHAT, &base(json!({})))).unwrap();
    assert!(plain.get("structured_outputs").is_none());
}

#[test]
fn remote_images_are_refused_unless_deferred_and_inline_ones_carry_their_bytes() {
    use powertrain_recipe::protocols::{images::check_image_bytes, parse_value_with, RemoteImages};
    let inline = png_header_url(40, 30);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": inline}},
        {"type": "image_url", "image_url": {"url": "https://images.example.com/a.png", "detail": "low"}}]}]});
    let e = parse_value(CHAT, &body).unwrap_err();
    assert_eq!(e.path, "messages[0].content[1].image_url.url");
    assert!(e.message.contains("[server.images] fetch"), "{}", e.message);

    let request = parse_value_with(CHAT, &body, RemoteImages::Defer).unwrap();
    assert_eq!(request.images, 2);
    assert_eq!(
        request.image_fits.len(),
        1,
        "only the inline image's size is known"
    );
    let (first, second) = (&request.image_parts[0], &request.image_parts[1]);
    assert_eq!(first.path, "messages[0].content[0].image_url.url");
    assert_eq!((first.width, first.height), (40, 30));
    assert_eq!(first.fit, Some(request.image_fits[0]));
    let bytes = first
        .data
        .as_ref()
        .expect("inline data keeps its decoded bytes");
    assert_eq!(
        check_image_bytes(bytes, "image/png", "x").unwrap(),
        (40, 30)
    );
    assert_eq!(
        second.url.as_deref(),
        Some("https://images.example.com/a.png")
    );
    assert!(second.data.is_none() && second.fit.is_none());

    // What the server runs on fetched bytes: the inline rules, naming the path it is given.
    let e =
        check_image_bytes(bytes, "image/jpeg", "messages[0].content[1].image_url.url").unwrap_err();
    assert_eq!(e.path, "messages[0].content[1].image_url.url");
    assert!(
        e.message.contains("not a valid image/jpeg"),
        "{}",
        e.message
    );
}
