//! Typed errors with an HTTP status and a protocol-shaped JSON body.
//!
//! Every invalid request names the offending field by its path in the request body
//! (``messages[2].content[0].type``), so a client can fix it without guessing.

use serde_json::{json, Value};

use crate::conversation::Protocol;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Malformed JSON, a wrong type, a missing or unknown field, a bad value: 400.
    InvalidRequest,
    /// Well-formed but asks for something this engine cannot honour: 400 too, but
    /// said plainly so the client knows to drop the field rather than fix it.
    Unsupported,
    /// Too large to serve (e.g. the prompt exceeds the model's context): 413.
    TooLarge,
    /// A bug or broken model metadata on our side: 500.
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct RecipeError {
    pub kind: ErrorKind,
    /// Where in the request body the problem is ("" for the body as a whole).
    pub path: String,
    pub message: String,
}

impl RecipeError {
    pub fn invalid(path: impl Into<String>, message: impl Into<String>) -> RecipeError {
        RecipeError {
            kind: ErrorKind::InvalidRequest,
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn unsupported(path: impl Into<String>, message: impl Into<String>) -> RecipeError {
        RecipeError {
            kind: ErrorKind::Unsupported,
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> RecipeError {
        RecipeError {
            kind: ErrorKind::Internal,
            path: String::new(),
            message: message.into(),
        }
    }

    pub fn status(&self) -> u16 {
        match self.kind {
            ErrorKind::InvalidRequest | ErrorKind::Unsupported => 400,
            ErrorKind::TooLarge => 413,
            ErrorKind::Internal => 500,
        }
    }

    /// The message with its path, as a client should read it.
    pub fn describe(&self) -> String {
        if self.path.is_empty() {
            self.message.clone()
        } else {
            format!("{}: {}", self.path, self.message)
        }
    }

    /// The error body each protocol's clients expect.
    pub fn body(&self, protocol: Protocol) -> Value {
        let error_type = match (protocol, self.kind) {
            (_, ErrorKind::Internal) => "api_error",
            (Protocol::AnthropicMessages, ErrorKind::TooLarge) => "request_too_large",
            _ => "invalid_request_error",
        };
        match protocol {
            Protocol::AnthropicMessages => json!({
                "type": "error",
                "error": {"type": error_type, "message": self.describe()},
            }),
            Protocol::ChatCompletions | Protocol::Responses => json!({
                "error": {
                    "message": self.describe(),
                    "type": if self.kind == ErrorKind::Internal { "server_error" } else { error_type },
                    "param": if self.path.is_empty() { Value::Null } else { Value::String(self.path.clone()) },
                    "code": if self.kind == ErrorKind::Unsupported { Value::from("unsupported_parameter") } else { Value::Null },
                }
            }),
        }
    }
}

pub type Result<T> = std::result::Result<T, RecipeError>;

/// Builds field paths as parsing descends: ``messages`` -> ``messages[2]`` -> ``messages[2].content``.
pub fn child(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

pub fn index(path: &str, i: usize) -> String {
    format!("{path}[{i}]")
}
