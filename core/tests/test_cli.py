"""`powertrain plugins` and `powertrain config check`, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from powertrain.cli import main

POWERTRAIN = Path(sys.executable).parent / "powertrain"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, in a fresh process."""
    return subprocess.run([str(POWERTRAIN), *args], capture_output=True, text=True, timeout=120)


def test_plugins_json_lists_builtins_and_the_template() -> None:
    proc = run("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["builtin-platforms"]["status"] == "available"
    assert plugins["builtin-platforms"]["distribution"] == "powertrain"
    assert plugins["sdpa-example"]["distribution"] == "powertrain-sdpa-example"
    assert plugins["sdpa-example"]["status"] == "available"
    assert plugins["sdpa-example"]["provides"]["attention"][0]["name"] == "sdpa"
    cuda = next(c for c in plugins["builtin-platforms"]["provides"]["platform"] if c["name"] == "cuda")
    assert cuda["available"] is False and cuda["reason"]  # no GPU here, and it says why
    assert report["platforms"]["cpu"]["available"] is True
    assert report["conflicts"] == []


def test_plugins_table_shows_status_and_reasons() -> None:
    result = CliRunner().invoke(main, ["plugins"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in (
        "builtin-attention",
        "sdpa-example",
        "powertrain-sdpa-example",
        "available",
        "platform cuda: unavailable",
    ):
        assert text in result.output


def test_plugins_honours_config_disable(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[plugins]\ndisable = ["sdpa-example"]\n')
    result = CliRunner().invoke(main, ["plugins", "--json", "--config", str(path)])
    plugins = {p["name"]: p for p in json.loads(result.output)["plugins"]}
    assert plugins["sdpa-example"]["status"] == "disabled"
    assert plugins["sdpa-example"]["reason"] == "disabled by [plugins] disable"


def test_config_check_prints_resolution_and_reasons(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[components]\nattention = "sdpa"\nscheduler = "fcfs"\n')
    result = CliRunner().invoke(main, ["config", "check", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    rows = {row["kind"]: row for row in report["components"]}
    assert rows["platform"]["resolved"] == "cpu"
    assert rows["attention"]["resolved"] == "sdpa" and rows["attention"]["plugin"] == "sdpa-example"
    assert rows["communication"]["resolved"] == "single-process"
    assert "highest priority" in rows["communication"]["reason"]


def test_config_check_unknown_component_lists_available_ones(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[components]\nattention = "flash9"\n')
    proc = run("config", "check", str(path))
    assert proc.returncode == 1
    assert "attention = 'flash9': attention 'flash9' is not provided by any loaded plugin" in proc.stderr
    assert "available here: cpu-paged, torch-bucketed, torch-reference, sdpa" in proc.stderr


def test_config_check_reports_config_errors_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[components]\natention = "auto"\n[cache]\nblock_size = "16"\n[dspark]\nmax_draft_tokens = 5\n')
    proc = run("config", "check", str(path))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "error: engine.toml: components.atention: unknown key (did you mean attention?)",
        "error: engine.toml: cache.block_size: expected int, got str '16'",
    ]
    path.write_text("[dsprak]\nmax_draft_tokens = 5\n")
    proc = run("config", "check", str(path))
    assert proc.returncode == 1
    # powertrain-dspark (installed in this workspace) owns [dspark]
    assert proc.stderr.strip() == "error: engine.toml: dsprak: unknown section (did you mean dspark?)"


def test_logs_go_to_stderr_as_json_when_not_a_terminal(tmp_path: Path) -> None:
    proc = run("--log-level", "debug", "plugins", "--json")
    assert proc.returncode == 0
    json.loads(proc.stdout)  # stdout stays clean machine output
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    assert any(e["event"] == "plugins loaded" and e["level"] == "debug" for e in events)


def test_generate_answers_on_the_embedded_model() -> None:
    """One prompt is printed as it is generated; the streamed text is the whole answer."""
    proc = run("generate", "--max-tokens", "24", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    whole = run("generate", "--max-tokens", "24", "--json", "What is the capital of France?")
    assert whole.returncode == 0, whole.stderr
    assert proc.stdout == json.loads(whole.stdout)["text"] + "\n"


def test_generate_json_for_several_prompts_and_clear_errors(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\n\nName a colour.\n")
    proc = run("generate", "--file", str(prompts), "--json", "--max-tokens", "8", "--no-chat")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Say hello.", "Name a colour."]
    assert all(r["output_tokens"] <= 8 and r["finish_reason"] in ("stop", "length") for r in records)
    proc = run("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert proc.returncode == 1 and "error:" in proc.stderr and "nowhere" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run("generate", "--top-p", "1.5", "hi")
    assert proc.returncode == 1 and "top_p must be in (0, 1]" in proc.stderr
    proc = run("generate", "--data-parallel", "2", "--prefill-ranks", "1", "hi")  # no store to hand blocks over
    assert proc.returncode == 1 and "prefill_ranks = 1" in proc.stderr and "kv_store" in proc.stderr
    assert run("generate").returncode == 1


HEAVY = ("torch", "numpy", "powertrain.assemble", "powertrain.engine", "powertrain.loader", "structlog")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["generate", "--help"], ["serve", "--help"]])
def test_help_and_version_import_nothing_heavy(args: list[str]) -> None:
    """``--help`` and ``--version`` answer in a fifth of a second (0.2 s on the 2-core EPYC;
    importing torch first took 3-7 s): they must not import torch or the engine. Checked
    by what the process imported, not by a clock."""
    probe = (
        "import sys\nfrom powertrain.cli import run\n"
        f"sys.argv = ['powertrain', *{args!r}]\n"
        "try:\n    run()\nexcept SystemExit as ended:\n    assert not ended.code, ended.code\n"
        f"print('IMPORTED', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "powertrain" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "IMPORTED []"
