"""Imports point down, and no package imports itself in a circle.

The modules are parsed, not imported, and every import counts: module level and
function-local alike (a function-local import is still a dependency, just a late
one). Only ``if TYPE_CHECKING:`` blocks are left out: they never run, they name types.

Core's layers, bottom to top (docs/architecture.md); a module may import from its own
layer and the layers below, never above:

0. contracts: the public records, Protocols, hook specs and config a plugin sees;
1. mechanisms: what runs inside an engine (tokenizer, loader, layers, models, the
   engine loop, parallel mechanisms, the plugin manager, torch.distributed);
2. builtin: the reference plugins, reached only through hooks;
3. assemble: plans and wires an engine from config and plugins;
4. deploy: starts engines (one process, spawned workers, torchrun) and feeds them;
5. front ends: ``LLM``, the HTTP server, the CLI, the load generator;
6. testing: the conformance kit, which drives everything below.

Within the mechanisms some neighbours must stay apart too (``SEPARATE``): a model does
not know how it is deployed or parallelised, and the engine loop does not know models.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "core" / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "powertrain",
        "components",
        "config",
        "cpu_budget",
        "hookspecs",
        "interfaces",
        "log_setup",
        "measurements",
        "selection",
        "startup",
    ),
    ("distributed", "engine", "images", "layers", "loader", "models", "parallel", "plugins", "tokenizer"),
    ("builtin",),
    ("assemble",),
    ("deploy",),
    ("llm", "serve", "cli", "bench"),
    ("testing",),
)

#: Groups of the same layer that must not import the other: (importer, imported).
SEPARATE = {
    ("models", "parallel"),
    ("models", "engine"),
    ("models", "plugins"),
    ("layers", "models"),
    ("layers", "engine"),
    ("layers", "parallel"),
    ("engine", "models"),
    ("engine", "plugins"),
    ("parallel", "engine"),
    ("parallel", "models"),
}

PLUGIN_PACKAGES = {
    "powertrain_cuda_sm100": REPO / "plugins" / "cuda_sm100" / "src",
    "powertrain_cann_ascend": REPO / "plugins" / "cann_ascend" / "src",
    "powertrain_dspark": REPO / "plugins" / "dspark" / "src",
    "powertrain_recipe": REPO / "plugins" / "recipe_rust" / "python",
    "powertrain_sdpa_example": REPO / "examples" / "plugin-template" / "src",
    "powertrain_cpu_kernels": REPO / "plugins" / "cpu_kernels" / "python",
}


def modules_of(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imports_of(path: Path, module: str, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in ``path`` of its own distribution's
    modules (``known``, plus compiled ones such as ``powertrain_recipe._native``)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the submodule when there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        root = module.partition(".")[0]
        for target in targets:
            if target == root or target.startswith(root + "."):
                yield target, node.lineno


def graph_of(root: Path, package: str) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Module -> imported modules of the same distribution, and where each edge is written."""
    modules = modules_of(root, package)
    known = set(modules)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    where: dict[tuple[str, str], str] = {}
    for module, path in modules.items():
        for target, line in imports_of(path, module, known):
            if target != module:
                edges[module].add(target)
                shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                where.setdefault((module, target), f"{shown}:{line}")
    return edges, where


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def group_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(module: str) -> int:
    group = group_of(module)
    for rank, members in enumerate(LAYERS):
        if group in members:
            return rank
    raise AssertionError(f"{module}: its group {group!r} is in no layer of LAYERS; place it there")


CORE_EDGES, CORE_WHERE = graph_of(CORE, "powertrain")


def test_every_core_module_has_a_layer():
    for module in CORE_EDGES:
        layer_of(module)


def test_core_imports_point_down():
    upward = [
        f"{CORE_WHERE[(a, b)]}: {a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in sorted(CORE_EDGES.items())
        for b in sorted(targets)
        if layer_of(b) > layer_of(a)
    ]
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_neighbours_that_must_not_know_each_other_do_not():
    crossing = [
        f"{CORE_WHERE[(a, b)]}: {a} imports {b}"
        for a, targets in sorted(CORE_EDGES.items())
        for b in sorted(targets)
        if (group_of(a), group_of(b)) in SEPARATE
    ]
    assert not crossing, "\n".join(crossing)


def test_no_circle_in_core():
    found = cycles(CORE_EDGES)
    assert not found, "import circles in core:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("package", sorted(PLUGIN_PACKAGES))
def test_no_circle_in_a_plugin(package):
    edges, _ = graph_of(PLUGIN_PACKAGES[package], package)
    assert edges, f"found no modules of {package}"
    found = cycles(edges)
    assert not found, f"import circles in {package}:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_upward_local_imports_and_circles(tmp_path):
    """The rules can fail: a function-local upward import and a circle are both found,
    and an import under TYPE_CHECKING is not."""
    pkg = tmp_path / "powertrain"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("def f():\n    from powertrain.deploy import launch\n")
    (pkg / "engine" / "b.py").write_text("from powertrain.engine import c\n")
    (pkg / "engine" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from powertrain import cli\nfrom . import b\n"
    )
    (pkg / "deploy").mkdir()
    (pkg / "deploy" / "__init__.py").write_text("")
    (pkg / "deploy" / "launch.py").write_text("")
    (pkg / "cli.py").write_text("")
    edges, _ = graph_of(tmp_path, "powertrain")
    assert edges["powertrain.engine.a"] == {"powertrain.deploy.launch"}
    assert layer_of("powertrain.deploy.launch") > layer_of("powertrain.engine.a")
    assert edges["powertrain.engine.c"] == {"powertrain.engine.b"}
    assert cycles(edges) == [["powertrain.engine.b", "powertrain.engine.c"]]
