"""Text <-> token ids, chat templates, and streaming detokenization.

One ``Tokenizer`` serves every checkpoint format: the loader builds the underlying
``tokenizers.Tokenizer`` (from tokenizer.json, or from GGUF metadata) and hands it over with the
special tokens and the chat template. Chat templates render the way HF transformers renders them,
so a prompt here is byte-for-byte the prompt the model was trained and evaluated with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import structlog
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = structlog.get_logger(__name__)

#: Tokens that end an assistant turn in common chat formats. A model whose chat template writes
#: one of them stops generating when it produces it, even if its eos token is another one.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")

_REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused the conversation."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what a serving engine needs around it."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        source: str = "",
    ) -> None:
        self.backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._unk_token = unk_token
        self._pad_token = pad_token
        self._chat_template = chat_template
        self._source = source
        self._extra_eos_token_ids = tuple(int(token_id) for token_id in extra_eos_token_ids)
        self._compiled_template: jinja2.Template | None = None

    # Read-only: a loaded checkpoint (and its tokenizer) may be shared; change one through ``replace``.
    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def unk_token(self) -> str | None:
        return self._unk_token

    @property
    def pad_token(self) -> str | None:
        return self._pad_token

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def source(self) -> str:
        """Where this tokenizer came from, for error messages."""
        return self._source

    def replace(self, **changes: Any) -> Tokenizer:
        """A copy with some constructor arguments changed (e.g. ``chat_template=``), sharing the backend."""
        arguments = {
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "unk_token": self._unk_token,
            "pad_token": self._pad_token,
            "chat_template": self._chat_template,
            "extra_eos_token_ids": self._extra_eos_token_ids,
            "source": self._source,
        }
        unknown = set(changes) - set(arguments)
        if unknown:
            raise TypeError(f"Tokenizer.replace got unknown arguments: {', '.join(sorted(unknown))}")
        return Tokenizer(self.backend, **{**arguments, **changes})

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, eos_token_ids={sorted(self.eos_token_ids)}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )

    # -- vocabulary ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (the model's embedding may have more rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: eos, ids the checkpoint lists, and end-of-turn tokens its template writes."""
        ids = set(self._extra_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        for token in END_OF_TURN_TOKENS:
            token_id = self.backend.token_to_id(token)
            if token_id is not None and self.chat_template is not None and token in self.chat_template:
                ids.add(token_id)
        return frozenset(ids)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- encode / decode ---------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become their ids.

        ``add_special_tokens`` adds what the checkpoint's post-processor adds (e.g. a BOS); chat
        templates usually write those themselves, hence the default.
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` for many texts at once (tokenizers runs them in parallel)."""
        return [
            encoding.ids for encoding in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat templates ----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text, as HF transformers' ``apply_chat_template(tokenize=False)``.

        Extra keyword arguments become template variables (e.g. ``enable_thinking=False``).
        """
        template = self._compiled_chat_template()
        if not messages:
            raise ChatTemplateError("Cannot apply a chat template to an empty conversation; give at least one message.")
        conversation = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(
                    f"Chat message {index} is a {type(message).__name__}; each message must be a dict such as "
                    "{'role': 'user', 'content': 'Hello'}."
                )
            # Like transformers: APIs send content=None next to tool_calls, which templates would print as "None".
            conversation.append({key: value for key, value in message.items() if value is not None})
        variables = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if value is not None
        }
        variables.update(kwargs)
        try:
            return template.render(
                messages=conversation,
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        # A template is a program: besides raise_exception() it can fail like one (a missing key, 1 / 0).
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as error:
            raise ChatTemplateError(
                f"The chat template of {self.source or 'this model'} refused the conversation: {error}. "
                "Check the roles and their order (many templates require alternating user/assistant turns, "
                "some reject a system message)."
            ) from error

    def _compiled_chat_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.source or 'This model'} has no chat template, so chat messages cannot be turned into a "
                "prompt. Pass a plain text prompt instead, or use a checkpoint that ships one (tokenizer_config.json "
                "'chat_template', chat_template.jinja, or the GGUF key tokenizer.chat_template)."
            )
        compiled = self._compiled_template
        if compiled is None:
            try:
                compiled = _chat_template_environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as error:
                raise ChatTemplateError(
                    f"The chat template of {self.source or 'this model'} is not valid Jinja (line {error.lineno}: "
                    f"{error.message}); fix or replace the checkpoint's chat template."
                ) from error
            self._compiled_template = compiled
        return compiled


def _chat_template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment HF transformers renders chat templates in (templates are untrusted code)."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text pieces, one ``add`` per token.

    Decoding one token alone is wrong in two ways: a UTF-8 character can be split over several
    byte-level tokens, and decoders such as SentencePiece's drop a leading space at the start of a
    text. So each step decodes a short window of recent tokens and emits only the text after what
    that window already produced, holding back text that ends in an incomplete character (U+FFFD).
    For byte-level tokenizers the pieces concatenate to ``tokenizer.decode(all_ids)``; with a
    SentencePiece-style decoder, ``prompt_ids`` keeps the first token's leading space. ``text`` is
    the sum so far, ready for stop-string checks. Bytes that never complete a character are not
    held forever: the next token that ends cleanly releases them (as U+FFFD), and so does ``finish``.
    """

    #: Prompt tokens kept as left context, so the first generated token decodes as it would mid-text.
    PROMPT_CONTEXT = 6

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT :]) if prompt_ids else []
        # _ids[_prefix:_read] is the context window already emitted; _ids[_read:] is pending.
        self._prefix = 0
        self._read = len(self._ids)
        self._generated = 0
        self.text = ""

    @property
    def num_tokens(self) -> int:
        """Number of tokens added so far."""
        return self._generated

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        self._generated += 1
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        piece = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._trim()
        self.text += piece
        return piece

    def finish(self) -> str:
        """Flush what is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        piece = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += piece
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _trim(self) -> None:
        # Only the window from _prefix on is ever decoded again; drop the rest so memory stays flat.
        if self._prefix > 64:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
