"""Tokenizer, chat templates and streaming detokenization, against HF transformers as the oracle.

The tokenizer under test is the embedded SmolLM2 one, rebuilt from GGUF metadata; the oracle is
transformers' tokenizer for the same GGUF file.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from powertrain.loader import Checkpoint, load_checkpoint
from powertrain.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return load_checkpoint("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    return checkpoint.tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint: Checkpoint) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint.path.parent), gguf_file=checkpoint.path.name)


# No digits anywhere: transformers' GGUF converter does not split digits for this model (see below).
FIXED_TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nwindows line ends",
    "many     spaces      between",
    "Ünïcödé façade naïve café — “quotes” and ‘single’ …",
    "日本語のテキストと中文文本, 한국어 텍스트",
    "Привет, мир! Γειά σου κόσμε.",
    "emoji 😀🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
    "def f(x):\n    return {'a': x, \"b\": [x, x]}  # comment\n",
    "if (a && b) { console.log(`template ${a}`); } else { x -= y; }",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm you're we've they'll she'd",
    "",
    " ",
    "\n",
]

_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    + list(" \t\n  .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`")
    + list("éèêëàâäôöûüçñßøåÆŒ")
    + list("日本語中文한국어Привет")
    + ["😀", "🎉", "🚀", "👍🏽", "🇫🇷", "\u200d", "🦩", "∑", "→", "€"]
)


def random_texts(count: int) -> list[str]:
    rng = random.Random()  # fresh each run
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 80))) for _ in range(count)]


def test_encode_and_decode_match_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    for text in FIXED_TEXTS + random_texts(200):
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text


def test_encode_batch_equals_encode(tokenizer: Tokenizer) -> None:
    texts = random_texts(20)
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(text) for text in texts]


def test_digits_are_split_one_by_one(tokenizer: Tokenizer) -> None:
    digit_ids = {str(digit): tokenizer.token_to_id(str(digit)) for digit in range(10)}
    assert None not in digit_ids.values()
    text = "In 2024 there were 365 days, and 1234567890 is long."
    pieces = [tokenizer.id_to_token(token_id) for token_id in tokenizer.encode(text)]
    assert [piece for piece in pieces if any(ch.isdigit() for ch in piece)] == list("20243651234567890")
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # llama.cpp ("smollm": \p{N} first, then GPT-2's regex) and SmolLM2's tokenizer.json split digits off before
    # the whitespace is grouped, so the double space stays one token. transformers' GGUF converter skips the digit
    # split and gives ['x', 'Ġ', 'Ġ', '1'] here: a known divergence, which is why the comparisons above avoid digits.
    assert [tokenizer.id_to_token(token_id) for token_id in tokenizer.encode("x  1")] == ["x", "ĠĠ", "1"]


def test_special_tokens(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert tokenizer.bos_token == hf_tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token == hf_tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nHi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    # The file says add_bos_token = false, so special tokens add nothing here either.
    assert tokenizer.encode("Hi", add_special_tokens=True) == hf_tokenizer.encode("Hi") == tokenizer.encode("Hi")


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Écris un haïku sur la mer 🌊"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c\n\nwith  spaces "},
        {"role": "assistant", "content": "d"},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, conversation: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


CUSTOM_TEMPLATE = """
{%- if tools %}{{ bos_token }}Tools: {{ tools | tojson }}
{% endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
[SYS] {{ message['content'] | trim }}
    {%- elif message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Roles must be user or assistant, got ' + message['role']) }}
    {%- else %}
<{{ message['role'] }}>{{ message['content'] }}{{ eos_token }}
    {%- endif %}
    {%- if loop.index >= limit | default(100) %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}
{{ "year:" if strftime_now("%Y") else "" }}
"""


def test_custom_template_renders_like_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    custom = Tokenizer(
        tokenizer.backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token,
        pad_token=tokenizer.pad_token,
        chat_template=CUSTOM_TEMPLATE,
    )
    tools = [{"name": "lookup", "description": "a < b & c → “d”", "parameters": {"type": "object"}}]
    for conversation in CONVERSATIONS:
        for kwargs in ({}, {"limit": 2}):
            ours = custom.apply_chat_template(conversation, tools=tools, **kwargs)
            theirs = hf_tokenizer.apply_chat_template(
                conversation,
                chat_template=CUSTOM_TEMPLATE,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
            assert ours == theirs
    assert '"a < b & c → “d”"' in ours  # tojson neither HTML-escapes nor ASCII-escapes
    # content=None (as OpenAI-style APIs send next to tool calls) is dropped, not rendered as "None".
    rendered = custom.apply_chat_template([{"role": "user", "content": "x", "name": None}])
    assert "None" not in rendered


def test_chat_template_errors(tokenizer: Tokenizer) -> None:
    custom = Tokenizer(tokenizer.backend, chat_template=CUSTOM_TEMPLATE, source="tiny-model")
    with pytest.raises(ChatTemplateError, match="Roles must be user or assistant, got tool") as error:
        custom.apply_chat_template([{"role": "tool", "content": "x"}])
    assert "tiny-model" in str(error.value)

    bare = Tokenizer(tokenizer.backend, source="tiny-model")
    with pytest.raises(ChatTemplateError, match="tiny-model has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])

    broken = Tokenizer(tokenizer.backend, chat_template="{% for m in messages %}", source="tiny-model")
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])

    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tokenizer.apply_chat_template([])

    failing = Tokenizer(tokenizer.backend, chat_template="{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="refused the conversation"):
        failing.apply_chat_template([{"role": "user", "content": "x"}])

    sandboxed = Tokenizer(tokenizer.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_ids_include_end_of_turn_tokens_the_template_writes(tokenizer: Tokenizer) -> None:
    # <|endoftext|> is the eos here; the template ends turns with <|im_end|>, so that stops generation too.
    chatml = Tokenizer(tokenizer.backend, eos_token="<|endoftext|>", chat_template=tokenizer.chat_template)
    assert chatml.eos_token_ids == {0, 2}
    plain = Tokenizer(tokenizer.backend, eos_token="<|endoftext|>", extra_eos_token_ids=[5])
    assert plain.eos_token_ids == {0, 5}


# -- streaming detokenization -----------------------------------------------------------------------


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.finish()]


def test_incremental_detokenizer_equals_full_decode(tokenizer: Tokenizer) -> None:
    for text in FIXED_TEXTS + random_texts(100):
        ids = tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(tokenizer)
        pieces = stream(detokenizer, ids)
        assert "".join(pieces) == detokenizer.text == tokenizer.decode(ids), text
        assert not any("\ufffd" in piece for piece in pieces), text
        assert detokenizer.num_tokens == len(ids)


def test_incremental_detokenizer_holds_back_split_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("A flamingo 🦩!")
    # The flamingo is rare enough to be spelled in byte tokens, each alone an invalid UTF-8 fragment.
    flamingo = [token_id for token_id in ids if "\ufffd" in tokenizer.decode([token_id])]
    assert len(flamingo) >= 2
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = stream(detokenizer, ids)
    assert pieces.count("") >= len(flamingo) - 1  # nothing emitted while the character is incomplete
    assert "🦩" in pieces[ids.index(flamingo[-1])]  # emitted whole by the token that completes it
    assert "".join(pieces) == "A flamingo 🦩!"


def test_incremental_detokenizer_special_tokens_and_prompt_context(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Sure.<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == "Sure."
    assert "".join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids)) == "Sure.<|im_end|>"
    prompt = tokenizer.encode("<|im_start|>assistant\nThe answer is")
    continuation = tokenizer.encode(" Paris, of course.")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    assert "".join(stream(detokenizer, continuation)) == " Paris, of course."


def test_incremental_detokenizer_long_stream(tokenizer: Tokenizer) -> None:
    text = " ".join(random_texts(40))
    ids = tokenizer.encode(text)
    assert len(ids) > 200  # longer than the window the detokenizer keeps
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(detokenizer, ids)) == text
