"""The plugin template installed for real into a fresh environment.

Builds wheels of the core and the template, installs them (with the locked
dependencies) into a new virtual environment, and drives the installed
``powertrain`` command there: discovery through the entry point, selection and
disabling by config, and a broken import reported as such.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _uv() -> str:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is required to build a fresh environment (pip install uv)")
    return uv


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    uv = _uv()
    where = tmp_path_factory.mktemp("template-env")
    venv = where / "venv"
    requirements = where / "requirements.txt"
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}
    env.pop("UV_PROJECT_ENVIRONMENT", None)
    steps = [
        [uv, "venv", "-q", "--python", str(Path(os.sys.executable)), str(venv)],
        [uv, "export", "--frozen", "--no-dev", "--no-emit-workspace", "--no-hashes", "-q", "-o", str(requirements)],
        [uv, "pip", "install", "-q", "-r", str(requirements)],
        # Real wheel builds, not editable links: the entry point must come from metadata.
        [uv, "pip", "install", "-q", "--no-deps", "--reinstall", "./core", "./examples/plugin-template"],
    ]
    for step in steps:
        proc = subprocess.run(step, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(step)} failed:\n{proc.stderr}"
    return venv


def powertrain(venv: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("POWERTRAIN_")}
    environment.update(env or {})
    return subprocess.run(
        [str(venv / "bin" / "powertrain"), *args], capture_output=True, text=True, timeout=300, env=environment
    )


def plugins(venv: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    proc = powertrain(venv, "plugins", "--json", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}


def check(venv: Path, tmp_path: Path, toml: str) -> tuple[int, dict, str]:
    path = tmp_path / "engine.toml"
    path.write_text(toml)
    proc = powertrain(venv, "config", "check", str(path), "--json")
    rows = json.loads(proc.stdout)["components"] if proc.stdout else []
    return proc.returncode, {row["kind"]: row for row in rows}, proc.stderr


def installed_plugin_module(venv: Path) -> Path:
    [path] = venv.glob("lib/python*/site-packages/powertrain_sdpa_example/plugin.py")
    return path


def test_discovered_through_its_entry_point(venv: Path) -> None:
    found = plugins(venv)["sdpa-example"]
    assert (found["status"], found["source"], found["distribution"]) == (
        "available",
        "entry-point",
        "powertrain-sdpa-example",
    )
    assert found["provides"] == {"attention": [{"name": "sdpa", "available": True, "reason": "on cpu", "absent": {}}]}
    # ... and it is the copy installed in this environment, not the workspace's source tree.
    assert str(venv) in str(installed_plugin_module(venv))


def test_selected_by_config(venv: Path, tmp_path: Path) -> None:
    code, rows, stderr = check(venv, tmp_path, '[components]\nattention = "sdpa"\n')
    assert code == 0, stderr
    assert rows["attention"]["resolved"] == "sdpa" and rows["attention"]["plugin"] == "sdpa-example"
    code, rows, stderr = check(venv, tmp_path, "")
    assert code == 0, stderr
    assert rows["attention"]["resolved"] == "torch-bucketed"  # the example never wins "auto"


def test_disabled_by_config_and_environment(venv: Path, tmp_path: Path) -> None:
    path = tmp_path / "disable.toml"
    path.write_text('[plugins]\ndisable = ["sdpa-example"]\n')
    assert plugins(venv, "--config", str(path))["sdpa-example"]["status"] == "disabled"
    code, rows, _ = check(venv, tmp_path, '[components]\nattention = "sdpa"\n[plugins]\ndisable = ["sdpa-example"]\n')
    assert code == 1 and "disabled plugins: sdpa-example" in rows["attention"]["error"]
    off = plugins(venv, env={"POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"})["sdpa-example"]
    assert (off["status"], off["reason"]) == ("disabled", "POWERTRAIN_DISABLE_PLUGIN_AUTOLOAD is set")
    assert plugins(venv, env={"POWERTRAIN_PLUGINS": "sdpa-example"})["sdpa-example"]["status"] == "available"


def test_broken_import_is_reported_and_fatal_only_when_needed(venv: Path, tmp_path: Path) -> None:
    module = installed_plugin_module(venv)
    original = module.read_text()
    module.write_text(original + "\nimport powertrain_absent_vendor_sdk  # a vendor SDK this machine lacks\n")
    try:
        broken = plugins(venv)["sdpa-example"]
        assert broken["status"] == "broken"
        assert "entry point 'sdpa-example'" in broken["reason"]
        assert "No module named 'powertrain_absent_vendor_sdk'" in broken["reason"]
        code, rows, stderr = check(venv, tmp_path, "")
        assert code == 0, stderr  # nothing the config needs came from the broken plugin
        assert rows["attention"]["resolved"] == "torch-bucketed" and not rows["attention"]["error"]
        code, rows, stderr = check(venv, tmp_path, '[components]\nattention = "sdpa"\n')
        assert code == 1
        assert "which may provide it: sdpa-example (powertrain-sdpa-example:" in rows["attention"]["error"]
        assert "powertrain_absent_vendor_sdk" in stderr
    finally:
        module.write_text(original)
