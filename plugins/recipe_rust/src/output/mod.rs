//! Generated text -> reasoning, answer text and tool calls; responses and SSE events.
//!
//! - [`parser`]: [`StreamParser`] turns the model's raw text (pushed in chunks of any
//!   size, even split mid-UTF-8 sequence) into [`OutputEvent`]s, per [`OutputFormat`].
//! - [`response`]: [`ResponseBuilder`] accumulates events into each protocol's
//!   non-streaming JSON body.
//! - [`sse`]: [`SseWriter`] turns events into each protocol's exact SSE frames.

pub mod parser;
pub mod response;
pub mod sse;

pub use parser::{ForcedCall, OutputEvent, OutputFormat, StreamParser};
pub use response::{FinishReason, ResponseBuilder, Segment, Usage};
pub use sse::SseWriter;
