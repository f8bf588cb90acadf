"""The documentation's runnable blocks run, so README.md and docs/*.md cannot drift from the code.

A fenced block whose info string is ``<language> runnable`` is collected (docs/README.md,
"Runnable blocks"): ``sh``/``bash`` blocks run as a bash script in the repository root,
``python`` blocks with this interpreter, ``toml`` blocks through ``powertrain config check``.
Each is one test whose id is the file and the line of its opening fence.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "runnable"
#: Seconds one block may run; a block that needs more should not be marked runnable.
TIMEOUT_S = 120
#: An opening or closing fence (CommonMark): up to three spaces of indentation in a
#: paragraph, more inside a list item; three or more backticks or tildes; an info string.
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
LANGUAGES = {"sh": "sh", "bash": "sh", "python": "python", "toml": "toml"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # a key of LANGUAGES
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def runnable_blocks(path: Path) -> list[Block]:
    """The blocks of a Markdown file marked runnable, in file order. A block marked runnable
    in a language no runner takes is an error, so a typo never silently skips a block."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        number += 1
        if not opening or (opening["fence"][0] == "`" and "`" in opening["info"]):
            continue
        indent, fence, words = len(opening["indent"]), opening["fence"], opening["info"].split()
        start, body = number, []
        while number < len(lines):
            closing = FENCE.match(lines[number])
            number += 1
            closes = closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence)
            if closes and not closing["info"].strip():  # a fence-like line with an info string is content
                break
            body.append(_dedent(lines[number - 1], indent))
        if MARKER not in words[1:]:
            continue
        language = words[0] if words else ""
        if language not in LANGUAGES:
            raise ValueError(
                f"{path}:{start}: a block marked {MARKER} must be one of {', '.join(LANGUAGES)}; got {language!r}"
            )
        blocks.append(Block(path, start, LANGUAGES[language], "\n".join(body) + "\n"))
    return blocks


def _dedent(line: str, indent: int) -> str:
    """A block's line without the indentation of its opening fence (a block in a list item)."""
    stripped = len(line) - len(line.lstrip(" "))
    return line[min(indent, stripped) :]


def documentation_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _command(block: Block, script: Path) -> list[str]:
    if block.language == "sh":
        return ["bash", "-euo", "pipefail", str(script)]
    if block.language == "python":
        return [sys.executable, str(script)]
    powertrain = shutil.which("powertrain", path=str(Path(sys.executable).parent))
    if powertrain is None:
        raise AssertionError(f"{block.where}: no powertrain command beside {sys.executable}")
    return [powertrain, "config", "check", str(script)]


def run_block(block: Block, timeout_s: float = TIMEOUT_S) -> None:
    """Run one block in the repository root; an AssertionError naming the block and showing
    its output if it exits non-zero or runs past ``timeout_s``."""
    if block.language == "sh" and re.search(r"\buv\b", block.code) and shutil.which("uv") is None:
        pytest.skip(f"{block.where} runs uv, which is not on PATH")
    env = dict(os.environ)
    # The workspace's commands (powertrain, ...) resolve to this environment's, and `uv run`
    # runs in it as it is: the suite is already running in the synced workspace.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["UV_NO_SYNC"] = "1"
    suffix = {"sh": ".sh", "python": ".py", "toml": ".toml"}[block.language]
    with tempfile.TemporaryDirectory(prefix="powertrain-docs-") as folder:
        script = Path(folder) / f"block{suffix}"
        script.write_text(block.code, encoding="utf-8")
        process = subprocess.Popen(
            _command(block, script),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a timeout stops the block's children too
        )
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise AssertionError(
                f"{block.where}: ran past {timeout_s} s\n--- block ---\n{block.code}--- output ---\n{output}"
            ) from None
    if process.returncode != 0:
        raise AssertionError(
            f"{block.where}: exited with {process.returncode}\n--- block ---\n{block.code}--- output ---\n{output}"
        )


BLOCKS = [block for path in documentation_files() for block in runnable_blocks(path)]


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_runnable_block(block: Block) -> None:
    run_block(block)


def test_the_readme_has_runnable_blocks() -> None:
    """A collector that finds nothing would pass every time."""
    assert any(block.path == ROOT / "README.md" for block in BLOCKS)


LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^(`{3,}|~{3,}).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    headings = re.findall(r"^#+\s+(.*)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def dead_links(path: Path) -> list[str]:
    """The relative links of a page that name no file, or no heading of the page they name."""
    dead = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked)):
            dead.append(target)
    return dead


@pytest.mark.parametrize("path", documentation_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_links_resolve(path: Path) -> None:
    """Pages moved or sections renamed leave no dead links."""
    assert not dead_links(path)


def test_dead_links_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## `powertrain serve`: the server\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n[fine](other.md#powertrain-serve-the-server) [here](#a-page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no such heading](other.md#serving) [not here](#nowhere)\n"
        "```sh\n# a comment, not a heading\n```\n[comment](#a-comment-not-a-heading)\n",
        encoding="utf-8",
    )
    assert dead_links(page) == ["missing.md", "other.md#serving", "#nowhere", "#a-comment-not-a-heading"]


SAMPLE = """\
# A page

```sh
exit 1
```

```sh runnable
echo fine
```

1. A list item:

   ```python runnable
   import sys

   print("in a list item", file=sys.stderr)
   ```

````markdown
```sh runnable
shown, not run: it is inside a four-backtick block
```
````

```python runnable
raise SystemExit("broken on purpose")
```
"""


def test_collector_finds_the_marked_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(SAMPLE, encoding="utf-8")
    blocks = runnable_blocks(page)
    assert [(block.line, block.language) for block in blocks] == [(7, "sh"), (13, "python"), (25, "python")]
    assert blocks[0].code == "echo fine\n"
    assert blocks[1].code == 'import sys\n\nprint("in a list item", file=sys.stderr)\n'
    assert blocks[0].where == f"{page}:7"


def test_broken_blocks_fail_naming_file_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(SAMPLE, encoding="utf-8")
    fine, in_list, broken = runnable_blocks(page)
    run_block(fine)
    run_block(in_list)
    with pytest.raises(AssertionError, match=rf"{re.escape(str(page))}:25: exited with 1(.|\n)*broken on purpose"):
        run_block(broken)
    failing_sh = Block(page, 3, "sh", "true\nfalse\necho not reached\n")
    with pytest.raises(AssertionError, match=r"page\.md:3: exited with 1"):
        run_block(failing_sh)


def test_a_block_past_its_timeout_fails(tmp_path: Path) -> None:
    sleeper = Block(tmp_path / "page.md", 1, "sh", "sleep 30\n")
    with pytest.raises(AssertionError, match=r"page\.md:1: ran past 1 s"):
        run_block(sleeper, timeout_s=1)


@pytest.mark.slow
def test_a_wrong_config_block_fails(tmp_path: Path) -> None:
    config = Block(tmp_path / "page.md", 1, "toml", '[components]\natention = "auto"\n')
    with pytest.raises(AssertionError, match=r"page\.md:1: exited with(.|\n)*did you mean attention"):
        run_block(config)


def test_runnable_in_an_unknown_language_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```rust runnable\nfn main() {}\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"page\.md:1: a block marked runnable must be one of"):
        runnable_blocks(page)
