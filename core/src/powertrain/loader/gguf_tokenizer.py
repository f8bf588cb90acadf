"""Rebuild a ``tokenizers`` tokenizer from the vocabulary a GGUF file stores as metadata.

A GGUF has no tokenizer.json: it stores tokens, merges, token types and special ids under
``tokenizer.ggml.*``, and names its pre-tokenizer (``tokenizer.ggml.pre``) rather than spelling it
out. We follow llama.cpp, which is what these files are written for: the pre-tokenizer comes from
that name, and an unknown name is refused rather than guessed, since a wrong split silently changes
every prompt.

Known divergence: HF transformers' GGUF converter has no entry for ``smollm`` and so omits the
individual-digit split; llama.cpp and SmolLM2's own tokenizer.json split digits one by one, and so
do we. On digit-free text the two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError
from powertrain.tokenizer import Tokenizer

#: llama.cpp's token types (llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split regexes, as llama.cpp's llama-vocab.cpp applies them per tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is GPT-2's: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp: regex "\p{N}" first (every digit alone), then GPT-2's; SmolLM2's tokenizer.json says the same.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


#: tokenizer.ggml.pre -> the pre-tokenizer llama.cpp uses for it.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "codeshell": _digits_then_gpt2,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
}

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


def tokenizer_from_gguf(metadata: Mapping[str, Any], *, source: str) -> Tokenizer:
    """The tokenizer described by ``tokenizer.*`` metadata (values already decoded to Python objects)."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedCheckpointError(
            f"{source}: tokenizer.ggml.model is {model!r}; powertrain builds GGUF tokenizers of type "
            f"{', '.join(map(repr, SUPPORTED_TOKENIZER_MODELS))} (byte-level BPE) only. Use the model's Hugging "
            "Face checkpoint folder (with tokenizer.json) instead."
        )
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedCheckpointError(
            f"{source}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer powertrain does not know, and guessing "
            f"would silently change how every prompt is split. Known: {', '.join(sorted(PRE_TOKENIZERS))}. Use the "
            "model's Hugging Face checkpoint folder (with tokenizer.json) instead."
        )
    tokens = _required(metadata, "tokenizer.ggml.tokens", source)
    merges = _required(metadata, "tokenizer.ggml.merges", source)
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise CorruptCheckpointError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens; the "
            "file is damaged. Re-download or re-convert it."
        )

    alphabet = _byte_alphabet()
    # Tokens are stored in the byte-level alphabet already; one that is not (e.g. raw spaces) is respelled,
    # as HF transformers' converter does, so merges built from its bytes still find it.
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet.values_set else "".join(alphabet.to_char[b] for b in token.encode())
        vocab.setdefault(spelled, index)
    try:
        pairs = [tuple(merge.split(" ")) for merge in merges]
        backend = BackendTokenizer(
            models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="")
        )
    except Exception as error:  # tokenizers raises plain Exception for a merge naming an unknown token
        raise CorruptCheckpointError(
            f"{source}: the vocabulary and merges in tokenizer.ggml.* do not form a valid BPE tokenizer ({error}). "
            "Re-download or re-convert the file."
        ) from error
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) must match whole and be skippable; user-defined ones just match whole.
    # A "control" token outside the byte alphabet is a llama.cpp mislabel (HF skips those too).
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet.values_set
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
        ]
    )

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        if not 0 <= int(token_id) < len(tokens):
            raise CorruptCheckpointError(
                f"{source}: tokenizer.ggml.{key} is {token_id}, outside the vocabulary of {len(tokens)} tokens. "
                "Re-download or re-convert the file."
            )
        return tokens[int(token_id)]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    _set_post_processor(
        backend,
        bos if metadata.get("tokenizer.ggml.add_bos_token", False) else None,
        eos if metadata.get("tokenizer.ggml.add_eos_token", False) else None,
    )
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        extra_eos_token_ids=[metadata["tokenizer.ggml.eot_token_id"]]
        if "tokenizer.ggml.eot_token_id" in metadata
        else (),
        source=source,
    )


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """What ``encode(add_special_tokens=True)`` adds: the file's add_bos_token / add_eos_token flags."""
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    special = [(token, backend.token_to_id(token)) for token in dict.fromkeys(t for t in (bos, eos) if t)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _required(metadata: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in metadata:
        raise CorruptCheckpointError(
            f"{source}: the GGUF metadata has no {key!r}, which a byte-level BPE tokenizer needs. Re-download or "
            "re-convert the file."
        )
    return metadata[key]


class _ByteAlphabet:
    def __init__(self) -> None:
        # GPT-2's reversible byte -> printable character table.
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        chars = list(printable)
        extra = 0
        for byte in range(256):
            if byte not in printable:
                printable.append(byte)
                chars.append(256 + extra)
                extra += 1
        self.to_char = {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}
        self.values_set = frozenset(self.to_char.values())


@cache
def _byte_alphabet() -> _ByteAlphabet:
    return _ByteAlphabet()
