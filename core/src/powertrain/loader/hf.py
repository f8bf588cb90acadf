"""Hugging Face checkpoint folders: config.json, safetensors weights, tokenizer.json, chat template.

Weights are read only from safetensors. Pickled weights (``*.bin``, ``*.pt``) are refused: loading
a pickle runs whatever code it contains.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog
import tokenizers
import torch
from safetensors import SafetensorError, safe_open

from powertrain.loader.checkpoint import Checkpoint
from powertrain.loader.deepseek_native import (
    cut_dim,
    hf_names,
    is_deepseek,
    model_parallel_files,
    without_dropped_mtp,
)
from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError
from powertrain.loader.fp4 import PACKED_STORAGE, fp4_experts_from_config, scale_name
from powertrain.loader.fp8 import SCALE_SUFFIX, fp8_block_from_config
from powertrain.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def load_hf_folder(folder: Path) -> Checkpoint:
    """Read config, tokenizer and the safetensors headers now; tensor data when ``tensors()`` is iterated."""
    config = with_both_rope_spellings(with_text_config_lifted(read_json(folder / "config.json", required=True)))
    generation_config = read_json(folder / "generation_config.json") or {}
    fp8_block = fp8_block_from_config(config, source=str(folder / "config.json"))
    fp4_experts = fp4_experts_from_config(config, source=str(folder / "config.json"))
    deepseek = is_deepseek(config)  # only these may come in DeepSeek's native names
    parallel = model_parallel_files(folder) if deepseek else None
    if parallel is not None:  # DeepSeek native, cut over several files
        read_tensors, tensor_names = _model_parallel_reader(folder, parallel)
        shards: dict[Path, list[str]] = dict.fromkeys(parallel, tensor_names)
        native = True
        files: dict[str, Path] = {}  # tensors cut over several files cannot be mapped
    else:
        shards = _tensor_locations(folder)
        files = {name: shard for shard, names in shards.items() for name in names}
        shards, stored = _with_hf_names(folder, shards) if deepseek else (shards, {})
        native = bool(stored)

        def read_tensors(wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
            for shard, names in shards.items():
                with _safe_open(shard) as file:
                    for name in names:
                        if wanted(name):
                            yield name, file.get_tensor(stored.get(name, name))

        if fp8_block is not None:
            shards, stored = _with_fp8_scale_names(shards, stored)
        tensor_names = [name for names in shards.values() for name in names]
        if fp8_block is not None or fp4_experts:
            scale_of = _fp8_scales(shards) if fp8_block is not None else {}
            if fp4_experts:
                scale_of |= _fp4_scales(shards, stored)
            read_tensors, tensor_names = _paired_reader(shards, stored, scale_of)
    if native:
        config = without_dropped_mtp(config, tensor_names)
    tokenizer = _tokenizer(folder, config, generation_config)

    log.debug("hf.opened", path=str(folder), shards=len(shards), fp8_block=fp8_block, fp4_experts=fp4_experts)
    return Checkpoint(
        path=folder,
        format="safetensors",
        config=config,
        tensor_names=tuple(tensor_names),
        tokenizer=tokenizer,
        generation_config=generation_config,
        generation_source=str(folder / "generation_config.json") if generation_config else "",
        read_tensors=read_tensors,
        fp8_block=fp8_block,
        fp4_experts=fp4_experts,
        tensor_files=files,
    )


def _with_hf_names(folder: Path, shards: dict[Path, list[str]]) -> tuple[dict[Path, list[str]], Mapping[str, str]]:
    """``shards`` with HF names, and HF name -> stored name for those stored under another name
    (a checkpoint in DeepSeek's native names; empty for an HF one)."""
    renamed = hf_names((name for names in shards.values() for name in names), source=str(folder))
    if renamed is None:
        return shards, {}
    log.info("hf.native_names", path=str(folder), tensors=len(renamed))
    return {shard: [renamed[name] for name in names] for shard, names in shards.items()}, {
        hf: name for name, hf in renamed.items()
    }


def _model_parallel_reader(
    folder: Path, files: list[Path]
) -> tuple[Callable[[Callable[[str], bool]], Iterator[tuple[str, torch.Tensor]]], list[str]]:
    """A DeepSeek native checkpoint written by convert.py for several processes, read as one: the cut
    tensors concatenated back along ``cut_dim``, the copies read once, each routed expert from the
    file holding it; every ``X_scale_inv`` right after ``X``. Also returns the HF names of what it
    yields (FP8 scales folded into their weights)."""
    holders: dict[str, list[int]] = {}
    for rank, file in enumerate(files):
        for name in _header_names(file):
            holders.setdefault(name, []).append(rank)
    renamed = hf_names(holders, source=str(folder))
    if renamed is None:
        raise UnsupportedCheckpointError(
            f"{folder}: model*-mp{len(files)}.safetensors are named as DeepSeek's inference/convert.py names its "
            "output for model parallelism, but hold no DeepSeek native tensor names; powertrain cannot tell how "
            "to join them."
        )
    uncut = [name for name, ranks in holders.items() if cut_dim(name) is not None and len(ranks) != len(files)]
    if uncut:
        raise CorruptCheckpointError(
            f"{folder}: {uncut[0]!r} should be cut over all {len(files)} model*-mp{len(files)} files but is in "
            f"{len(holders[uncut[0]])}. Run DeepSeek's inference/convert.py again."
        )
    native = {hf: name for name, hf in renamed.items()}
    names = [name for name in native if not (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in native)]

    def read_tensors(wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(_safe_open(file)) for file in files]

            def read(hf: str) -> torch.Tensor:
                name = native[hf]
                dim, ranks = cut_dim(name), holders[name]
                if dim is None:
                    return opened[ranks[0]].get_tensor(name)
                return torch.cat([opened[rank].get_tensor(name) for rank in ranks], dim=dim)

            for name in names:
                if wanted(name):
                    yield name, read(name)
                    if name + SCALE_SUFFIX in native:
                        yield name + SCALE_SUFFIX, read(name + SCALE_SUFFIX)

    return read_tensors, names


def _fp8_scales(shards: Mapping[Path, list[str]]) -> dict[str, str]:
    """FP8 weight -> its ``X_scale_inv`` (HF names), for every pair the checkpoint holds."""
    names = {name for names in shards.values() for name in names}
    return {name: name + SCALE_SUFFIX for name in names if name + SCALE_SUFFIX in names}


def _with_fp8_scale_names(
    shards: dict[Path, list[str]], stored: Mapping[str, str]
) -> tuple[dict[Path, list[str]], dict[str, str]]:
    """DeepSeek-V4's release names an FP8 weight's block scales ``X.scale`` (ue8m0) where the HF
    form says ``X.weight_scale_inv``: give those the HF name (``stored`` keeps where they are).
    A ``.scale`` counts only beside a weight the header types as float8 e4m3 (FP4 experts'
    ``.scale`` sit beside bytes)."""
    renamed: dict[str, str] = {}
    for shard, names in shards.items():
        present = set(names)
        candidates = [name for name in names if name.endswith(".scale") and name[: -len("scale")] + "weight" in present]
        if not candidates:
            continue
        with _safe_open(shard) as file:
            for name in candidates:
                weight = name[: -len("scale")] + "weight"
                if file.get_slice(stored.get(weight, weight)).get_dtype() == "F8_E4M3":
                    renamed[name] = weight + SCALE_SUFFIX
    if not renamed:
        return shards, dict(stored)
    log.info("hf.fp8_scale_names", tensors=len(renamed))
    return (
        {shard: [renamed.get(name, name) for name in names] for shard, names in shards.items()},
        {**stored, **{hf: stored.get(name, name) for name, hf in renamed.items()}},
    )


def _fp4_scales(shards: Mapping[Path, list[str]], stored: Mapping[str, str]) -> dict[str, str]:
    """Packed FP4 weight ``X.weight`` -> its ``X.scale``: the weights the headers type as bytes
    (I8, U8, F4) that have a ``.scale`` sibling. Shapes are checked when the pair is dequantized."""
    names = {name for names in shards.values() for name in names}
    pairs = {}
    for shard, shard_names in shards.items():
        candidates = [name for name in shard_names if scale_name(name) in names]
        if not candidates:
            continue
        with _safe_open(shard) as file:
            for name in candidates:
                if file.get_slice(stored.get(name, name)).get_dtype() in PACKED_STORAGE:
                    pairs[name] = scale_name(name)
    return pairs


def _paired_reader(
    shards: Mapping[Path, list[str]], stored: Mapping[str, str], scale_of: Mapping[str, str]
) -> tuple[Callable[[Callable[[str], bool]], Iterator[tuple[str, torch.Tensor]]], list[str]]:
    """Read a quantized checkpoint in stored order but with each weight's scale (``scale_of``: FP8
    ``X_scale_inv``, FP4 ``X.scale``) right after it, even when another shard holds it, so the
    dequantizing streams never hold a weight back. Also returns the names those streams yield
    (scales folded into their weights). Names are HF names; ``stored`` gives the name in the file
    where it differs."""
    location = {name: shard for shard, names in shards.items() for name in names}
    scales = set(scale_of.values())
    plan = {
        shard: [(name, location.get(scale_of.get(name, ""))) for name in names if name not in scales]
        for shard, names in shards.items()
    }

    def read_tensors(wanted: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        for shard, entries in plan.items():
            with _safe_open(shard) as file:
                for name, scale_shard in entries:
                    if not wanted(name):
                        continue
                    yield name, file.get_tensor(stored.get(name, name))
                    if scale_shard is None:
                        continue
                    scale = scale_of[name]
                    if scale_shard == shard:
                        yield scale, file.get_tensor(stored.get(scale, scale))
                    else:
                        with _safe_open(scale_shard) as other:
                            yield scale, other.get_tensor(stored.get(scale, scale))

    return read_tensors, [name for entries in plan.values() for name, _ in entries]


def with_text_config_lifted(config: dict[str, Any]) -> dict[str, Any]:
    """A composite config (``text_config`` beside ``vision_config``, as DeepSeek-V4.1's) read as
    its text model's, the way transformers' ``get_text_config`` does: ``text_config``'s keys
    are lifted to the top where the top does not set them (the engine reads ``vocab_size``,
    ``max_position_embeddings``, ``eos_token_id`` there); the nested one stays for the model."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return config
    return {**text, **config}


def with_both_rope_spellings(config: dict[str, Any]) -> dict[str, Any]:
    """Give both rope spellings: ``rope_theta`` + ``rope_scaling`` (transformers 4) and ``rope_parameters`` (5).

    Checkpoints on the Hub use the first, folders saved by transformers >= 5 only the second;
    model code may read either.
    """
    parameters = config.get("rope_parameters")
    if isinstance(parameters, Mapping) and "rope_theta" in parameters and "rope_theta" not in config:
        config["rope_theta"] = parameters["rope_theta"]
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
        config.setdefault("rope_scaling", None if scaling.get("rope_type", "default") == "default" else scaling)
    elif "rope_theta" in config and "rope_parameters" not in config:
        scaling = dict(config.get("rope_scaling") or {})
        if "type" in scaling:  # the older spelling of rope_type
            scaling.setdefault("rope_type", scaling["type"])
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"], **scaling}
    return config


def _tensor_locations(folder: Path) -> dict[Path, list[str]]:
    """Shard file -> names of the tensors it holds, checked against the index if there is one."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise CorruptCheckpointError(
                f"{index_path}: no 'weight_map' (tensor name -> shard file). Re-download the checkpoint or save it "
                "again with transformers' save_pretrained(..., safe_serialization=True)."
            )
        shards: dict[Path, list[str]] = {}
        for name, shard_name in weight_map.items():
            shards.setdefault(folder / shard_name, []).append(name)
        missing = [str(shard.name) for shard in shards if not shard.is_file()]
        if missing:
            raise CorruptCheckpointError(
                f"{folder}: shard(s) {', '.join(missing)} named in {INDEX_FILE} are missing. Download them again "
                "(an interrupted download leaves this state)."
            )
        for shard, names in shards.items():
            present = set(_header_names(shard))
            absent = [name for name in names if name not in present]
            if absent:
                raise CorruptCheckpointError(
                    f"{shard}: {INDEX_FILE} places tensor {absent[0]!r}"
                    + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else "")
                    + " in this shard but the shard does not hold it. Re-download the checkpoint."
                )
        return shards

    single = folder / SINGLE_FILE
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if files:
        shards, seen = {}, {}
        for file in files:
            names = _header_names(file)
            for name in names:
                if name in seen:
                    raise CorruptCheckpointError(
                        f"{folder}: tensor {name!r} is in both {seen[name].name} and {file.name}; keep only the "
                        f"checkpoint's own weights files (or add a {INDEX_FILE})."
                    )
                seen[name] = file
            shards[file] = names
        return shards

    pickles = sorted(path.name for path in folder.iterdir() if path.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise UnsupportedCheckpointError(
            f"{folder}: weights must be safetensors, but this folder has only pickled weights ({', '.join(pickles)}). "
            "powertrain never loads pickles (unpickling runs arbitrary code). Convert once, in an environment you "
            "trust: `AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder, "
            "safe_serialization=True)` with transformers, then copy the tokenizer files along."
        )
    raise CorruptCheckpointError(
        f"{folder}: config.json is there but no weights: expected {SINGLE_FILE}, or {INDEX_FILE} with its shards. "
        "Download the weights files too."
    )


def _header_names(path: Path) -> list[str]:
    with _safe_open(path) as file:
        return list(file.keys())


def _safe_open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise CorruptCheckpointError(
            f"{path}: not a readable safetensors file ({error}); it is truncated or damaged. Download it again."
        ) from error


def _tokenizer(folder: Path, config: Mapping[str, Any], generation_config: Mapping[str, Any]) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        others = [name for name in ("tokenizer.model", "vocab.json", "merges.txt") if (folder / name).is_file()]
        raise UnsupportedCheckpointError(
            f"{folder}: tokenizer.json is missing"
            + (f" (found {', '.join(others)}, which powertrain does not read)" if others else "")
            + ". Create it once with transformers: `AutoTokenizer.from_pretrained(folder).save_pretrained(folder)` "
            "writes tokenizer.json next to the other files."
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises plain Exception for malformed files
        raise CorruptCheckpointError(f"{path}: cannot be read as a tokenizer ({error}). Download it again.") from error

    tokenizer_config = read_json(folder / "tokenizer_config.json") or {}

    def special(name: str) -> str | None:
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):  # serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            return value
        for source in (config, generation_config):
            token_id = _first_id(source.get(f"{name}_id"))
            if token_id is not None and (token := backend.id_to_token(token_id)) is not None:
                return token
        return None

    extra_eos = [*_ids(config.get("eos_token_id")), *_ids(generation_config.get("eos_token_id"))]
    return Tokenizer(
        backend,
        bos_token=special("bos_token"),
        eos_token=special("eos_token"),
        unk_token=special("unk_token"),
        pad_token=special("pad_token"),
        chat_template=_chat_template(folder, tokenizer_config),
        extra_eos_token_ids=extra_eos,
        source=str(folder),
    )


def _chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers >= 4.43 saves it there), else tokenizer_config.json's."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        template = named.get("default")
    if template is None and (legacy := read_json(folder / "chat_template.json")):
        template = legacy.get("chat_template")
    return template if isinstance(template, str) else None


def read_json(path: Path, *, required: bool = False) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise CorruptCheckpointError(f"{path} is missing. Download the checkpoint again.")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({error}). Download it again.") from error
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{path}: expected a JSON object, found {type(value).__name__}. Download the checkpoint again."
        )
    return value


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def _first_id(value: Any) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None
