"""The suite's own gate: seeds that replay (``powertrain.testing.seeds``) and no process left
behind (``powertrain.testing.processes``), each checked by running pytest on a small test file
that fails on purpose, in a fresh process, as a user would run it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

from powertrain.testing.processes import OWNER_ENV
from powertrain.testing.seeds import DEFAULT_RUN_SEED, SEED_ENV, fresh_seed

CONFTEST = 'pytest_plugins = ["powertrain.testing.seeds", "powertrain.testing.processes"]\n'

#: A module-scoped "checkpoint" seed, then a test that draws a prompt seed, Python's and
#: torch's global generators (as unseeded test code does) and fails, showing all four.
SEEDED = """
import random

import pytest
import torch

from powertrain.testing.seeds import fresh_seed


@pytest.fixture(scope="module")
def checkpoint_seed():
    return fresh_seed()


def test_first_uses_the_checkpoint(checkpoint_seed):
    torch.rand(7)  # moves the global generator: the next test must not depend on it


@pytest.mark.parametrize("case", ["a", "b"])
def test_fails_showing_its_draws(checkpoint_seed, case):
    prompt_seed = fresh_seed()
    draws = (checkpoint_seed, prompt_seed, random.randint(0, 10**9), int(torch.randint(0, 10**9, (1,))))
    assert case == "a", f"draws={draws}"
"""


def run_pytest(folder: Path, *args: str, seed: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (SEED_ENV, "PYTEST_ADDOPTS")}
    if seed is not None:
        env[SEED_ENV] = seed
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rf", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def draws_of(output: str) -> tuple[int, ...]:
    found = re.findall(r"draws=\((\d+), (\d+), (\d+), (\d+)\)", output)
    assert len(found) >= 1, output[-3000:]
    return tuple(int(x) for x in found[0])


def seeded_folder(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_seeded.py").write_text(textwrap.dedent(SEEDED))
    return tmp_path


def test_a_printed_replay_line_reproduces_the_failure_exactly(tmp_path: Path) -> None:
    folder = seeded_folder(tmp_path)
    # Exploring, on two workers: the module fixture is set up on whichever worker takes it.
    explored = run_pytest(folder, "-n", "2", seed="random")
    assert explored.returncode == 1, explored.stdout[-3000:]
    first = draws_of(explored.stdout)
    replay = re.search(rf"^({SEED_ENV}=(\d+) uv run pytest -n 0 '(\S+)')$", explored.stdout, re.MULTILINE)
    assert replay, explored.stdout[-3000:]
    assert replay[3] == "test_seeded.py::test_fails_showing_its_draws[b]"
    assert f"{first[0]}" in explored.stdout and "fixture 'checkpoint_seed' (module)" in explored.stdout

    # The replay line, as printed (uv run is this interpreter here): the failing test alone.
    _, _, nodeid = shlex.split(replay[1])[-3:]
    replayed = run_pytest(folder, "-n", "0", nodeid, seed=replay[2])
    assert replayed.returncode == 1 and "1 failed" in replayed.stdout, replayed.stdout[-3000:]
    assert draws_of(replayed.stdout) == first

    another = run_pytest(folder, "-n", "0", seed="random")
    assert draws_of(another.stdout) != first  # 2**-32 chance of a false failure per draw


def test_without_a_seed_the_run_is_fixed_and_a_bad_seed_is_refused(tmp_path: Path) -> None:
    folder = seeded_folder(tmp_path)
    once, again = run_pytest(folder, "-n", "0"), run_pytest(folder, "-n", "2")
    assert f"{SEED_ENV}={DEFAULT_RUN_SEED} (fixed default" in once.stdout
    assert draws_of(once.stdout) == draws_of(again.stdout)
    assert draws_of(once.stdout) == draws_of(run_pytest(folder, "-n", "0", seed=str(DEFAULT_RUN_SEED)).stdout)

    refused = run_pytest(folder, "-n", "0", seed="seven")
    assert refused.returncode != 0
    assert f"{SEED_ENV}='seven' is neither an integer nor 'random'" in refused.stdout + refused.stderr


def test_a_process_a_test_leaves_behind_fails_the_run_and_is_ended(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_leaky.py").write_text(
        textwrap.dedent(
            """
            import subprocess
            from pathlib import Path

            def test_cleans_up():
                subprocess.run(["sleep", "0"], check=True)

            def test_forgets_its_child(tmp_path_factory):
                child = subprocess.Popen(["sleep", "600"])
                Path(__file__).with_name("pid").write_text(str(child.pid))

            def test_after():
                pass
            """
        )
    )
    result = run_pytest(tmp_path, "-n", "0")
    pid = int((tmp_path / "pid").read_text())
    assert result.returncode == 1, result.stdout[-3000:]
    assert "3 passed, 1 error" in result.stdout, result.stdout[-3000:]
    assert re.search(rf"pid {pid}: 'sleep 600', started during test_leaky.py::test_forgets_its_child", result.stdout), (
        result.stdout[-3000:]
    )
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert OWNER_ENV in os.environ  # this very run is watched the same way


def test_a_greedy_departure_passes_only_at_a_tie_of_the_oracle() -> None:
    """``assert_greedy_agrees``: equal tokens pass; a departure where the oracle's top two
    logits are within the tolerance is a tie and passes; one where they are not fails."""
    from powertrain.testing.oracle import assert_greedy_agrees

    generator = torch.Generator().manual_seed(fresh_seed())
    rows = torch.randn(6, 50, generator=generator)
    expected = rows.argmax(-1).tolist()
    second = rows.topk(2).indices[:, 1].tolist()
    assert assert_greedy_agrees(expected, expected, rows.__getitem__, 1e-4) is None
    departed = expected[:3] + [second[3]] + expected[4:]
    with pytest.raises(AssertionError, match="at token 3 .* not a rounding tie"):
        assert_greedy_agrees(departed, expected, rows.__getitem__, 1e-4)
    tied = rows.clone()
    tied[3, second[3]] = tied[3, expected[3]] - 1e-6 * tied[3].abs().max()
    assert assert_greedy_agrees(departed, expected, tied.__getitem__, 1e-4) == 3


#: Sources of randomness the run seed does not reach: each draws anew in every run.
UNSEEDED = re.compile(
    r"SystemRandom\(|os\.urandom\(|secrets\.|torch\.seed\(\)|default_rng\(\)|Generator\(\)\.seed\(\)|time\.time_ns\(\)"
)


def test_no_test_draws_from_a_source_the_run_seed_does_not_reach() -> None:
    """A test drawing from the OS (``random.SystemRandom``, ``os.urandom``, ``torch.seed()``,
    numpy's unseeded ``default_rng()``) neither replays nor stays fixed in CI: take
    ``fresh_seed()`` or the (seeded) global generators instead."""
    root = Path(__file__).resolve().parents[2]
    test_files = [
        path
        for folder in ("core/tests", "tests", "plugins")
        for path in (root / folder).rglob("test_*.py")
        if ".venv" not in path.parts and path.resolve() != Path(__file__).resolve()
    ]
    assert len(test_files) > 50, f"found only {len(test_files)} test files under {root}"
    offenders = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in test_files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if UNSEEDED.search(line)
    ]
    assert not offenders, "unseeded randomness in tests:\n" + "\n".join(offenders)
