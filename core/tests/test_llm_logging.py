"""Who configures logging: the application (the CLI, a script), never ``LLM``.

A library that configures structlog or the stdlib root logger overrides the embedding
application's own setup, so constructing ``LLM`` must leave both as it found them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner

import powertrain.llm
from powertrain import LLM, log_setup
from powertrain.cli import main
from powertrain.loader import LoadError
from powertrain.testing.checkpoints import write_tiny_deepseek


@pytest.fixture
def unconfigured_structlog() -> Iterator[None]:
    """structlog as a fresh process has it (other tests may have run the CLI), restored after."""
    was_configured, saved, level = structlog.is_configured(), structlog.get_config(), log_setup.current_level
    structlog.reset_defaults()
    yield
    if was_configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()
    log_setup.current_level = level


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-v3-logging"))


def test_constructing_an_llm_leaves_logging_alone(tiny_v3: Path, unconfigured_structlog: None) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    config = structlog.get_config()
    with LLM(str(tiny_v3), memory_gib=0.05, dtype="float32"):
        assert not structlog.is_configured(), "LLM() configured structlog: only applications may"
        assert structlog.get_config() == config
        assert root.handlers == handlers and root.level == level, "LLM() changed the stdlib root logger"
        assert log_setup.current_level == "warning"  # untouched default


def test_the_cli_configures_logging_before_it_builds_an_llm(
    monkeypatch: pytest.MonkeyPatch, unconfigured_structlog: None
) -> None:
    seen: dict[str, object] = {}

    class Probe:
        """Stands in for LLM: records the logging setup it finds, then stops the command."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            seen.update(configured=structlog.is_configured(), level=log_setup.current_level)
            raise LoadError("probe: no model needed")

    monkeypatch.setattr(powertrain.llm, "LLM", Probe)
    result = CliRunner().invoke(main, ["--log-level", "debug", "generate", "hi"])
    assert result.exit_code == 1 and "probe: no model needed" in result.output, result.output
    assert seen == {"configured": True, "level": "debug"}
