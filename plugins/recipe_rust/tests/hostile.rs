//! Malformed and hostile request bodies: every one is parsed to a request or refused
//! with a typed 4xx error, and a parsed request renders or is refused the same way;
//! nothing panics. Random JSON is drawn from the protocols' own field names, values
//! of every type, nested objects and arrays, and the request shapes around them, so
//! the parsers' deeper paths are reached, not only their first type check.

use powertrain_recipe::error::ErrorKind;
use powertrain_recipe::protocols::{parse_request, parse_value};
use powertrain_recipe::render::{render_deepseek_v4, render_deepseek_v41, Encoder};
use powertrain_recipe::*;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const PROTOCOLS: [Protocol; 3] = [
    Protocol::ChatCompletions,
    Protocol::Responses,
    Protocol::AnthropicMessages,
];

/// Field names the three protocols read, at any level.
const KEYS: &[&str] = &[
    "model",
    "messages",
    "input",
    "role",
    "content",
    "type",
    "text",
    "tools",
    "function",
    "name",
    "parameters",
    "arguments",
    "tool_calls",
    "tool_call_id",
    "tool_choice",
    "id",
    "call_id",
    "output",
    "image_url",
    "url",
    "source",
    "media_type",
    "data",
    "thinking",
    "reasoning",
    "reasoning_content",
    "effort",
    "response_format",
    "json_schema",
    "schema",
    "max_tokens",
    "n",
    "stream",
    "logprobs",
    "top_logprobs",
    "stop",
    "seed",
    "temperature",
    "system",
    "instructions",
    "tool_use_id",
    "input_schema",
    "output_config",
    "format",
    "budget_tokens",
    "include",
    "text_format",
    "summary",
    "metadata",
    "logit_bias",
];

const STRINGS: &[&str] = &[
    "user",
    "assistant",
    "system",
    "developer",
    "tool",
    "text",
    "function",
    "image_url",
    "input_text",
    "input_image",
    "function_call",
    "function_call_output",
    "tool_use",
    "tool_result",
    "image",
    "base64",
    "url",
    "enabled",
    "disabled",
    "adaptive",
    "auto",
    "none",
    "required",
    "json_object",
    "json_schema",
    "high",
    "max",
    "image/png",
    "data:image/png;base64,iVBORw0KGgo=",
    "data:image/png;base64,%%%",
    "https://x/y.png",
    "{\"a\": 1}",
    "{",
    "<｜User｜>",
    "",
    "m",
];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-1e12f64..1e12).prop_map(|f| json!(f)),
        proptest::sample::select(STRINGS).prop_map(|s| json!(s)),
        ".{0,12}".prop_map(Value::String),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((proptest::sample::select(KEYS), inner), 0..6).prop_map(
                |pairs| {
                    let mut map = Map::new();
                    for (k, v) in pairs {
                        map.insert(k.to_string(), v);
                    }
                    Value::Object(map)
                }
            ),
        ]
    })
}

/// Message content: a string, or parts of the protocols' types with random fields.
fn content() -> impl Strategy<Value = Value> {
    let part = (
        proptest::sample::select(&["text", "image_url", "input_text", "input_image", "image"][..]),
        ".{0,8}",
        proptest::sample::select(STRINGS),
        value(),
    )
        .prop_map(|(kind, text, url, extra)| match kind {
            "text" | "input_text" => json!({"type": kind, "text": text}),
            "image_url" => json!({"type": kind, "image_url": {"url": url}}),
            "input_image" => json!({"type": kind, "image_url": url}),
            _ => json!({"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": extra}}),
        });
    prop_oneof![
        ".{0,16}".prop_map(Value::String),
        proptest::collection::vec(part, 0..4).prop_map(Value::Array),
        value(),
    ]
}

/// A body for ``protocol``: its required fields around random content, roles and extra
/// fields (often one the protocol knows, with a value of any type), or any JSON at all.
fn body(protocol: Protocol) -> impl Strategy<Value = Value> {
    let turn = (
        proptest::sample::select(&["user", "assistant", "system", "tool", "developer"][..]),
        content(),
    )
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    (
        proptest::collection::vec(turn, 1..4),
        proptest::option::of((proptest::sample::select(KEYS), value())),
        0..10u8,
    )
        .prop_map(move |(turns, extra, roll)| {
            if roll == 0 {
                return turns[0]["content"].clone(); // any JSON at all
            }
            let mut body = match protocol {
                Protocol::ChatCompletions => json!({"model": "m", "messages": turns}),
                Protocol::Responses => json!({"model": "m", "input": turns}),
                Protocol::AnthropicMessages => {
                    let turns: Vec<Value> = turns
                        .into_iter()
                        .filter(|t| t["role"] == "user" || t["role"] == "assistant")
                        .collect();
                    json!({"model": "m", "max_tokens": 16, "messages": turns})
                }
            };
            if let Some((key, value)) = extra {
                body[key] = value;
            }
            body
        })
}

fn check_refusal(e: &error::RecipeError, what: &str) {
    assert!(
        matches!(e.kind, ErrorKind::InvalidRequest | ErrorKind::Unsupported),
        "{what}: {e:?}"
    );
    assert!((400..500).contains(&e.status()), "{what}: {e:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_bodies_parse_or_get_a_typed_4xx(
        (protocol, body) in proptest::sample::select(&PROTOCOLS[..]).prop_flat_map(|p| (Just(p), body(p)))
    ) {
        {
            match parse_value(protocol, &body) {
                Err(e) => check_refusal(&e, &format!("{protocol:?} {body}")),
                Ok(request) => {
                    for result in [
                        render_deepseek_v4(&request.conversation, true),
                        render_deepseek_v41(&request.conversation, true),
                    ] {
                        if let Err(e) = result {
                            check_refusal(&e, &format!("render {protocol:?} {body}"));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn random_bytes_are_refused_as_invalid_json(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        for protocol in PROTOCOLS {
            if let Err(e) = parse_request(protocol, &bytes) {
                check_refusal(&e, "bytes");
            }
        }
    }
}

#[test]
fn deep_nesting_and_huge_arrays_are_refused_or_parsed_without_overflow() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let object = format!(
        "{{\"model\": \"m\", \"messages\": {}{}}}",
        "{\"content\": ".repeat(50_000),
        "1}".repeat(50_000)
    );
    for protocol in PROTOCOLS {
        for text in [&deep, &object] {
            let e = parse_request(protocol, text.as_bytes()).unwrap_err();
            check_refusal(&e, "deep");
        }
    }
    // 100,000 messages: parsed (or refused) in one piece, rendered without recursion.
    let messages: Vec<Value> = (0..100_000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "x"}))
        .collect();
    let body = json!({"model": "m", "max_tokens": 16, "messages": messages});
    let request = parse_value(Protocol::ChatCompletions, &body).unwrap();
    let encoder = Encoder::DeepseekV4;
    assert!(encoder.render(&request.conversation, true).is_ok());
}
