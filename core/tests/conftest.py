from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["powertrain.testing"]


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (never a fixed one), torch's global generator seeded with it,
    and printed so a failure can be replayed. Module-scoped variants stay in their files."""
    import torch

    from powertrain.testing.base import fresh_seed

    value = fresh_seed()
    torch.manual_seed(value)
    print(f"seed={value}")
    return value


@pytest.fixture(scope="session")
def smollm2_hf() -> Any:
    """The oracle for the embedded SmolLM2: HF transformers' own GGUF loader on the same file.

    Session-scoped because the loader tests and the engine tests both compare against it
    and loading dequantises every tensor in Python (~15-20 s); nothing here modifies it.
    """
    transformers = pytest.importorskip("transformers")
    import torch

    from powertrain.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m").path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture
def make_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Callable[..., Path]:
    """Install a real (if tiny) distribution on sys.path: dist-info + entry points + modules.

    importlib.metadata discovers it exactly as it discovers pip-installed packages.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def make(name: str, entry_points: dict[str, str], modules: dict[str, str], version: str = "1.0") -> Path:
        dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = ["[powertrain.plugins]", *(f"{ep} = {module}" for ep, module in entry_points.items())]
        (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in modules.items():
            path = site / (module.replace(".", "/") + ".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
            # Forget the module after the test, so the next test imports its own version.
            request.addfinalizer(lambda module=module: sys.modules.pop(module, None))
        importlib.invalidate_caches()
        return site

    return make


V41_VISION_FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41_vision"


@pytest.fixture(scope="session")
def v41_vision_golden() -> dict[str, Any]:
    """What DeepSeek's official code computed for images (``fixtures/deepseek_v41_vision``)."""
    from safetensors.torch import load_file

    return load_file(V41_VISION_FIXTURES / "golden.safetensors")


@pytest.fixture(scope="session")
def v41_vision_provenance() -> dict[str, Any]:
    import json

    return json.loads((V41_VISION_FIXTURES / "provenance.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def v41_vision_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny V4.1 with its vision tower the vision fixtures were computed on."""
    from powertrain.testing.deepseek_v41 import write_tiny_deepseek_v41

    return write_tiny_deepseek_v41(tmp_path_factory.mktemp("v41-vision") / "tiny", seed=0, vision=True)
