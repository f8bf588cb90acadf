"""DeepSeek checkpoints in DeepSeek's native tensor names load as the HF release does.

The native form is what DeepSeek's ``inference/convert.py`` writes (deepseek-ai/DeepSeek-V3 and
deepseek-ai/DeepSeek-V3.2-Exp, the latter adding the indexer's entries). ``to_native`` below is
that script's renaming, transcribed line by line, so it is an oracle independent of the loader's
own (inverse) table: a tiny HF checkpoint is rewritten with it and must give the same tensors,
logits and greedy tokens as the HF original, in float32 and in FP8 (V3.2 with its indexer's
``wq_b`` and ``wk`` FP8, as DeepSeek's ``inference/model.py`` builds them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from powertrain import LLM, SamplingParams
from powertrain.builtin.grouped_moe import TorchGroupedMoE
from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.interfaces import ModelContext
from powertrain.loader import CorruptCheckpointError, ModelNotFoundError, UnsupportedCheckpointError, load_checkpoint
from powertrain.loader.fp8 import FP8_DTYPE
from powertrain.models.deepseek_v3 import DeepseekV3ForCausalLM
from powertrain.models.deepseek_v32 import DeepseekV32ForCausalLM
from powertrain.testing.checkpoints import quantize_checkpoint_fp8, write_tiny_deepseek, write_tiny_deepseek_v32
from powertrain.testing.paged import PagedRunner

#: inference/convert.py's ``mapping`` (DeepSeek-V3.2-Exp; DeepSeek-V3's lacks the last four):
#: HF module name -> (native name, dimension it is cut along for model parallelism).
CONVERT_MAPPING = {
    "embed_tokens": ("embed", 0),
    "input_layernorm": ("attn_norm", None),
    "post_attention_layernorm": ("ffn_norm", None),
    "q_proj": ("wq", 0),
    "q_a_proj": ("wq_a", None),
    "q_a_layernorm": ("q_norm", None),
    "q_b_proj": ("wq_b", 0),
    "kv_a_proj_with_mqa": ("wkv_a", None),
    "kv_a_layernorm": ("kv_norm", None),
    "kv_b_proj": ("wkv_b", 0),
    "o_proj": ("wo", 1),
    "gate": ("gate", None),
    "gate_proj": ("w1", 0),
    "down_proj": ("w2", 1),
    "up_proj": ("w3", 0),
    "norm": ("norm", None),
    "lm_head": ("head", 0),
    "scale": ("scale", None),
    "wq_b": ("wq_b", None),
    "wk": ("wk", None),
    "k_norm": ("k_norm", None),
    "weights_proj": ("weights_proj", None),
}
PROMPTS = [[0, 17, 250, 3, 99, 42, 7, 300, 11, 64, 128, 5, 77, 400, 23, 8, 190, 33], [0, 5, 6, 7, 8, 9, 10, 11, 12]]
DECODE_STEPS = 12


def to_native(name: str, num_hidden_layers: int) -> tuple[str, int | None] | None:
    """convert.py's renaming of one tensor: (native name, dimension to cut); None for what it skips.

    convert.py skips ``model.layers.61``, V3's MTP layer: here the first layer past the decoder's.
    """
    if f"model.layers.{num_hidden_layers}" in name:
        return None
    if name.startswith("model."):
        name = name[len("model.") :]
    name = name.replace("self_attn", "attn")
    name = name.replace("mlp", "ffn")
    name = name.replace("weight_scale_inv", "scale")
    name = name.replace("e_score_correction_bias", "bias")
    key = name.split(".")[-2]
    assert key in CONVERT_MAPPING, f"Key {key} not found in mapping"
    new_key, dim = CONVERT_MAPPING[key]
    return name.replace(key, new_key), dim


def convert(source: Path, target: Path, mp: int = 1) -> Path:
    """``source`` (an HF folder) as ``convert.py --model-parallel mp`` writes it, plus config.json."""
    target.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    n_local_experts = config["n_routed_experts"] // mp
    state_dicts: list[dict[str, torch.Tensor]] = [{} for _ in range(mp)]
    for file in sorted(source.glob("*.safetensors")):
        for hf_name, param in load_file(file).items():
            converted = to_native(hf_name, config["num_hidden_layers"])
            if converted is None:
                continue
            name, dim = converted
            for i in range(mp):
                new_param = param
                if "experts" in name and "shared_experts" not in name:
                    idx = int(name.split(".")[-3])
                    if idx < i * n_local_experts or idx >= (i + 1) * n_local_experts:
                        continue
                elif dim is not None:
                    assert param.size(dim) % mp == 0, f"Dimension {dim} must be divisible by {mp}"
                    shard_size = param.size(dim) // mp
                    new_param = param.narrow(dim, i * shard_size, shard_size).contiguous()
                assert name not in state_dicts[i], name
                state_dicts[i][name] = new_param
    for i in range(mp):
        save_file(state_dicts[i], target / f"model{i}-mp{mp}.safetensors")
    for file in source.iterdir():  # convert.py copies *token*; the loader needs config.json too
        if "token" in file.name or file.name in ("config.json", "generation_config.json"):
            shutil.copy2(file, target / file.name)
    return target


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    v3 = write_tiny_deepseek(root / "v3", seed=11)  # with an MTP layer, which convert.py drops
    v32 = write_tiny_deepseek_v32(root / "v32", seed=12)
    # 32x32 blocks: several per tensor, and (as 128x128 ones do on the real model) whole blocks in
    # each cut that convert.py --model-parallel 2 makes.
    v32_fp8 = quantize_checkpoint_fp8(v32, root / "v32-fp8", block=(32, 32))
    v3_fp8 = quantize_checkpoint_fp8(v3, root / "v3-fp8", block=(32, 32))
    v2_lite = write_tiny_deepseek(root / "v2-lite", variant="v2-lite", seed=13)  # q_proj, no q LoRA
    hf = {"v3": v3, "v32": v32, "v32-fp8": v32_fp8, "v3-fp8": v3_fp8, "v2-lite": v2_lite}
    native = {f"{key}-native": convert(path, root / f"{key}-native") for key, path in hf.items()}
    split = {f"{key}-mp2": convert(path, root / f"{key}-mp2", mp=2) for key, path in hf.items()}
    return hf | native | split


def load_model(path: Path) -> Any:
    checkpoint = load_checkpoint(path)
    v32 = checkpoint.config["architectures"] == ["DeepseekV32ForCausalLM"]
    context = ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=TorchReferenceAttention(),
        moe=TorchGroupedMoE(),
    )
    model = (DeepseekV32ForCausalLM if v32 else DeepseekV3ForCausalLM)(context)
    model.load_weights(checkpoint.tensors())
    return model


def prefill_logits(path: Path) -> list[torch.Tensor]:
    runner = PagedRunner(load_model(path), TorchReferenceAttention(), block_size=4, num_blocks=64)
    return runner.step([("a", PROMPTS[0]), ("b", PROMPTS[1])])


def engine_greedy(path: Path) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, num_blocks=64) as llm:
        return [list(output.outputs[0].token_ids) for output in llm.generate(PROMPTS, params)]


def test_the_oracle_writes_deepseeks_names(folders: dict[str, Path]) -> None:
    names = set(load_file(folders["v32-fp8-native"] / "model0-mp1.safetensors"))
    assert {
        "embed.weight",
        "norm.weight",
        "head.weight",
        "layers.0.attn_norm.weight",
        "layers.0.ffn_norm.weight",
        "layers.0.attn.wq_a.weight",
        "layers.0.attn.wq_a.scale",
        "layers.0.attn.q_norm.weight",
        "layers.0.attn.wkv_a.weight",
        "layers.0.attn.kv_norm.weight",
        "layers.0.attn.wkv_b.scale",
        "layers.0.attn.wo.weight",
        "layers.0.ffn.w1.weight",
        "layers.0.ffn.w2.scale",
        "layers.1.ffn.gate.weight",
        "layers.1.ffn.gate.bias",
        "layers.1.ffn.experts.7.w3.weight",
        "layers.1.ffn.shared_experts.w1.scale",
        "layers.2.attn.indexer.wq_b.weight",
        "layers.2.attn.indexer.wq_b.scale",
        "layers.2.attn.indexer.wk.scale",
        "layers.2.attn.indexer.k_norm.bias",
        "layers.2.attn.indexer.weights_proj.weight",
    } <= names
    assert "layers.2.attn.indexer.weights_proj.scale" not in names
    assert not any(name.startswith(("model.", "lm_head")) for name in names)
    assert not any(name.startswith("layers.3.") for name in load_file(folders["v3-native"] / "model0-mp1.safetensors"))


@pytest.mark.parametrize("form", ["native", "mp2"])
@pytest.mark.parametrize("kind", ["v3", "v32", "v3-fp8", "v32-fp8", "v2-lite"])
def test_native_checkpoint_yields_the_hf_tensors(folders: dict[str, Path], kind: str, form: str) -> None:
    hf, native = load_checkpoint(folders[kind]), load_checkpoint(folders[f"{kind}-{form}"])
    assert native.fp8_block == hf.fp8_block
    mtp = f"model.layers.{hf.config['num_hidden_layers']}."
    theirs = {name: tensor for name, tensor in hf.tensors() if not name.startswith(mtp)}
    ours = dict(native.tensors())
    assert sorted(ours) == sorted(theirs)
    assert sorted(native.tensor_names) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    assert native.config.get("num_nextn_predict_layers", 0) == 0  # convert.py drops the MTP layer
    assert {key: value for key, value in native.config.items() if key != "num_nextn_predict_layers"} == {
        key: value for key, value in hf.config.items() if key != "num_nextn_predict_layers"
    }


def test_v32_fp8_checkpoint_stores_the_indexer_as_deepseek_does(folders: dict[str, Path]) -> None:
    stored = load_file(folders["v32-fp8"] / "model.safetensors")
    prefix = "model.layers.1.self_attn.indexer."
    for name in ("wq_b", "wk"):
        assert stored[f"{prefix}{name}.weight"].dtype == FP8_DTYPE
        assert stored[f"{prefix}{name}.weight_scale_inv"].dtype == torch.float32
    assert stored[f"{prefix}weights_proj.weight"].dtype == torch.float32
    assert f"{prefix}weights_proj.weight_scale_inv" not in stored
    # Dequantized on load, close to the float weights the FP8 ones were made from.
    original = load_file(folders["v32"] / "model.safetensors")
    loaded = dict(load_checkpoint(folders["v32-fp8-native"]).tensors())
    for name in ("wq_b", "wk"):
        weight = loaded[f"{prefix}{name}.weight"]
        reference = original[f"{prefix}{name}.weight"]
        assert weight.dtype == torch.float32
        assert (weight - reference).abs().max() <= 0.07 * reference.abs().max(), name


@pytest.mark.parametrize("form", ["native", "mp2"])
@pytest.mark.parametrize("kind", ["v3", "v32", "v3-fp8", "v32-fp8"])
def test_native_logits_and_greedy_equal_the_hf_checkpoints(folders: dict[str, Path], kind: str, form: str) -> None:
    for hf_logits, native_logits in zip(
        prefill_logits(folders[kind]), prefill_logits(folders[f"{kind}-{form}"]), strict=True
    ):
        assert torch.equal(native_logits, hf_logits)
    hf_tokens = engine_greedy(folders[kind])
    assert engine_greedy(folders[f"{kind}-{form}"]) == hf_tokens
    assert all(len(tokens) == DECODE_STEPS for tokens in hf_tokens)


def rewrite(source: Path, target: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(source, target)
    (target / "model0-mp1.safetensors").unlink()
    save_file(tensors, target / "model0-mp1.safetensors")
    return target


def test_a_checkpoint_mixing_both_namings_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    native = load_file(folders["v32-native"] / "model0-mp1.safetensors")
    native["model.norm.weight"] = native.pop("norm.weight")
    mixed = rewrite(folders["v32-native"], tmp_path / "mixed", native)
    with pytest.raises(CorruptCheckpointError, match="mixes Hugging Face tensor names") as error:
        load_checkpoint(mixed)
    assert "'model.norm.weight'" in str(error.value) and "'embed.weight'" in str(error.value)
    assert str(mixed) in str(error.value)


def test_a_native_name_convert_never_writes_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    native = load_file(folders["v3-native"] / "model0-mp1.safetensors")
    native["layers.0.attn.wq_c.weight"] = native["layers.0.attn.wq_a.weight"].clone()
    odd = rewrite(folders["v3-native"], tmp_path / "odd", native)
    with pytest.raises(UnsupportedCheckpointError, match=r"'layers\.0\.attn\.wq_c\.weight'.*convert\.py"):
        load_checkpoint(odd)


def test_model_parallel_files_are_glued_back(folders: dict[str, Path]) -> None:
    files = [load_file(folders["v32-fp8-mp2"] / f"model{rank}-mp2.safetensors") for rank in range(2)]
    whole = load_file(folders["v32-fp8-native"] / "model0-mp1.safetensors")
    for name, dim in [("layers.1.attn.wo.weight", 1), ("layers.1.attn.wo.scale", 1), ("layers.1.attn.wq_b.weight", 0)]:
        assert torch.equal(torch.cat([files[0][name], files[1][name]], dim), whole[name]), name
    for name in ("embed.weight", "head.weight", "layers.1.attn.wkv_b.weight", "layers.1.ffn.shared_experts.w2.scale"):
        assert not torch.equal(files[0][name], files[1][name]), name  # cut, not copied
    assert "layers.1.ffn.experts.0.w1.weight" in files[0] and "layers.1.ffn.experts.0.w1.weight" not in files[1]
    assert torch.equal(files[0]["layers.1.attn.indexer.wq_b.weight"], files[1]["layers.1.attn.indexer.wq_b.weight"])


def test_incomplete_or_mixed_model_parallel_files_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    partial = shutil.copytree(folders["v3-mp2"], tmp_path / "partial")
    (partial / "model1-mp2.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match="lacks model1-mp2.safetensors"):
        load_checkpoint(partial)
    mixed = shutil.copytree(folders["v3-mp2"], tmp_path / "mixed")
    shutil.copy2(folders["v3-native"] / "model0-mp1.safetensors", mixed)
    with pytest.raises(CorruptCheckpointError, match="one convert.py run"):
        load_checkpoint(mixed)


def test_a_folder_without_config_says_where_to_get_one(folders: dict[str, Path], tmp_path: Path) -> None:
    bare = shutil.copytree(folders["v3-native"], tmp_path / "bare")
    (bare / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="DeepSeek native checkpoint.*copy config.json"):
        load_checkpoint(bare)
