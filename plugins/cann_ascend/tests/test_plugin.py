"""Registration and detection: the pack loads anywhere and says exactly why an NPU is
not usable here (torch_npu and CANN are what these tests stand in for)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from powertrain.testing import PluginContract
from powertrain_cann_ascend import support


class TestContract(PluginContract):
    plugin = "cann_ascend"


def test_plugins_command_reports_the_pack_unavailable_with_the_reason() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "powertrain.cli", "plugins", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (row,) = [p for p in json.loads(done.stdout)["plugins"] if p["name"] == "cann_ascend"]
    assert row["status"] == "unavailable"
    assert "torch_npu is not installed" in row["reason"]
    assert row["reason"].count("torch_npu is not installed") == 1


def test_no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "_installed", lambda module: False)
    info = support.detect_npu()
    assert not info.available and info.dist_backend == "hccl"
    assert "torch_npu is not installed" in info.availability.reason


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


def _fake_torch_npu(count: int) -> types.ModuleType:
    """Only what detection reads: torch_npu.npu's device count, name and properties."""
    npu = types.SimpleNamespace(
        device_count=lambda: count,
        get_device_name=lambda index: "Ascend910B3",
        get_device_properties=lambda index: types.SimpleNamespace(total_memory=64 * 2**30),
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
