"""Every Python block in README.md and docs/*.md runs as written.

Each fenced ```python block is extracted and run as a script in a fresh folder, in its own
process (which may start more: the README's launcher starts a trainer and torchrun). An
HTML comment on the line before a block says what to do with it::

    <!-- doc-test: file trainer.py -->       saved as trainer.py for a later block to run
    <!-- doc-test: run (slow) -->            run it (the default); (slow): in the slow tier
    <!-- doc-test: requires transformers --> run only where these modules import
    <!-- doc-test: skip: needs a GPU -->     not run (the reason is required); its import
                                             statements still run, so the names it uses
                                             cannot drift from the API
    <!-- doc-test: slow; skip: ... -->        in the slow tier (heavy imports)

Directives combine with ``;`` (``skip:`` last: its reason runs to the comment's end). A block is run unless it is explicitly excused, and a
``file`` block no later block runs is an error, so no block is silently left out.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    doc: str            # path relative to the repository
    line: int           # line of the opening fence
    code: str
    run: bool = True
    slow: bool = False
    file: str | None = None
    requires: tuple[str, ...] = ()
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _parse(directive: str, doc: str, line: int) -> dict:
    out: dict = {}
    directive, sep, reason = directive.partition("skip:")    # a reason may hold anything
    if sep:
        if not reason.strip():
            raise ValueError(f"{doc}:{line}: 'skip:' needs a reason")
        out.update(skip=reason.strip(), run=False)
    for part in (p.strip() for p in directive.split(";") if p.strip()):
        if part.startswith("file "):
            out.update(file=part[5:].strip(), run=False)
        elif part in ("run", "run (slow)"):
            out.update(run=True, slow=part.endswith("(slow)"))
        elif part == "slow":
            out["slow"] = True
        elif part.startswith("requires "):
            out["requires"] = tuple(part[9:].split())
        else:
            raise ValueError(f"{doc}:{line}: unknown doc-test directive {part!r} (file NAME, "
                             "run, run (slow), slow, requires MODULE..., skip: REASON)")
    return out


def blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of one document, with their directives."""
    text = path.read_text()
    doc = str(path.relative_to(ROOT))
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        d = _DIRECTIVE.search(before)
        fields = _parse(d.group(1), doc, line) if d else {}
        out.append(Block(doc, line, m.group(1), **fields))
    return out


ALL = [b for path in DOCS for b in blocks(path)]


def _id(b: Block) -> str:
    return b.id


def test_every_block_is_run_or_explicitly_excused():
    assert any(b.doc == "README.md" for b in ALL)
    for doc in {b.doc for b in ALL}:
        mine = [b for b in ALL if b.doc == doc]
        for i, b in enumerate(mine):
            if b.file is not None:
                later = [c for c in mine[i + 1:] if c.run and b.file in c.code]
                assert later, f"{b.id}: saved as {b.file} but no later block runs it"
            else:
                assert b.run or b.skip, f"{b.id}: neither run nor excused"


def test_the_readme_use_example_is_run():
    use = [b for b in ALL if b.doc == "README.md" and b.run and "launch.py" in b.code]
    assert use and all(b.file is None and b.skip is None for b in use)
    files = {b.file for b in ALL if b.doc == "README.md"}
    assert {"trainer.py", "rollout.py"} <= files


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "")
                                                       .split(os.pathsep) if p])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _run(script: str, folder: pathlib.Path, timeout: float, what: str,
         keep: list | None = None) -> None:
    """Run ``script`` in ``folder`` as a process of its own; ``keep`` gets its output."""
    (folder / "block.py").write_text(script)
    proc = subprocess.run([sys.executable, "block.py"], cwd=folder, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    if keep is not None:
        keep.append(proc.stdout)


RUN = [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
       for b in ALL if b.run]


@pytest.mark.parametrize("block", RUN)
def test_block_runs_as_written(block: Block, tmp_path):
    missing = _missing(block.requires)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    for b in ALL:       # the files this document's earlier blocks define
        if b.doc == block.doc and b.file is not None and b.line < block.line:
            (tmp_path / b.file).write_text(b.code)
    _run(block.code, tmp_path, 900 if block.slow else 300, block.id)


SKIPPED = [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
           for b in ALL if b.skip]


def _imports(block: Block) -> tuple[str, tuple[str, ...]]:
    """An excused block's import statements (it must parse) and the modules they start at."""
    tree = ast.parse(block.code, filename=block.id)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    roots = tuple(sorted({(a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
                          for n in imports for a in n.names}))
    return "\n".join(ast.unparse(n) for n in imports) + "\n", roots


_IMPORTED: dict[bool, dict[str, str | None]] = {}


def _excused_imports(slow: bool, folder: pathlib.Path) -> dict[str, str | None]:
    """Block id -> None, or the traceback of its import statements, for every excused block
    of this tier whose modules are installed: one process runs them all, each block's in a
    namespace of its own (the heavy ones import vLLM: once, not once per block)."""
    if slow not in _IMPORTED:
        blocks = {b.id: _imports(b)[0] for b in ALL
                  if b.skip and b.slow == slow and not _missing(_imports(b)[1])}
        mark = "XRESHARD-IMPORTS "
        _run("import json, traceback\nout = {}\n"
             f"for what, code in {blocks!r}.items():\n"
             "    try:\n        exec(compile(code, what, 'exec'), {})\n        out[what] = None\n"
             "    except BaseException:\n        out[what] = traceback.format_exc()\n"
             f"print({mark!r} + json.dumps(out))\n", folder, 300, "the excused blocks' imports",
             keep=(out := []))
        line = next(x for x in out[0].splitlines() if x.startswith(mark))
        _IMPORTED[slow] = json.loads(line[len(mark):])
    return _IMPORTED[slow]


@pytest.mark.parametrize("block", SKIPPED)
def test_an_excused_block_still_compiles_and_imports(block: Block, tmp_path):
    """A block that cannot run here (a GPU, a vLLM engine) still parses, and the names it
    imports exist."""
    missing = _missing(_imports(block)[1])
    if missing:
        pytest.skip(f"its imports need {', '.join(missing)}")
    error = _excused_imports(block.slow, tmp_path)[block.id]
    assert error is None, f"{block.id}: its imports failed:\n{error}"
