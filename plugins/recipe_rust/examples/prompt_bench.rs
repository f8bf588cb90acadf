//! Where the time of a request goes: parse, render and tokenize timed apart, on
//! Chat Completions bodies shaped like `benchmarks/recipe.py`'s (1-8 turns of random
//! words, a system prompt half the time) with SmolLM2's template and tokenizer. No
//! Python in the loop, so it runs under a profiler as is:
//!
//!     cargo run --release --example prompt_bench [requests] [rounds]
//!     perf record -g ./target/release/examples/prompt_bench
use std::path::Path;
use std::time::{Duration, Instant};

use powertrain_recipe::protocols::parse_request;
use powertrain_recipe::render::Encoder;
use powertrain_recipe::tokenize::PromptTokenizer;
use powertrain_recipe::Protocol;
use serde_json::json;

const WORDS: &[&str] = &[
    "the", "model", "reads", "a", "prompt", "and", "writes", "an", "answer", "about", "weather",
    "code", "music", "rivers", "cities", "numbers",
];

/// A fixed-seed xorshift: the same bodies on every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    fn sentence(&mut self) -> String {
        let words: Vec<&str> = (0..4 + self.below(37))
            .map(|_| WORDS[self.below(WORDS.len())])
            .collect();
        format!("{}.", words.join(" "))
    }
}

fn body(rng: &mut Rng) -> Vec<u8> {
    let mut messages = Vec::new();
    if rng.below(2) == 0 {
        messages.push(json!({"role": "system", "content": rng.sentence()}));
    }
    for turn in 0..1 + rng.below(8) {
        messages.push(json!({"role": "user", "content": rng.sentence()}));
        if turn < 7 && rng.below(5) < 4 {
            messages.push(json!({"role": "assistant", "content": rng.sentence()}));
        }
    }
    if messages.last().unwrap()["role"] == "assistant" {
        messages.push(json!({"role": "user", "content": rng.sentence()}));
    }
    serde_json::to_vec(&json!({"model": "smollm2", "messages": messages})).unwrap()
}

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().expect("a count"));
    let (requests, rounds) = (args.next().unwrap_or(1000), args.next().unwrap_or(20));
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2");
    let config =
        serde_json::from_slice(&std::fs::read(fixture.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let encoder = Encoder::from_metadata(&config, &json!({})).unwrap();
    let tokenizer =
        PromptTokenizer::from_bytes(&std::fs::read(fixture.join("tokenizer.json")).unwrap())
            .unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let bodies: Vec<Vec<u8>> = (0..requests).map(|_| body(&mut rng)).collect();

    let (mut parse, mut render, mut encode) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut ids = 0;
    for _ in 0..rounds {
        for body in &bodies {
            let started = Instant::now();
            let request = parse_request(Protocol::ChatCompletions, body).unwrap();
            let parsed = Instant::now();
            let prompt = encoder.render(&request.conversation, true).unwrap();
            let rendered = Instant::now();
            ids += tokenizer.encode(&prompt).unwrap().len();
            parse += parsed - started;
            render += rendered - parsed;
            encode += rendered.elapsed();
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / (rounds * requests) as f64;
    println!(
        "us per request: parse {:.1}, render {:.1}, tokenize {:.1}, total {:.1} ({} ids on average)",
        per(parse),
        per(render),
        per(encode),
        per(parse + render + encode),
        ids / (rounds * requests),
    );
}
