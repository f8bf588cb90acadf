//! The Python face of the crate (module ``powertrain_recipe._native``).
//!
//! Requests and responses cross as JSON text or plain Python lists/dicts; errors
//! cross as ``RecipeError`` exceptions carrying the HTTP status, the field path and
//! the protocol-shaped body. No input reaches a panic (the Rust side never unwraps
//! user data); PyO3 would turn one into a Python exception anyway.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use serde_json::Value;

use crate::conversation::{EngineRequest, ImagePart, Protocol};
use crate::error::RecipeError as Error;
use crate::output::parser::{ForcedCall, OutputEvent, OutputFormat, StreamParser as RustParser};
use crate::output::response::{FinishReason, Usage};
use crate::output::sse::SseWriter;
use crate::protocols::RemoteImages;
use crate::render::Encoder;
use crate::tokenize::PromptTokenizer;

create_exception!(
    _native,
    RecipeError,
    PyException,
    "A request the adapter refuses: .status (HTTP), .path (field path), .body (protocol-shaped JSON text)."
);

fn protocol(name: &str) -> PyResult<Protocol> {
    Protocol::parse(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown protocol {name:?}; known: chat_completions, responses, anthropic_messages"
        ))
    })
}

fn to_py(error: Error, protocol: Protocol) -> PyErr {
    let err = RecipeError::new_err(error.describe());
    Python::attach(|py| {
        let value = err.value(py);
        let _ = value.setattr("status", error.status());
        let _ = value.setattr("path", error.path.clone());
        let _ = value.setattr("body", error.body(protocol).to_string());
    });
    err
}

fn json_arg(what: &str, text: &str) -> PyResult<Value> {
    serde_json::from_str(text)
        .map_err(|e| PyValueError::new_err(format!("{what} is not valid JSON: {e}")))
}

/// Parse a request body of ``protocol`` into the engine request (JSON text).
#[pyfunction]
fn parse_request_json(protocol_name: &str, body: &[u8]) -> PyResult<String> {
    let protocol = protocol(protocol_name)?;
    let request =
        crate::protocols::parse_request(protocol, body).map_err(|e| to_py(e, protocol))?;
    serde_json::to_string(&request).map_err(|e| to_py(Error::internal(e.to_string()), protocol))
}

/// V4.1's preprocessed size and token count of an image sent at ``width × height``:
/// ``(width, height, tokens)``; ``ValueError`` where the official adapter refuses it.
#[pyfunction]
#[pyo3(signature = (width, height, detail = "high"))]
fn image_fit(width: u32, height: u32, detail: &str) -> PyResult<(usize, usize, usize)> {
    let detail = crate::image_fit::ImageDetail::parse(detail)
        .ok_or_else(|| PyValueError::new_err(format!("unknown image detail {detail:?}")))?;
    let fit =
        crate::image_fit::preprocessed(width, height, detail).map_err(PyValueError::new_err)?;
    Ok((fit.width, fit.height, fit.tokens))
}

/// V4.1's token count of an image already preprocessed to ``width × height``: what
/// an engine expands its placeholder to. ``ValueError`` where the fit does not settle.
#[pyfunction]
fn image_tokens(width: usize, height: usize) -> PyResult<usize> {
    let fit = crate::image_fit::fit(width, height).map_err(PyValueError::new_err)?;
    Ok(fit.tokens)
}

/// Checks the bytes of image ``number`` (from 1) of the ``count`` a request carries, as
/// inline data is checked (``protocols::images::check_image_bytes`` and ``fit_image``):
/// what a server that fetched a remote image runs on what it got. Returns ``{"width",
/// "height", "fit": {"width", "height", "rows", "columns", "tokens"}}``; a refusal is a
/// ``RecipeError`` naming ``path``, shaped for ``protocol_name``.
#[pyfunction]
#[pyo3(signature = (protocol_name, data, media_type, path, detail = "high", number = 1, count = 1))]
#[allow(clippy::too_many_arguments)]
fn check_image<'py>(
    py: Python<'py>,
    protocol_name: &str,
    data: &[u8],
    media_type: &str,
    path: &str,
    detail: &str,
    number: usize,
    count: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let protocol = protocol(protocol_name)?;
    let detail = crate::image_fit::ImageDetail::parse(detail)
        .ok_or_else(|| PyValueError::new_err(format!("unknown image detail {detail:?}")))?;
    let (width, height) = crate::protocols::images::check_image_bytes(data, media_type, path)
        .map_err(|e| to_py(e, protocol))?;
    let fit = crate::protocols::images::fit_image(width, height, detail, number, count, path)
        .map_err(|e| to_py(e, protocol))?;
    let result = serde_json::json!({"width": width, "height": height, "fit": fit});
    pythonize::pythonize(py, &result).map_err(|e| to_py(Error::internal(e.to_string()), protocol))
}

/// The request dict's ``image_parts`` get each inline image's decoded bytes as ``data``.
fn add_image_data(request: &Bound<'_, PyAny>, parts: &[ImagePart]) -> PyResult<()> {
    if parts.is_empty() {
        return Ok(());
    }
    let listed = request.get_item("image_parts")?;
    for (index, part) in parts.iter().enumerate() {
        let data = match &part.data {
            Some(bytes) => PyBytes::new(request.py(), bytes).into_any(),
            None => request.py().None().into_bound(request.py()),
        };
        listed.get_item(index)?.set_item("data", data)?;
    }
    Ok(())
}

/// A model's prompt side: its chat encoder (template or native) and tokenizer.
#[pyclass(frozen)]
struct PromptEncoder {
    encoder: Encoder,
    tokenizer: PromptTokenizer,
}

#[pymethods]
impl PromptEncoder {
    /// ``tokenizer_json``: the model's tokenizer.json text; ``tokenizer_config_json``:
    /// its tokenizer_config.json (chat_template, bos/eos); ``model_config_json``: config.json.
    #[new]
    #[pyo3(signature = (tokenizer_json, tokenizer_config_json, model_config_json = "{}"))]
    fn new(
        tokenizer_json: &str,
        tokenizer_config_json: &str,
        model_config_json: &str,
    ) -> PyResult<Self> {
        let tokenizer_config = json_arg("tokenizer_config_json", tokenizer_config_json)?;
        let model_config = json_arg("model_config_json", model_config_json)?;
        let encoder = Encoder::from_metadata(&tokenizer_config, &model_config)
            .map_err(|e| PyValueError::new_err(e.describe()))?;
        let tokenizer = PromptTokenizer::from_bytes(tokenizer_json.as_bytes())
            .map_err(|e| PyValueError::new_err(e.describe()))?;
        Ok(PromptEncoder { encoder, tokenizer })
    }

    /// Parse, render and tokenize in one call: ``(request dict, prompt text, token ids)``.
    /// The request comes back as Python objects directly (no JSON text to parse again);
    /// its ``image_parts`` carry each inline image's decoded bytes as ``data``.
    /// ``remote_images``: let ``http(s)`` image URLs through as parts to fetch (the
    /// server's operator enabled fetching) instead of refusing them.
    #[pyo3(signature = (protocol_name, body, add_generation_prompt = true, remote_images = false))]
    fn prompt<'py>(
        &self,
        py: Python<'py>,
        protocol_name: &str,
        body: &[u8],
        add_generation_prompt: bool,
        remote_images: bool,
    ) -> PyResult<(Bound<'py, PyAny>, String, Vec<u32>)> {
        let protocol = protocol(protocol_name)?;
        let remote = if remote_images {
            RemoteImages::Defer
        } else {
            RemoteImages::Refuse
        };
        let body = body.to_vec();
        let (mut request, text, ids) = py
            .detach(|| {
                let request = crate::protocols::parse_request_with(protocol, &body, remote)?;
                let prompt = self
                    .encoder
                    .render_request(&request, add_generation_prompt)?;
                let ids = self.tokenizer.encode(&prompt)?;
                Ok((request, prompt.text(), ids))
            })
            .map_err(|e: Error| to_py(e, protocol))?;
        let parts = std::mem::take(&mut request.image_parts);
        let native = pythonize::pythonize(py, &request)
            .map_err(|e| to_py(Error::internal(e.to_string()), protocol))?;
        let listed = pythonize::pythonize(py, &parts)
            .map_err(|e| to_py(Error::internal(e.to_string()), protocol))?;
        if !parts.is_empty() {
            native.set_item("image_parts", listed)?;
        }
        add_image_data(&native, &parts)?;
        Ok((native, text, ids))
    }

    /// Render an already parsed request (``parse_request_json``'s output): ``(prompt text, ids)``.
    #[pyo3(signature = (request_json, add_generation_prompt = true))]
    fn render_request(
        &self,
        request_json: &str,
        add_generation_prompt: bool,
    ) -> PyResult<(String, Vec<u32>)> {
        let request: EngineRequest = serde_json::from_str(request_json)
            .map_err(|e| PyValueError::new_err(format!("request_json: {e}")))?;
        let protocol = request.protocol;
        let prompt = self
            .encoder
            .render_request(&request, add_generation_prompt)
            .map_err(|e| to_py(e, protocol))?;
        let ids = self
            .tokenizer
            .encode(&prompt)
            .map_err(|e| to_py(e, protocol))?;
        Ok((prompt.text(), ids))
    }

    /// Every special token string of the tokenizer (what must never be injectable).
    fn special_tokens(&self) -> Vec<String> {
        self.tokenizer.special_tokens()
    }

    fn special_token_ids(&self) -> Vec<u32> {
        self.tokenizer.special_token_ids()
    }
}

fn event_to_dict<'py>(py: Python<'py>, event: &OutputEvent) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    match event {
        OutputEvent::Reasoning(text) => {
            dict.set_item("type", "reasoning")?;
            dict.set_item("text", text)?;
        }
        OutputEvent::Text(text) => {
            dict.set_item("type", "text")?;
            dict.set_item("text", text)?;
        }
        OutputEvent::ToolCallStart { index, id, name } => {
            dict.set_item("type", "tool_call_start")?;
            dict.set_item("index", index)?;
            dict.set_item("id", id)?;
            dict.set_item("name", name)?;
        }
        OutputEvent::ToolCallArguments { index, delta } => {
            dict.set_item("type", "tool_call_arguments")?;
            dict.set_item("index", index)?;
            dict.set_item("delta", delta)?;
        }
        OutputEvent::ToolCallEnd { index } => {
            dict.set_item("type", "tool_call_end")?;
            dict.set_item("index", index)?;
        }
        OutputEvent::Stopped { stop } => {
            dict.set_item("type", "stopped")?;
            dict.set_item("stop", stop)?;
        }
    }
    Ok(dict)
}

fn events_to_list<'py>(py: Python<'py>, events: &[OutputEvent]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for event in events {
        list.append(event_to_dict(py, event)?)?;
    }
    Ok(list)
}

fn dict_to_event(item: &Bound<'_, PyAny>) -> PyResult<OutputEvent> {
    let dict = item.cast::<PyDict>()?;
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        dict.get_item(key)?
            .ok_or_else(|| PyValueError::new_err(format!("output event lacks {key:?}")))
    };
    let kind: String = get("type")?.extract()?;
    Ok(match kind.as_str() {
        "reasoning" => OutputEvent::Reasoning(get("text")?.extract()?),
        "text" => OutputEvent::Text(get("text")?.extract()?),
        "tool_call_start" => OutputEvent::ToolCallStart {
            index: get("index")?.extract()?,
            id: get("id")?.extract()?,
            name: get("name")?.extract()?,
        },
        "tool_call_arguments" => OutputEvent::ToolCallArguments {
            index: get("index")?.extract()?,
            delta: get("delta")?.extract()?,
        },
        "tool_call_end" => OutputEvent::ToolCallEnd {
            index: get("index")?.extract()?,
        },
        "stopped" => OutputEvent::Stopped {
            stop: get("stop")?.extract()?,
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown output event type {other:?}"
            )))
        }
    })
}

/// Generated text -> events (reasoning, text, tool calls, stop), chunk by chunk.
#[pyclass]
struct StreamParser {
    inner: RustParser,
}

#[pymethods]
impl StreamParser {
    /// ``format``: "plain", "deepseek_v3" (V3/R1/V3.1 markup) or "deepseek_v4" (DSML).
    /// ``prompt``: the request's prompt text, when the parser should start where it
    /// left the answer (in reasoning after ``<think>``, in a tool-call block the
    /// prompt opened).
    /// ``forced_call``: for a "plain" model whose request forced a tool call, the form
    /// its output was constrained to: "arguments" (the output is the arguments of
    /// ``tool_name``), "json_list" or "hermes" (see the parser's ``ForcedCall``).
    #[new]
    #[pyo3(signature = (format, stop = Vec::new(), id_prefix = None, prompt = None, forced_call = None, tool_name = None))]
    fn new(
        format: &str,
        stop: Vec<String>,
        id_prefix: Option<String>,
        prompt: Option<&str>,
        forced_call: Option<&str>,
        tool_name: Option<String>,
    ) -> PyResult<Self> {
        let format = OutputFormat::parse(format).ok_or_else(|| {
            PyValueError::new_err(format!(
                "unknown output format {format:?}; known: plain, deepseek_v3, deepseek_v4"
            ))
        })?;
        let mut inner = RustParser::new(format, stop, false);
        if let Some(prompt) = prompt {
            inner = inner.after_prompt(prompt);
        }
        if let Some(form) = forced_call {
            inner = inner.with_forced_call(forced_call_form(form, tool_name)?);
        }
        if let Some(prefix) = id_prefix {
            inner = inner.with_id_prefix(prefix);
        }
        Ok(StreamParser { inner })
    }

    fn push<'py>(&mut self, py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyList>> {
        let events = self.inner.push(text);
        events_to_list(py, &events)
    }

    /// Bytes may end inside a UTF-8 sequence: the rest is awaited; invalid bytes become U+FFFD.
    fn push_bytes<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
        let events = self.inner.push_bytes(data);
        events_to_list(py, &events)
    }

    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.inner.finish();
        events_to_list(py, &events)
    }
}

fn forced_call_form(form: &str, tool_name: Option<String>) -> PyResult<ForcedCall> {
    Ok(match (form, tool_name) {
        ("arguments", Some(name)) => ForcedCall::Arguments { name },
        ("arguments", None) => {
            return Err(PyValueError::new_err(
                "forced_call \"arguments\" needs the tool_name the arguments are for",
            ))
        }
        ("json_list", _) => ForcedCall::JsonList,
        ("hermes", _) => ForcedCall::Hermes,
        (other, _) => {
            return Err(PyValueError::new_err(format!(
                "unknown forced_call {other:?}; known: arguments, json_list, hermes"
            )))
        }
    })
}

fn finish_reason(reason: &str, stop_sequence: Option<String>) -> PyResult<FinishReason> {
    Ok(match (reason, stop_sequence) {
        ("stop_sequence", Some(stop)) => FinishReason::StopSequence(stop),
        ("stop", _) => FinishReason::Stop,
        ("length", _) => FinishReason::Length,
        ("tool_calls", _) => FinishReason::ToolCalls,
        (other, _) => {
            return Err(PyValueError::new_err(format!(
                "finish reason {other:?}: use stop, length, tool_calls or stop_sequence (with the sequence)"
            )))
        }
    })
}

fn usage(
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_prompt_tokens: u32,
    reasoning_tokens: u32,
) -> Usage {
    Usage {
        prompt_tokens,
        completion_tokens,
        cached_prompt_tokens,
        reasoning_tokens,
    }
}

/// One response in one protocol: SSE frames as events arrive, or the whole JSON body.
#[pyclass]
struct ResponseWriter {
    writer: SseWriter,
}

#[pymethods]
impl ResponseWriter {
    /// ``reasoning_summary``: Responses only, the request asked for a reasoning
    /// summary (its parsed ``reasoning_summary`` is set): reasoning is written as the
    /// reasoning item's summary instead of its content. ``choice_index`` /
    /// ``ends_stream``: Chat Completions streaming ``n`` > 1 uses one writer per choice;
    /// only the last one's ``finish`` ends the stream.
    #[new]
    #[pyo3(signature = (protocol_name, id, model, created, include_usage = false, prompt_tokens = 0, cached_prompt_tokens = 0, reasoning_summary = false, choice_index = 0, ends_stream = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        protocol_name: &str,
        id: String,
        model: String,
        created: u64,
        include_usage: bool,
        prompt_tokens: u32,
        cached_prompt_tokens: u32,
        reasoning_summary: bool,
        choice_index: usize,
        ends_stream: bool,
    ) -> PyResult<Self> {
        let protocol = protocol(protocol_name)?;
        let writer = SseWriter::new(protocol, id, model, created)
            .with_include_usage(include_usage)
            .with_prompt_usage(prompt_tokens, cached_prompt_tokens)
            .with_reasoning_summary(reasoning_summary)
            .with_choice(choice_index, ends_stream);
        Ok(ResponseWriter { writer })
    }

    /// The frames that open the stream.
    fn start(&mut self) -> Vec<String> {
        self.writer.start()
    }

    /// Frames for these parser events (also recorded for ``response``).
    fn events(&mut self, events: &Bound<'_, PyList>) -> PyResult<Vec<String>> {
        let parsed = events
            .iter()
            .map(|item| dict_to_event(&item))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(self.writer.events(&parsed))
    }

    /// Log-probability entries of the tokens generated since the last call (dicts of
    /// ``token``, ``logprob``, ``bytes``, ``top_logprobs``): written with the next
    /// frame that carries generated text.
    fn add_logprobs(&mut self, entries: &Bound<'_, PyList>) -> PyResult<()> {
        let entries: Vec<serde_json::Value> = pythonize::depythonize(entries.as_any())
            .map_err(|e| PyValueError::new_err(format!("logprob entries: {e}")))?;
        self.writer.add_logprobs(entries);
        Ok(())
    }

    /// The closing frames (finish reason, usage, and the protocol's terminator).
    #[pyo3(signature = (reason, prompt_tokens, completion_tokens, cached_prompt_tokens = 0, reasoning_tokens = 0, stop_sequence = None))]
    fn finish(
        &mut self,
        reason: &str,
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_prompt_tokens: u32,
        reasoning_tokens: u32,
        stop_sequence: Option<String>,
    ) -> PyResult<Vec<String>> {
        let reason = finish_reason(reason, stop_sequence)?;
        Ok(self.writer.finish(
            &reason,
            &usage(
                prompt_tokens,
                completion_tokens,
                cached_prompt_tokens,
                reasoning_tokens,
            ),
        ))
    }

    /// The non-streaming response body (JSON text) for everything recorded so far.
    #[pyo3(signature = (reason, prompt_tokens, completion_tokens, cached_prompt_tokens = 0, reasoning_tokens = 0, stop_sequence = None))]
    fn response(
        &mut self,
        reason: &str,
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_prompt_tokens: u32,
        reasoning_tokens: u32,
        stop_sequence: Option<String>,
    ) -> PyResult<String> {
        let reason = finish_reason(reason, stop_sequence)?;
        let body = self.writer.response(
            &reason,
            &usage(
                prompt_tokens,
                completion_tokens,
                cached_prompt_tokens,
                reasoning_tokens,
            ),
        );
        Ok(body.to_string())
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("RecipeError", m.py().get_type::<RecipeError>())?;
    m.add_function(wrap_pyfunction!(parse_request_json, m)?)?;
    m.add_function(wrap_pyfunction!(image_fit, m)?)?;
    m.add_function(wrap_pyfunction!(image_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(check_image, m)?)?;
    m.add_class::<PromptEncoder>()?;
    m.add_class::<StreamParser>()?;
    m.add_class::<ResponseWriter>()?;
    Ok(())
}
