"""Core never branches on a platform: what differs between device families is a fact of
the platform's record (components.PlatformInfo), filled in by the platform's plugin.

The architecture check parses every module of ``powertrain`` outside ``builtin/`` (the
builtin platforms are plugins: naming their own family is their job) and fails on a
comparison of a device type or platform name with a string literal, a lookup by such a
name, or a vendor environment variable. The conformance kit (``testing/``) is held to the
same rule. Creating a tensor on the host (``device="cpu"``) is not a branch and passes.
"""

from __future__ import annotations

import ast
import os
import random
import re
from pathlib import Path

import attrs
import pytest
import torch

import powertrain
from powertrain import hookimpl
from powertrain.assemble import plan, resolve_dtype
from powertrain.assemble.building import _device
from powertrain.assemble.loading import kv_budget_bytes
from powertrain.builtin.platforms import detect_cpu, detect_cuda
from powertrain.components import Availability, PlatformInfo, PlatformRecord
from powertrain.config import ComponentsConfig, EngineConfig, PluginsConfig
from powertrain.deploy.worker import see_one_device
from powertrain.plugins import PluginManager

PACKAGE = Path(powertrain.__file__).parent
#: Plugins in all but distribution: naming their own platform is what they are for.
EXEMPT = ("builtin",)

PLATFORM_NAMES = ("cpu", "cuda", "npu", "xpu", "mps", "hpu", "nccl", "hccl", "gloo")
PLATFORM_LITERAL = re.compile(rf"^({'|'.join(PLATFORM_NAMES)})(:\d+)?$")
VENDOR_ENV = re.compile(r"\b([A-Z0-9_]*_VISIBLE_DEVICES|ASCEND_[A-Z0-9_]+|CUDA_[A-Z0-9_]+|HIP_[A-Z0-9_]+)\b")
#: Methods whose first argument, a platform name, makes a lookup or a test by that name.
LOOKUPS = {"get", "pop", "setdefault", "startswith", "endswith"}


def _platform_literal(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and PLATFORM_LITERAL.match(node.value):
        return node.value
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants: prose may name variables, code may not."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def platform_branches(source: str, filename: str = "<source>") -> list[str]:
    """Every platform branch in ``source``, as ``file:line: what``."""
    tree = ast.parse(source, filename)
    docstrings = _docstrings(tree)
    problems = []

    def report(node: ast.AST, what: str) -> None:
        problems.append(f"{filename}:{node.lineno}: {what}: {ast.get_source_segment(source, node)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
                if isinstance(op, ast.Eq | ast.NotEq | ast.Is | ast.IsNot):
                    name = _platform_literal(left) or _platform_literal(right)
                    if name:
                        report(node, f"compares with platform name {name!r}")
                elif isinstance(op, ast.In | ast.NotIn):
                    names = [_platform_literal(left)]
                    if isinstance(right, ast.Tuple | ast.Set | ast.List):
                        names += [_platform_literal(e) for e in right.elts]
                    if any(names):
                        report(node, f"tests membership with platform names {[n for n in names if n]}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOOKUPS:
            name = _platform_literal(node.args[0]) if node.args else None
            if name:
                report(node, f".{node.func.attr}() by platform name {name!r}")
        elif isinstance(node, ast.Subscript) and _platform_literal(node.slice):
            report(node, f"looks up platform name {_platform_literal(node.slice)!r}")
        elif isinstance(node, ast.MatchValue) and _platform_literal(node.value):
            report(node, f"matches platform name {_platform_literal(node.value)!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            variable = VENDOR_ENV.search(node.value)
            if variable:
                report(node, f"names vendor environment variable {variable.group(1)}")
    return problems


def core_modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in EXEMPT)


def test_core_has_no_platform_branches() -> None:
    modules = core_modules()
    assert len(modules) > 30
    assert PACKAGE / "assemble" / "loading.py" in modules and PACKAGE / "distributed.py" in modules
    problems = [p for path in modules for p in platform_branches(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not problems, (
        "core branches on a platform; make it a fact of components.PlatformInfo that the platform's "
        "plugin fills in (builtin/platforms.py, a kernel pack's detect()):\n" + "\n".join(problems)
    )


BRANCHES = {
    'if device.type == "cuda": pass': "compares with platform name 'cuda'",
    'ok = "npu" != platform.device_type': "compares with platform name 'npu'",
    'ok = device is "cuda:0"': "compares with platform name 'cuda:0'",
    'ok = backend in ("nccl", "hccl")': "tests membership with platform names ['nccl', 'hccl']",
    'ok = platform.name not in {"xpu", "mps"}': "tests membership with platform names ['xpu', 'mps']",
    'ok = "hpu" in names': "tests membership with platform names ['hpu']",
    'host = detected.get("cpu")': ".get() by platform name 'cpu'",
    'ok = str(device).startswith("cuda")': ".startswith() by platform name 'cuda'",
    'host = platforms()["cpu"]': "looks up platform name 'cpu'",
    'match backend:\n    case "gloo": pass': "matches platform name 'gloo'",
    'os.environ["CUDA_VISIBLE_DEVICES"] = "0"': "names vendor environment variable CUDA_VISIBLE_DEVICES",
    'table = {"npu": "ASCEND_RT_VISIBLE_DEVICES"}': "names vendor environment variable ASCEND_RT_VISIBLE_DEVICES",
    'flag = os.environ.get("HIP_LAUNCH_BLOCKING")': "names vendor environment variable HIP_LAUNCH_BLOCKING",
    'ok = os.getenv("CUDA_HOME")': "names vendor environment variable CUDA_HOME",
}


@pytest.mark.parametrize("source", BRANCHES, ids=range(len(BRANCHES)))
def test_the_check_finds_each_kind_of_platform_branch(source: str) -> None:
    (problem,) = platform_branches(source)
    assert problem.startswith("<source>:") and BRANCHES[source] in problem


def test_the_check_passes_what_is_not_a_branch() -> None:
    source = '''
"""Docs may say CUDA_VISIBLE_DEVICES, gloo on cpu."""
import torch

def f(x, device: str = "cpu"):
    """Moves to the host; NCCL wants CUDA_VISIBLE_DEVICES set first."""
    table = torch.arange(4, device="cpu")
    report = {"cpu": "Xeon"}
    return x.to("cpu"), table, report, device == torch.device(x.device.type), "cpu model"
'''
    assert platform_branches(source) == []


# --------------------------------------------------------------------------- the facts


def test_cpu_and_cuda_fill_the_facts_core_reads() -> None:
    cpu, cuda = detect_cpu(), detect_cuda()
    assert cpu.host and not cuda.host
    assert (cpu.auto_dtype, cuda.auto_dtype) == (torch.float32, None)
    assert not cpu.device_per_rank and cuda.device_per_rank
    assert (cpu.visible_devices_env, cuda.visible_devices_env) == (None, "CUDA_VISIBLE_DEVICES")
    assert cpu.shares_host_cores and not cuda.shares_host_cores
    assert cpu.set_device is None and cuda.set_device is not None
    assert not cpu.barrier_needs_device_ids and cuda.barrier_needs_device_ids
    assert cpu.free_memory is None and cuda.free_memory is not None
    assert not cpu.keeps_fp8_weights and cuda.keeps_fp8_weights
    assert (cpu.dist_backend, cuda.dist_backend) == ("gloo", "nccl")


def test_platform_info_refuses_malformed_facts() -> None:
    info = detect_cpu()
    with pytest.raises(TypeError, match="free_memory must be callable"):
        type(info)(name="x", device_type="x", availability=info.availability, free_memory=4096)
    with pytest.raises(TypeError, match="auto_dtype takes torch.dtype"):
        type(info)(name="x", device_type="x", availability=info.availability, auto_dtype="float32")
    with pytest.raises(TypeError, match="packed_linear_dtypes takes torch.dtype"):
        type(info)(name="x", device_type="x", availability=info.availability, packed_linear_dtypes={"bfloat16"})
    with pytest.raises(TypeError, match="packed_linear_dtypes takes torch.dtype"):
        type(info)(name="x", device_type="x", availability=info.availability, packed_linear_dtypes={None})


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [("", 1, "1"), ("4,6, 7", 2, " 7"), ("3", 2, "2")])
def test_a_worker_sees_its_own_device_through_the_platforms_variable(
    monkeypatch: pytest.MonkeyPatch, visible: str, local_rank: int, expected: str
) -> None:
    variable = "POWERTRAIN_TEST_DEVICES"  # any platform's variable; the worker only reads the fact
    monkeypatch.setenv(variable, visible)
    see_one_device(variable, local_rank)
    assert os.environ[variable] == expected
    before = dict(os.environ)
    see_one_device(None, local_rank)  # a platform without one (the host): nothing changes
    assert dict(os.environ) == before


# --------------------------------------------------------------------------- assembly reads them


def test_auto_dtype_is_the_platforms_choice() -> None:
    cpu, cuda = detect_cpu(), detect_cuda()
    assert resolve_dtype("auto", cpu, {"torch_dtype": "bfloat16"}) == torch.float32
    assert resolve_dtype("auto", cuda, {}) == torch.bfloat16
    assert resolve_dtype("auto", cuda, {"torch_dtype": "float16"}) == torch.float16
    board = attrs.evolve(cuda, name="board", auto_dtype=torch.bfloat16)
    assert resolve_dtype("auto", board, {"torch_dtype": "float16"}) == torch.bfloat16
    assert resolve_dtype("float16", cpu, {}) == torch.float16  # an explicit dtype always wins
    assert "float32 is exact" in cpu.auto_dtype_note  # the startup log says why


@pytest.mark.parametrize(
    ("flags", "bf16_kernels", "says"),
    [
        ({"avx2", "avx512_bf16"}, True, "twice as fast on this CPU's bfloat16 dot products (avx512_bf16)"),
        ({"avx2", "amx_bf16", "avx512_bf16"}, True, "(amx_bf16, avx512_bf16): set dtype = bfloat16"),
        ({"avx2", "avx512bw"}, True, "halves dense weight bytes"),
        ({"avx2"}, False, "slower here"),
    ],
)
def test_the_auto_dtype_note_says_what_bfloat16_would_do_on_this_cpu(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], bf16_kernels: bool, says: str
) -> None:
    """The CPU's flags and oneDNN's bfloat16 support, forced: the startup line points a
    user at bfloat16 only where the CPU has bfloat16 dot products."""
    from powertrain.builtin import platforms

    monkeypatch.setattr(platforms, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(platforms, "onednn_bf16_supported", lambda: bf16_kernels)
    cpu = detect_cpu()
    assert cpu.auto_dtype == torch.float32 and says in cpu.auto_dtype_note


def test_the_kv_budget_comes_from_the_platforms_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's free memory is mocked (no GPU here); the cpu budget is from its real total."""
    free = random.randrange(2**30, 100 * 2**30)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (free, 2 * free))
    device = torch.device("cuda", 1)
    assert kv_budget_bytes(EngineConfig(), detect_cuda(), device) == int(free * 0.85) and asked == [device]
    cpu = detect_cpu()
    assert kv_budget_bytes(EngineConfig(), cpu, torch.device("cpu")) == min(4 * 2**30, cpu.total_memory_bytes // 4)


def test_each_local_rank_owns_a_device_only_where_the_platform_says_so() -> None:
    on_cpu = plan(EngineConfig(), strict=False)
    assert _device(on_cpu, 3) == torch.device("cpu")
    on_cuda = attrs.evolve(on_cpu, platform=detect_cuda())
    assert _device(on_cuda, 3) == torch.device("cuda", 3) and _device(on_cuda, None) == torch.device("cuda")


def test_selection_falls_back_to_the_host_platform_whatever_its_name() -> None:
    """Without the builtin cpu platform, a plugin's host platform is what selection is judged on."""

    def board() -> PlatformInfo:
        return PlatformInfo(name="board", device_type="cpu", availability=Availability.yes("the host"), host=True)

    def accel() -> PlatformInfo:
        return PlatformInfo(name="accel", device_type="cpu", availability=Availability.no("no accelerator here"))

    class Boards:
        POWERTRAIN_HOOK_API = 1

        @hookimpl
        def powertrain_platforms(self) -> list[PlatformRecord]:
            return [
                PlatformRecord(name="accel", device_type="cpu", dist_backend="gloo", detect=accel, priority=100),
                PlatformRecord(name="board", device_type="cpu", dist_backend="gloo", detect=board, priority=0),
            ]

    manager = PluginManager.load(PluginsConfig(disable=("builtin-platforms",)), environ={})
    manager.register(Boards())
    assert "cpu" not in manager.platforms()
    refused = plan(EngineConfig(components=ComponentsConfig(platform="accel")), manager, strict=False)
    assert refused.platform.name == "board" and "no accelerator here" in refused.resolutions["platform"].error
