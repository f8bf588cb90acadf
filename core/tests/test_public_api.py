"""Plugins use only the public API (DESIGN §7).

Every module of every plugin package in this repository (the kernel packs, DSpark, the
recipe adapter, the plugin template) is parsed, function-local imports included, and
each import of ``powertrain`` must name a public module or a public top-level name. A
plugin that needs something else is the signal to make it public on purpose, in the
core, for everyone: move it into ``powertrain.interfaces`` or add a module to ``PUBLIC``
with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import powertrain

ROOT = Path(__file__).resolve().parents[2]

#: Public modules; each covers its submodules too.
PUBLIC = (
    "powertrain.interfaces",  # the contracts: Protocols and records (one module per concern)
    "powertrain.components",  # the records component hooks return
    "powertrain.hookspecs",  # the hooks and HOOK_API_VERSION
    "powertrain.distributed",  # the torch.distributed communicator kernel packs build on
    "powertrain.testing",  # the conformance kit
    # DSpark's block drafter: its checkpoint format and modules, which powertrain-dspark's
    # `train-drafter` trains in and writes (the engine loads it through the interfaces).
    "powertrain.models.dspark",
    "powertrain.layers.rotary",  # RoPE as the models apply it: a drafter trainer rotates the same way
)

#: Where plugin code lives: each distribution's import package (not its tests).
PLUGIN_SOURCES = ("plugins/*/src", "plugins/recipe_rust/python", "examples/*/src")


def is_public_module(module: str) -> bool:
    return module == "powertrain" or any(module == p or module.startswith(p + ".") for p in PUBLIC)


def private_imports(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, what) for every import of a non-public part of ``powertrain`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "powertrain" and not is_public_module(alias.name):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module.split(".")[0] != "powertrain":
                continue
            if not is_public_module(module):
                found.append((node.lineno, module))
            elif module == "powertrain":  # a top-level name, or a submodule imported by name
                for alias in node.names:
                    if alias.name not in powertrain.__all__ and not is_public_module(f"powertrain.{alias.name}"):
                        found.append((node.lineno, f"powertrain.{alias.name}"))
    return found


def plugin_files() -> list[Path]:
    return sorted(path for pattern in PLUGIN_SOURCES for folder in ROOT.glob(pattern) for path in folder.rglob("*.py"))


def test_plugins_import_only_the_public_api() -> None:
    files = plugin_files()
    packages = {path.relative_to(ROOT).parts[:2] for path in files}
    # Each plugin distribution is scanned (a moved folder must not silently empty the check).
    assert {("plugins", name) for name in ("cuda_sm100", "cann_ascend", "dspark", "recipe_rust")} <= packages
    assert ("examples", "plugin-template") in packages
    problems = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}, which is not public API"
        for path in files
        for line, module in private_imports(path.read_text(), str(path))
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from powertrain.engine.speculative import DraftSlot", [(1, "powertrain.engine.speculative")]),
        ("import powertrain.layers.moe as moe", [(1, "powertrain.layers.moe")]),
        ("def f():\n    from powertrain.llm import apply_overrides", [(2, "powertrain.llm")]),
        ("from powertrain import llm", [(1, "powertrain.llm")]),
        ("from powertrain import LLM, SamplingParams, hookimpl, interfaces", []),
        ("from powertrain.interfaces.speculative import DraftSlot\nimport powertrain.testing.moe", []),
        ("from powertrain.components import Availability\nfrom .local import thing", []),
        ("import powertrain_dspark.mtp\nfrom powertrainx import y", []),
    ],
)
def test_the_check_sees_every_kind_of_import(source: str, expected: list[tuple[int, str]]) -> None:
    assert private_imports(source) == expected


def test_public_top_level_names_resolve() -> None:
    for name in powertrain.__all__:
        assert getattr(powertrain, name) is not None, name


def test_the_contracts_import_nothing_above_them() -> None:
    """Contracts are the bottom layer: ``powertrain.interfaces`` imports only itself and
    the component records, never the engine, layers, loader or anything built on them."""
    allowed = ("powertrain.interfaces", "powertrain.components")
    folder = ROOT / "core/src/powertrain/interfaces"
    problems = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] == "powertrain" and not any(
                    name == a or name.startswith(a + ".") for a in allowed
                ):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    assert not problems, "\n".join(problems)
