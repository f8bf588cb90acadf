"""``powertrain.LLM``: offline batched generation in a few lines.

llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
llm.generate(["Hello"], SamplingParams(max_tokens=32))
llm.chat([{"role": "user", "content": "What is the capital of France?"}])
for output in llm.stream("Hello"): ...       # one prompt, its state after every step
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from powertrain.config import CORE_SECTIONS, EngineConfig, load_config
from powertrain.interfaces.engine import Engine, EngineTokenizer
from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.images import ImageInput
from powertrain.interfaces.outputs import RequestOutput
from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.speculative import SpeculativePolicy

Message = Mapping[str, Any]


def apply_overrides(config: EngineConfig, overrides: Mapping[str, Any]) -> EngineConfig:
    """Apply keyword overrides like ``dtype="float32"`` or ``num_blocks=64`` to the
    config section that owns each key (a key two sections share must be spelled
    ``section__key``, e.g. ``cache__block_size``)."""
    changes: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "__" in key:
            section, _, field = key.partition("__")
            owners = [section] if section in CORE_SECTIONS else []
        else:
            field = key
            owners = [name for name, cls in CORE_SECTIONS.items() if field in attrs.fields_dict(cls)]
        if len(owners) != 1 or field not in attrs.fields_dict(CORE_SECTIONS[owners[0]]):
            valid = sorted({f for cls in CORE_SECTIONS.values() for f in attrs.fields_dict(cls)})
            raise TypeError(f"LLM() got an unknown setting {key!r}; settings: {', '.join(valid)}")
        changes.setdefault(owners[0], {})[field] = value
    return attrs.evolve(
        config, **{section: attrs.evolve(getattr(config, section), **fields) for section, fields in changes.items()}
    )


class LLM:
    """A loaded model and its engine. Use as a context manager, or call ``shutdown()``."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | str | Path | None = None, **settings: Any):
        from powertrain.deploy.launch import start_engine

        if not isinstance(config, EngineConfig):
            config = load_config(config)
        if model is not None:
            settings = {"path": model, **settings}
        self.config = apply_overrides(config, settings)
        self.engine: Engine = start_engine(self.config)

    @property
    def tokenizer(self) -> EngineTokenizer:
        return self.engine.tokenizer

    @property
    def speculative_policy(self) -> SpeculativePolicy | None:
        """The speculative-decoding policy this engine built, or None (speculation off, or
        the model runs in worker processes). For a policy's own tools: DSpark's head
        training reads what its drafter logs while ``generate`` runs."""
        from powertrain.engine.engine import LLMEngine

        return self.engine.runner.speculative if isinstance(self.engine, LLMEngine) else None

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        """``SamplingParams(**fields)`` with the model's own sampling settings for what
        ``fields`` leaves unset (what ``generate`` uses without params; ``[model]
        generation_config`` says where they come from)."""
        return self.engine.sampling_defaults.params(**fields)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        images: Sequence[Sequence[ImageInput]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. One whose
        rank died (several ranks, no expert parallelism) comes back with ``error`` set.
        ``images``: per prompt, one image (``ImageInput.of_pixels``) per image placeholder
        token it holds, for a model with a vision encoder."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            return []
        params = _params_per_prompt(sampling_params, len(prompts))
        per_prompt = [() for _ in prompts] if images is None else list(images)
        if len(per_prompt) != len(prompts):
            raise InvalidRequestError(f"images must give one list per prompt: {len(per_prompt)} for {len(prompts)}")
        request_ids: list[str] = []
        try:
            for prompt, p, pictures in zip(prompts, params, per_prompt, strict=True):
                extra = {"images": list(pictures)} if pictures else {}
                request_ids.append(self.engine.add_request(prompt, p, **extra))
        except InvalidRequestError:
            for request_id in request_ids:  # all or nothing: the batch was refused
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [
            self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    def stream(
        self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding its state after every step (``outputs[0].text``
        only ever grows; the last one is finished): what a terminal prints as it goes.
        Closing the iterator early aborts the request."""
        request_id = self.engine.add_request(prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():  # let a step still in flight land
                self.engine.step()

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
        while self.engine.has_unfinished_requests():  # let a step still in flight land
            self.engine.step()
        return [finished[request_id] for request_id in request_ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams | None]:
    if sampling_params is None:  # the engine's sampling defaults (the model's own settings)
        return [None] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling params for {count} prompts; pass one, or one each")
    return params
