//! powertrain's protocol adapter: requests in three wire protocols become one typed
//! conversation, then a prompt and its token ids; generated text becomes each
//! protocol's response or SSE events. No inference, no tool execution, no HTTP.
//!
//! - ``protocols``: Chat Completions, Responses, Anthropic Messages -> ``EngineRequest``.
//! - ``render``: ``Conversation`` -> prompt text, as segments that remember which text
//!   came from a user, a tool or a document (``render::Segment``).
//! - ``tokenize``: segments -> token ids; untrusted text never yields a special token.
//! - ``pretokenize``: a faster, identical GPT-2 byte-level pre-tokenizer for ``tokenize``.
//! - ``output``: generated text -> reasoning / answer / tool calls, responses and SSE.
//! - ``python`` (feature "python"): the PyO3 bindings the server and engine call.

pub mod conversation;
pub mod error;
pub mod image_fit;
pub mod output;
pub mod pretokenize;
pub mod protocols;
pub mod render;
pub mod tokenize;

#[cfg(feature = "python")]
mod python;

pub use conversation::*;
pub use error::{RecipeError, Result};
