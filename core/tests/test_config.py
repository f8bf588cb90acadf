"""engine.toml loading: strict, and every error one line with file and path."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from powertrain.config import ConfigError, EngineConfig, load_config, parse_config, validate_sections


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engine.toml"
    path.write_text(text)
    return path


def errors(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    return excinfo.value.lines()


def test_no_config_means_defaults() -> None:
    config = load_config(None)
    assert config == EngineConfig()
    assert config.model.path == "smollm2-135m"
    assert (config.components.attention, config.components.scheduler, config.components.speculative) == (
        "auto",
        "fcfs",
        "none",
    )
    assert config.cache.block_size == 16 and config.cache.prefix_caching


def test_full_config_round_trips(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            """
        [model]
        path = "/models/llama"
        dtype = "bfloat16"
        [components]
        attention = "sdpa"
        communication = "torch-distributed"
        [cache]
        block_size = 32
        prefix_caching = false
        [parallel]
        data_parallel = 2
        expert_parallel = 4
        [plugins]
        allow = ["sdpa-example"]
        disable = ["other"]
        [dspark]
        max_draft_tokens = 5
    """.replace("\n        ", "\n"),
        )
    )
    assert config.model.dtype == "bfloat16" and config.components.attention == "sdpa"
    assert config.cache.block_size == 32 and config.cache.prefix_caching is False
    assert (config.parallel.data_parallel, config.parallel.expert_parallel) == (2, 4)
    assert config.plugins.allow == ("sdpa-example",) and config.plugins.disable == ("other",)
    assert config.sections == {"dspark": {"max_draft_tokens": 5}}
    assert config.source == "engine.toml"


def test_misspelled_key_names_file_path_and_suggestion(tmp_path: Path) -> None:
    assert errors(write(tmp_path, '[components]\natention = "auto"\n')) == [
        "engine.toml: components.atention: unknown key (did you mean attention?)"
    ]


def test_wrong_type_names_path_and_expected_type(tmp_path: Path) -> None:
    assert errors(write(tmp_path, '[cache]\nblock_size = "16"\n')) == [
        "engine.toml: cache.block_size: expected int, got str '16'"
    ]
    assert errors(write(tmp_path, "[cache]\nprefix_caching = 1\n")) == [
        "engine.toml: cache.prefix_caching: expected bool, got int 1"
    ]
    assert errors(write(tmp_path, "[parallel]\ndata_parallel = true\n")) == [
        "engine.toml: parallel.data_parallel: expected int, got bool True"
    ]


def test_bad_values_and_every_problem_reported(tmp_path: Path) -> None:
    lines = errors(
        write(tmp_path, '[cache]\nblock_size = 12\n[model]\ndtype = "int3"\n[plugins]\ndisable = ["a", 3]\n')
    )
    assert sorted(lines) == sorted(
        [
            "engine.toml: cache.block_size: must be a power of two between 1 and 1024, got 12",
            "engine.toml: model.dtype: must be one of auto, float32, bfloat16, float16; got 'int3'",
            "engine.toml: plugins.disable[1]: expected str, got int 3",
        ]
    )


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    assert errors(write(tmp_path, "cache = 3\n")) == ["engine.toml: cache: expected a table, got int 3"]


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    [line] = errors(write(tmp_path, "[cache\n"))
    assert line.startswith("engine.toml: invalid TOML:")
    [line] = errors(tmp_path / "absent.toml")
    assert line.endswith("absent.toml: no such config file")


@attrs.frozen(kw_only=True)
class DsparkLike:
    max_draft_tokens: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    mode: str = attrs.field(default="sync", validator=attrs.validators.in_(["sync", "async"]))


def test_plugin_section_validated_by_its_class() -> None:
    config = parse_config({"dspark": {"max_draft_tokens": 3}}, "engine.toml")
    assert validate_sections(config, {"dspark": DsparkLike}) == {"dspark": DsparkLike(max_draft_tokens=3)}
    # Absent sections get the plugin's defaults.
    assert validate_sections(parse_config({}, "engine.toml"), {"dspark": DsparkLike}) == {"dspark": DsparkLike()}


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"max_draft_tokens": "five"}, "engine.toml: dspark.max_draft_tokens: expected int, got str 'five'"),
        ({"mode": "fast"}, "engine.toml: dspark.mode: 'mode' must be in ['sync', 'async'] (got 'fast')"),
        ({"max_draft": 2}, "engine.toml: dspark.max_draft: unknown key (did you mean max_draft_tokens?)"),
    ],
)
def test_plugin_section_bad_value_is_one_line(table, expected) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate_sections(parse_config({"dspark": table}, "engine.toml"), {"dspark": DsparkLike})
    assert excinfo.value.lines() == [expected]


def test_unknown_section_suggests_and_mentions_broken_plugins() -> None:
    config = parse_config({"dsprak": {}}, "engine.toml")
    with pytest.raises(ConfigError) as excinfo:
        validate_sections(config, {"dspark": DsparkLike}, {"dspark-next": "ImportError: no torch_npu"})
    [line] = excinfo.value.lines()
    assert line.startswith("engine.toml: dsprak: unknown section (did you mean dspark?)")
    assert "dspark-next (ImportError: no torch_npu)" in line


def test_a_string_is_not_a_list(tmp_path: Path) -> None:
    assert errors(write(tmp_path, '[plugins]\ndisable = "sdpa-example"\n')) == [
        "engine.toml: plugins.disable: expected a list of strings, got str 'sdpa-example'"
    ]


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_bytes(b'[model]\npath = "\xff"\n')
    [line] = errors(path)
    assert line.startswith("engine.toml: not UTF-8 text")
