"""The package keeps the shape docs/architecture.md promises: modules under 700 lines,
functions under 100, and no module importing another xreshard module's private names.
The demo (``xreshard/tools/demo.py``) is exempt from the size rules, as examples are."""

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
