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
agree). With ``--model-parallel N > 1`` convert.py also cuts tensors
into N files; those are refused here (convert again with ``--model-parallel 1``).

``hf_names(names)`` is the one place this is undone: the HF loader calls it on every
safetensors checkpoint, and model code only ever sees HF names (FP8 ``X.scale`` tensors become
``X.weight_scale_inv`` and are dequantized like the HF release's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError

log = structlog.get_logger(__name__)

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
#: convert.py's output files: ``model{rank}-mp{model_parallel}.safetensors``.
_MP_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors")


def hf_names(names: Iterable[str], *, source: str = "") -> dict[str, str] | None:
    """Stored name -> HF name when ``names`` are DeepSeek's native names; None when they are not.

    Raises ``CorruptCheckpointError`` for a checkpoint that mixes HF and native names (two
    sources were merged), and ``UnsupportedCheckpointError`` for a native name convert.py
    never writes.
    """
    where = f"{source}: " if source else ""
    names = list(names)
    native = [name for name in names if _looks_native(name)]
    if not native:
        return None
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
    if unknown:
        raise UnsupportedCheckpointError(
            f"{where}the checkpoint has DeepSeek's native tensor names, but {_examples(unknown)} "
            f"({len(unknown)} in all) are none that DeepSeek's inference/convert.py writes, so they have no "
            "Hugging Face name. Load the HF release instead, or convert it again with that script."
        )
    return renamed  # type: ignore[return-value]  # no None left


def without_dropped_mtp(config: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``config`` with ``num_nextn_predict_layers`` 0 when the (HF-named) ``names`` hold no MTP layer:
    convert.py drops it, but the config.json copied from the HF release still counts it."""
    layers, depth = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
    if not depth or not isinstance(layers, int) or any(name.startswith(f"model.layers.{layers}.") for name in names):
        return config
    log.info("native.no_mtp_layers", num_nextn_predict_layers=depth)
    return {**config, "num_nextn_predict_layers": 0}


def check_native_layout(folder: Path) -> None:
    """Refuse, saying what to do, convert.py's output for several processes (``--model-parallel`` > 1):
    its tensors are cut over the files. (A folder without config.json, as convert.py leaves it, is
    explained by ``resolve.py``.)"""
    parallel = sorted(
        file.name
        for file in folder.glob("model*-mp*.safetensors")
        if (match := _MP_FILE.fullmatch(file.name)) and int(match.group(2)) > 1
    )
    if parallel:
        raise UnsupportedCheckpointError(
            f"{folder}: {', '.join(parallel[:4])}{', ...' if len(parallel) > 4 else ''} hold a DeepSeek native "
            "checkpoint split for model parallelism; powertrain reads the unsplit one. Run DeepSeek's "
            "inference/convert.py again with --model-parallel 1 (or load the Hugging Face release)."
        )


def _looks_native(name: str) -> bool:
    return name in _NATIVE_TOP or name.startswith("layers.")


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
