"""HF checkpoint folders: tiny random checkpoints written by transformers, read back by the loader."""

from __future__ import annotations

import json
import random
import shutil
import string
from pathlib import Path
from typing import Any

import pytest
import torch

from powertrain.loader import (
    CorruptCheckpointError,
    ModelNotFoundError,
    UnsupportedCheckpointError,
    load_checkpoint,
)

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE trained on random text, with a post-processor that adds BOS (as Llama 3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random()
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(200)]
    corpus = [" ".join(rng.choices(words, k=30)) for _ in range(200)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    bos = backend.token_to_id("<|endoftext|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", bos)]
    )
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    backend.save(str(path))
    return path


def make_checkpoint(
    folder: Path,
    tokenizer_json: Path,
    *,
    tied: bool,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    chat_template_file: str | None = None,
) -> Any:
    """A tiny random Llama saved by transformers (safetensors), plus tokenizer files. Returns the HF model."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=400,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=2,
        rope_theta=12345.0,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():  # fresh random values everywhere, norms included
            parameter.normal_()
    model = model.to(dtype)
    # transformers >= 5 always writes safetensors.
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    model.generation_config.eos_token_id = [2, 1]
    model.generation_config.save_pretrained(folder)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    if chat_template_file is not None:
        (folder / "chat_template.jinja").write_text(chat_template_file)
    return model


def assert_tensors_equal(checkpoint: Any, model: Any) -> None:
    expected = model.state_dict()
    loaded = dict(checkpoint.tensors())
    assert list(loaded) == list(checkpoint.tensor_names)
    tied = model.config.tie_word_embeddings
    assert set(expected) - set(loaded) == ({"lm_head.weight"} if tied else set())
    assert set(loaded) <= set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == expected[name].dtype, name  # safetensors keep their stored dtype
        assert torch.equal(tensor, expected[name]), name


def test_single_file_checkpoint(tmp_path: Path, tokenizer_json: Path) -> None:
    model = make_checkpoint(tmp_path, tokenizer_json, tied=False)
    assert (tmp_path / "model.safetensors").is_file()
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.format == "safetensors" and checkpoint.path == tmp_path.resolve()
    assert_tensors_equal(checkpoint, model)

    saved = json.loads((tmp_path / "config.json").read_text())
    for key, value in saved.items():
        assert checkpoint.config[key] == value, key
    # transformers 5 writes rope_parameters only; the loader adds the transformers 4 spelling too.
    assert checkpoint.config["rope_theta"] == 12345.0 and checkpoint.config["rope_scaling"] is None
    assert checkpoint.config["architectures"] == ["LlamaForCausalLM"]
    assert checkpoint.generation_config["eos_token_id"] == [2, 1]


def test_sharded_checkpoint(tmp_path: Path, tokenizer_json: Path) -> None:
    model = make_checkpoint(tmp_path, tokenizer_json, tied=True, dtype=torch.bfloat16, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    checkpoint = load_checkpoint(str(tmp_path))
    assert checkpoint.num_tensors == len(index["weight_map"])
    assert_tensors_equal(checkpoint, model)
    assert checkpoint.config["tie_word_embeddings"] is True


def test_tokenizer_and_chat_template_match_transformers(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True)
    tokenizer = load_checkpoint(tmp_path).tokenizer
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenizer.chat_template == CHATML
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|endoftext|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tokenizer.eos_token_ids == {2, 1}  # eos, generation_config's list, and the template's <|im_end|>
    rng = random.Random()
    for _ in range(50):
        text = "".join(rng.choices(string.ascii_letters + " \n.,!é😀", k=rng.randint(1, 60)))
        assert tokenizer.encode(text) == oracle.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text, add_special_tokens=True) == oracle.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    assert tokenizer.apply_chat_template(conversation) == oracle.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )


def test_chat_template_jinja_file_wins(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True, chat_template_file="{{ messages[0]['content'] }}!")
    tokenizer = load_checkpoint(tmp_path).tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"


def test_named_chat_templates_and_added_token_dicts(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True)
    config_path = tmp_path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    # Older files serialize special tokens as AddedToken dicts.
    tokenizer_config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    tokenizer_config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default:{{ messages | length }}"},
    ]
    config_path.write_text(json.dumps(tokenizer_config))
    tokenizer = load_checkpoint(tmp_path).tokenizer
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "default:1"
    assert tokenizer.eos_token == "<|im_end|>"


# -- errors ---------------------------------------------------------------------------------------


def test_unknown_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as error:
        load_checkpoint(str(missing))
    message = str(error.value)
    assert str(missing) in message
    assert "'smollm2-135m'" in message and "config.json" in message and ".gguf file" in message


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="has no config.json") as error:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(error.value)
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="pass one of them instead"):
        load_checkpoint(tmp_path)


def test_config_json_path_points_at_the_folder(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True)
    with pytest.raises(ModelNotFoundError, match="pass the checkpoint folder"):
        load_checkpoint(tmp_path / "config.json")


def test_pickled_weights_are_refused(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsupportedCheckpointError) as error:
        load_checkpoint(tmp_path)
    message = str(error.value)
    assert "must be safetensors" in message and "pytorch_model.bin" in message
    assert "save_pretrained" in message and "safe_serialization=True" in message


def test_missing_shard(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CorruptCheckpointError, match=shard.name) as error:
        load_checkpoint(tmp_path)
    assert "model.safetensors.index.json" in str(error.value)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True, max_shard_size="40KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path)


def test_truncated_safetensors(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors") as error:
        list(load_checkpoint(tmp_path).tensors())
    assert "Download it again" in str(error.value)


def test_missing_tokenizer_json(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(UnsupportedCheckpointError, match="tokenizer.json is missing") as error:
        load_checkpoint(tmp_path)
    assert "tokenizer.model" in str(error.value) and "save_pretrained" in str(error.value)


def test_open_is_cached_until_a_file_changes(tmp_path: Path, tokenizer_json: Path) -> None:
    make_checkpoint(tmp_path, tokenizer_json, tied=True)
    first = load_checkpoint(tmp_path)
    assert load_checkpoint(str(tmp_path)) is first
    template = tmp_path / "chat_template.jinja"
    template.write_text("changed:{{ messages | length }}")
    second = load_checkpoint(tmp_path)
    assert second is not first
    assert second.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "changed:1"
    # A shared tokenizer is never changed in place; replace() gives a copy.
    custom = second.tokenizer.replace(chat_template="custom")
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == "custom"
    assert second.tokenizer.chat_template == "changed:{{ messages | length }}"
    with pytest.raises(AttributeError):
        second.tokenizer.chat_template = "x"  # type: ignore[misc]
