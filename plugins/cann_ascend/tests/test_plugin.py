"""Registration and detection: the pack loads anywhere and says exactly why an NPU is
not usable here (torch_npu and CANN are what these tests stand in for)."""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
import types
from pathlib import Path

import attrs
import pytest

from powertrain.assemble.loading import kv_budget_bytes
from powertrain.config import EngineConfig
from powertrain.testing import PluginContract
from powertrain_cann_ascend import plugin, support


class TestContract(PluginContract):
    plugin = "cann_ascend"


PACKAGE_DIR = Path(support.__file__).resolve().parent
TESTING = "powertrain_cann_ascend.testing"


def _serving_modules() -> dict[str, Path]:
    """Every module of the pack outside its ``testing`` subpackage, by dotted name."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[1:2] == ("testing",):
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> set[str]:
    """Absolute names of every import statement in the file, lazy ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_testing(name: str) -> bool:
    return name == TESTING or name.startswith(TESTING + ".")


def test_serving_code_never_imports_the_test_doubles() -> None:
    """The stand-ins encode our reading of torch_npu's docs, not the hardware: serving
    with them would compute plausible numbers on the CPU, so no serving module may reach
    ``powertrain_cann_ascend.testing``, neither in its source nor once imported."""
    modules = _serving_modules()
    assert "powertrain_cann_ascend.attention" in modules and "powertrain_cann_ascend.plugin" in modules
    for module, path in modules.items():
        bad = sorted(filter(_is_testing, _imported_names(module, path)))
        assert not bad, f"{path} imports the test doubles {bad}: serving code must use torch_npu's operators"
    probe = (
        "import importlib, sys\n"
        f"for m in {sorted(modules)!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in sys.modules if m == {TESTING!r} or m.startswith({TESTING + '.'!r})))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing the serving modules loaded {done.stdout.strip()}"


def test_plugins_command_reports_the_pack_unavailable_with_the_reason() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "powertrain.cli", "plugins", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (row,) = [p for p in json.loads(done.stdout)["plugins"] if p["name"] == "cann_ascend"]
    assert row["status"] == "unavailable"
    assert "torch_npu is not installed" in row["reason"]
    assert row["reason"].count("torch_npu is not installed") == 1


def test_plugins_command_says_which_deepseek_capabilities_are_absent_and_why() -> None:
    """V3.2's sparse MLA and indexer are declared (npu_sparse_flash_attention,
    npu_lightning_indexer); V4's attention is not mapped to torch_npu, and the pack says so
    (with the reason) rather than declaring it, in the table and the JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "powertrain.cli", "plugins", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (row,) = [p for p in json.loads(done.stdout)["plugins"] if p["name"] == "cann_ascend"]
    (attention,) = row["provides"]["attention"]
    (record,) = plugin.powertrain_attention_backends()
    assert {"sparse-mla", "lightning-indexer"} <= record.capabilities
    assert set(attention["absent"]) == {"v4-attention"}
    (moe,) = row["provides"]["moe"]
    assert set(moe["absent"]) == {"fp4"}
    table = subprocess.run(
        [sys.executable, "-m", "powertrain.cli", "plugins"], capture_output=True, text=True, timeout=120
    )
    assert "attention ascend-cann: no v4-attention: no documented torch_npu operator" in table.stdout


def test_a_refused_selection_names_the_absent_capability_and_its_reason() -> None:
    from powertrain.interfaces import Availability
    from powertrain.selection import Candidate

    (record,) = plugin.powertrain_attention_backends()
    candidate = Candidate(
        record=record,
        plugin="cann_ascend",
        distribution="powertrain-cann-ascend",
        availability=Availability.yes(),
        missing=frozenset({"v4-attention", "batch-invariant"}),
    )
    described = candidate.describe()
    assert "lacks batch-invariant, v4-attention" in described
    assert f"v4-attention: {record.absent['v4-attention']}" in described
    assert "batch-invariant:" not in described  # not listed as absent: nothing more to say


def assert_npu_facts(info: object) -> None:
    """What core does on an NPU comes from these facts, found NPU or not (no platform branches in core)."""
    assert info.dist_backend == "hccl" and info.device_per_rank and not info.host
    assert info.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert info.free_memory is support.npu_free_memory and info.set_device is support.npu_set_device
    assert info.keeps_fp8_weights and not info.barrier_needs_device_ids
    assert info.auto_dtype is None and not info.shares_host_cores and not info.packed_linear_dtypes


def test_no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "_installed", lambda module: False)
    info = support.detect_npu()
    assert not info.available and info.dist_backend == "hccl"
    assert "torch_npu is not installed" in info.availability.reason
    assert_npu_facts(info)


def test_no_cann_toolkit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(support, "_installed", lambda module: True)
    for name in support.CANN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(support, "CANN_DEFAULT_PATHS", (str(tmp_path / "absent"),))
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    reason = support.detect_npu().availability.reason
    assert "CANN toolkit was not found" in reason and "ASCEND_HOME_PATH" in reason
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in reason  # how to keep `import torch` working


def test_torch_npu_import_failure_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(support, "_installed", lambda module: True)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))

    def broken(name: str) -> types.ModuleType:
        raise OSError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(support.importlib, "import_module", broken)
    reason = support.detect_npu().availability.reason
    assert "import torch_npu failed" in reason and "libhccl.so" in reason and str(tmp_path) in reason


def _fake_torch_npu(count: int, free_bytes: int = 0, calls: list | None = None) -> types.ModuleType:
    """Only what detection and the platform facts read: torch_npu.npu's device count, name and
    properties, free memory and device selection (these two record what they were asked)."""
    calls = [] if calls is None else calls

    def mem_get_info(device: object) -> tuple[int, int]:
        calls.append(("mem_get_info", device))
        return free_bytes, 64 * 2**30

    npu = types.SimpleNamespace(
        device_count=lambda: count,
        get_device_name=lambda index: "Ascend910B3",
        get_device_properties=lambda index: types.SimpleNamespace(total_memory=64 * 2**30),
        mem_get_info=mem_get_info,
        set_device=lambda device: calls.append(("set_device", device)),
    )
    return types.SimpleNamespace(npu=npu)  # type: ignore[return-value]


@pytest.mark.parametrize("count", [0, 8])
def test_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, count: int) -> None:
    monkeypatch.setattr(support, "_installed", lambda module: True)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setattr(support.importlib, "import_module", lambda name: _fake_torch_npu(count))
    info = support.detect_npu()
    if count == 0:
        assert not info.available and "no Ascend NPU visible" in info.availability.reason
    else:
        assert info.available and info.device_count == 8 and info.device_name == "Ascend910B3"
        assert info.total_memory_bytes == 64 * 2**30 and info.dist_backend == "hccl"
    assert_npu_facts(info)


def test_the_kv_cache_is_sized_from_free_npu_memory_through_the_platform_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Mocked, because torch_npu and an NPU cannot exist on this machine: a fake torch_npu
    reports a random amount of free memory. The pack's own record detects it, and assembly
    sizes the KV cache from it exactly as it does from torch.cuda.mem_get_info on CUDA."""
    free = random.randrange(2**30, 60 * 2**30)
    calls: list = []
    monkeypatch.setattr(support, "_installed", lambda module: True)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setattr(support.importlib, "import_module", lambda name: _fake_torch_npu(8, free, calls))
    (record,) = plugin.powertrain_platforms()
    info = record.detect()
    assert info.available
    # Stands in for torch.device("npu", 0), which parses only once torch_npu has registered "npu".
    device = object()

    assert kv_budget_bytes(EngineConfig(), info, device) == int(free * 0.85), f"free={free}"
    assert calls == [("mem_get_info", device)]
    info.set_device(device)
    assert calls[-1] == ("set_device", device)
    config = EngineConfig()
    explicit = attrs.evolve(config, cache=attrs.evolve(config.cache, memory_gib=1.5))
    assert kv_budget_bytes(explicit, info, device) == int(1.5 * 2**30)  # [cache] memory_gib still wins
    assert len(calls) == 2
