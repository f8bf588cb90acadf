"""DeepSeek's native tensor names -> Hugging Face names, for V2 / V3 / V3.1 / R1 / V3.2 checkpoints.

DeepSeek's own inference code (``inference/model.py``) names tensors differently from the HF
release; its ``inference/convert.py`` (deepseek-ai/DeepSeek-V3, and deepseek-ai/DeepSeek-V3.2-Exp
which adds the indexer's entries) turns an HF checkpoint into that form:

- drop ``model.``; ``self_attn`` -> ``attn``, ``mlp`` -> ``ffn``; ``weight_scale_inv`` -> ``scale``;
  ``e_score_correction_bias`` -> ``bias``;
- rename the module that owns the tensor (the second-to-last name part) by ``NATIVE_MODULES``
  read backwards (``q_a_proj`` -> ``wq_a``, ``gate_proj`` -> ``w1``, ``lm_head`` -> ``head``, ...);
  the indexer's modules (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``) keep their names;
- drop the MTP layer (``model.layers.61``), so a native checkpoint has none.

Nothing is transposed, fused or split, so one process's file (``model0-mp1.safetensors``) holds
the HF tensors under other names, minus the MTP layer (``without_dropped_mtp`` makes the config
agree). With ``--model-parallel N > 1`` convert.py writes N files, cutting the column- and
row-parallel weights (``cut_dim``) and dealing out the routed experts; the loader glues them back
(``model_parallel_files``).

``hf_names(names)`` is the one place this is undone: the HF loader calls it on every
safetensors checkpoint of a DeepSeek architecture (``is_deepseek``), and model code only ever
sees HF names (FP8 ``X.scale`` tensors become ``X.weight_scale_inv`` and are dequantized like
the HF release's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError

log = structlog.get_logger(__name__)

#: config.json architectures whose checkpoints DeepSeek's convert.py can have renamed.
ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"})
#: Native module name -> HF module name: convert.py's ``mapping`` read backwards.
NATIVE_MODULES = {
    "embed": "embed_tokens",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
    "gate": "gate",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
    "norm": "norm",
    "head": "lm_head",
}
#: V3.2's Lightning Indexer: its modules have the same names in both forms.
INDEXER_MODULES = frozenset({"wq_b", "wk", "k_norm", "weights_proj"})
#: Native tensors outside the decoder layers (everything else is ``layers.N. ...``).
_NATIVE_TOP = frozenset({"embed.weight", "norm.weight", "head.weight"})
#: What tells a native checkpoint: the embedding or any decoder layer.
_NATIVE_MARK = re.compile(r"embed\.weight$|layers\.\d+\.")
#: Native module -> the dimension convert.py's ``mapping`` cuts it along; absent: not cut.
_CUT_DIM = {"embed": 0, "wq": 0, "wq_b": 0, "wkv_b": 0, "wo": 1, "w1": 0, "w2": 1, "w3": 0, "head": 0}
#: convert.py's output files: ``model{rank}-mp{model_parallel}.safetensors``.
_MP_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors")


def is_deepseek(config: Mapping[str, Any]) -> bool:
    """Whether config.json names a DeepSeek architecture: only those may be stored in native names."""
    architectures = config.get("architectures")
    return isinstance(architectures, list) and any(name in ARCHITECTURES for name in architectures)


def hf_names(names: Iterable[str], *, source: str = "") -> dict[str, str] | None:
    """Stored name -> HF name when ``names`` are DeepSeek's native names; None when they are not.

    Raises ``CorruptCheckpointError`` for a checkpoint that mixes HF and native names (two
    sources were merged), and ``UnsupportedCheckpointError`` for a native name convert.py
    never writes.
    """
    where = f"{source}: " if source else ""
    names = list(names)
    if not any(_NATIVE_MARK.match(name) for name in names):
        return None
    native = [name for name in names if name in _NATIVE_TOP or name.startswith("layers.")]
    hf = [name for name in names if name.startswith(("model.", "lm_head."))]
    if hf:
        raise CorruptCheckpointError(
            f"{where}the checkpoint mixes Hugging Face tensor names ({_examples(hf)}) with DeepSeek's native ones "
            f"({_examples(native)}); it holds {len(hf)} of the first kind and {len(native)} of the second. "
            "Use one form only: the HF release as downloaded, or all of it converted by DeepSeek's "
            "inference/convert.py."
        )
    renamed = {name: _hf_name(name) for name in names}
    unknown = [name for name, hf_name in renamed.items() if hf_name is None]
    if not unknown:
        return {name: hf_name for name, hf_name in renamed.items() if hf_name is not None}
    raise UnsupportedCheckpointError(
        f"{where}the checkpoint has DeepSeek's native tensor names, but {_examples(unknown)} "
        f"({len(unknown)} in all) are none that DeepSeek's inference/convert.py writes, so they have no "
        "Hugging Face name. Load the HF release instead, or convert it again with that script."
    )


def without_dropped_mtp(config: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``config`` with ``num_nextn_predict_layers`` 0 when the (HF-named) ``names`` hold no MTP layer:
    convert.py drops it, but the config.json copied from the HF release still counts it."""
    layers, depth = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
    if not depth or not isinstance(layers, int) or any(name.startswith(f"model.layers.{layers}.") for name in names):
        return config
    log.info("native.no_mtp_layers", num_nextn_predict_layers=depth)
    return {**config, "num_nextn_predict_layers": 0}


def model_parallel_files(folder: Path) -> list[Path] | None:
    """convert.py's files for ``--model-parallel N > 1``, in rank order; None when there are none.

    Each file then holds a 1/N cut of some tensors (``cut_dim``), 1/N of the routed experts and
    a copy of the rest. Incomplete or ambiguous sets are refused."""
    found = {file: _MP_FILE.fullmatch(file.name) for file in sorted(folder.glob("*.safetensors"))}
    sizes = {int(match.group(2)) for match in found.values() if match}
    if sizes <= {1}:
        return None
    others = [file.name for file, match in found.items() if not match]
    if len(sizes) > 1 or others:
        raise CorruptCheckpointError(
            f"{folder}: DeepSeek native files for model parallelism {sorted(sizes)} together with "
            f"{others or 'each other'}; keep the files of one convert.py run only."
        )
    (size,) = sizes
    ranks = {int(match.group(1)): file for file, match in found.items() if match}
    if sorted(ranks) != list(range(size)):
        missing = [f"model{rank}-mp{size}.safetensors" for rank in range(size) if rank not in ranks]
        raise CorruptCheckpointError(
            f"{folder}: a DeepSeek native checkpoint split over {size} files lacks {', '.join(missing)}. "
            "Copy all of convert.py's output."
        )
    return [ranks[rank] for rank in range(size)]


def cut_dim(name: str) -> int | None:
    """The dimension convert.py cuts native tensor ``name`` along for ``--model-parallel N > 1``:
    its ``mapping``'s second column, FP8 scales cut like their weight; None for tensors every file
    holds whole (norms, the router, ``wq_a``, ``wkv_a``, the indexer) and for routed experts (each
    in one file)."""
    *path, module, _ = name.split(".")
    if "experts" in path or (path and path[-1] == "indexer"):
        return None
    return _CUT_DIM.get(module)


def _hf_name(name: str) -> str | None:
    *path, module, leaf = name.split(".")
    if not path:
        if name not in _NATIVE_TOP:
            return None
        prefix = "" if module == "head" else "model."
        return f"{prefix}{NATIVE_MODULES[module]}.{leaf}"
    if path[0] != "layers" or len(path) < 2 or not path[1].isdigit():
        return None
    if path[-1] == "indexer":
        if module not in INDEXER_MODULES:
            return None
    elif module in NATIVE_MODULES:
        module = NATIVE_MODULES[module]
    else:
        return None
    if leaf == "scale":
        leaf = "weight_scale_inv"
    elif module == "gate" and leaf == "bias":
        leaf = "e_score_correction_bias"
    path = [{"attn": "self_attn", "ffn": "mlp"}.get(part, part) for part in path]
    return ".".join(["model", *path, module, leaf])


def _examples(names: list[str], shown: int = 3) -> str:
    return ", ".join(repr(name) for name in names[:shown]) + (", ..." if len(names) > shown else "")
