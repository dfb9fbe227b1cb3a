"""The package keeps the shape docs/architecture.md promises: the layers import in one
direction (``ir`` <- ``planner`` <- ``runtime``, nothing of the core importing the tools,
catalog or simulator on top), modules under 700 lines, functions under 100, and no module
importing another xreshard module's private names. The demo (``xreshard/tools/demo.py``)
is exempt from the size rules, as examples are."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "xreshard"
EXEMPT = {PACKAGE / "tools" / "demo.py"}


def _modules() -> list[tuple[Path, ast.Module, int]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        out.append((path, ast.parse(text), len(text.splitlines())))
    assert len(out) > 40                       # the walk sees the package
    return out


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, tree: ast.Module) -> list[tuple[int, str]]:
    """Every xreshard module ``path`` imports, anywhere in it (lazy imports too), as
    ``(line, dotted name)``; ``from . import x`` names the submodule ``x``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None:     # from . import x, y: the submodules
                out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
    return [(line, t) for line, t in out if t == "xreshard" or t.startswith("xreshard.")]


#: layer (the folder or module under xreshard/) -> the layers it may import; None: any
#: but FORBIDDEN's
ALLOWED = {
    "ir": {"ir", "errors", "dtypes"},
    "planner": {"planner", "ir", "errors", "dtypes"},
}
#: layer -> layers it never imports (what sits on top of it)
FORBIDDEN = {
    "runtime": {"sim", "catalog", "tools", "adapters", "cli"},
    "transport": {"sim", "catalog", "tools", "adapters", "cli"},
}


def _layer(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def direction_breaks() -> list[str]:
    """Every import that breaks a direction of ALLOWED / FORBIDDEN."""
    found = []
    for path, tree, _ in _modules():
        layer = _layer(_module_name(path))
        for line, target in _imports(path, tree):
            other = _layer(target)
            if other == layer:
                continue
            allowed, forbidden = ALLOWED.get(layer), FORBIDDEN.get(layer, set())
            if (allowed is not None and other not in allowed) or other in forbidden:
                found.append(f"{path.relative_to(PACKAGE)}:{line} ({layer}) imports {target}")
    return found


def test_layers_import_in_one_direction():
    """ir imports nothing of xreshard but errors and dtypes; the planner only the IR (and
    errors, dtypes); the runtime and the transports never the simulator, the catalog, the
    tools, the adapters or the CLI. Lazy (in-function) imports count."""
    assert direction_breaks() == []


def test_the_direction_check_sees_imports(tmp_path):
    """The check can fail: it resolves relative, lazy and ``from . import`` imports."""
    src = "from ..runtime import execute\n\ndef f():\n    from . import plan\n    import xreshard.sim\n"
    found = _imports(PACKAGE / "planner" / "x.py", ast.parse(src))
    assert found == [(1, "xreshard.runtime"), (4, "xreshard.planner.plan"), (5, "xreshard.sim")]
    assert _layer("xreshard.runtime.execute") == "runtime" and _layer("xreshard.errors") == "errors"


def test_no_module_over_700_lines_and_no_function_over_100():
    long_modules, long_functions = [], []
    for path, tree, lines in _modules():
        if path in EXEMPT:
            continue
        if lines > 700:
            long_modules.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.lineno} "
                                          f"{node.name}: {n} lines")
    assert long_modules == [] and long_functions == []


def test_no_module_imports_another_modules_private_names():
    found = []
    for path, tree, _ in _modules():
        me = _module_name(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:                     # relative: resolve against this package
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("xreshard") or target == me:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{me}:{node.lineno} from {target} import {alias.name}")
    assert found == []


def test_one_install_hint_per_extra():
    """Every optional import goes through ``xreshard.extras.require``: each hint names an
    extra that pyproject.toml defines, and a missing module says who needed it."""
    import re
    import sys

    import pytest

    from xreshard import extras
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    defined = set(re.findall(r"^([a-z0-9-]+) = \[", text.split("[project.optional-dependencies]")[1],
                             re.M))
    assert set(extras.HINTS) <= defined, set(extras.HINTS) - defined
    for extra, hint in extras.HINTS.items():
        assert f"xreshard[{extra}]" in hint
    sys.modules["xreshard_no_such_module"] = None       # type: ignore[assignment]
    try:
        with pytest.raises(ImportError, match=r"the thing needs xreshard_no_such_module: "
                                              r"pip install 'xreshard\[torch\]'"):
            extras.require("xreshard_no_such_module", "torch", "the thing")
    finally:
        del sys.modules["xreshard_no_such_module"]
    hand_written = [f"{p.relative_to(PACKAGE)}" for p, _, _ in _modules()
                    if "pip install" in p.read_text() and p.name not in (
                        "extras.py", "nccl_setup.py", "demo.py", "plot.py", "simulate.py")]
    assert hand_written == []
