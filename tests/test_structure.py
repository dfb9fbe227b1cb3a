"""The package keeps the shape docs/architecture.md promises: the layers import in one
direction (``ir`` <- ``planner`` <- ``runtime``, nothing of the core importing the tools,
catalog or simulator on top), modules under 700 lines, functions under 100, and no module
importing another xreshard module's private names. The demo (``xreshard/tools/demo.py``)
is exempt from the size rules, as examples are. Every dotted xreshard name the docstrings
and docs/ mention resolves (``reference_breaks`` says what counts as one).

The lint and the type check (``ruff check xreshard && mypy``, configured in pyproject.toml)
run in .ci/run beside the tests."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

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


# ---------------------------------------------------------------- references in the docs

#: README.md and docs/*.md: code spans naming xreshard objects are checked like docstrings
DOCS = [PACKAGE.parent / "README.md"] + sorted((PACKAGE.parent / "docs").glob("*.md"))
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_FILE_SUFFIXES = {"py", "md", "json", "toml", "txt", "so", "sh", "cfg", "yaml", "yml", "csv"}


class _Index:
    """The package read statically (nothing imported: no framework, no import side effect):
    what each module binds at top level and what each class defines."""

    def __init__(self) -> None:
        self.trees = {_module_name(p): (p, tree) for p, tree, _ in _modules()}
        self._bindings: dict[str, dict[str, tuple]] = {}

    def module(self, name: str) -> str | None:
        return name if name in self.trees else None

    def bindings(self, mod: str) -> dict[str, tuple]:
        """name -> ("module", dotted) | ("from", module, name) | ("class", node) | ("def",) |
        ("value",), for every name ``mod`` binds at top level (inside if/try too)."""
        if mod in self._bindings:
            return self._bindings[mod]
        path, tree = self.trees[mod]
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out: dict[str, tuple] = {}
        todo = list(tree.body)
        while todo:
            node = todo.pop(0)
            if isinstance(node, (ast.If, ast.Try)):
                todo += node.body + node.orelse + getattr(node, "finalbody", [])
                todo += [s for h in getattr(node, "handlers", []) for s in h.body]
            elif isinstance(node, ast.ClassDef):
                out[node.name] = ("class", node, mod)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = ("def",)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            out[name.id] = ("value",)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    out[a.asname or a.name.split(".")[0]] = ("module", a.name if a.asname
                                                             else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    out[a.asname or a.name] = ("from", base, a.name)
        self._bindings[mod] = out
        return out

    def resolve(self, mod: str, parts: list[str]) -> bool | None:
        """Whether ``parts`` names something in module ``mod``: True, False, or None where
        it leaves the package (a framework's object) or cannot be known statically (an
        attribute of a function or of a value)."""
        if not parts:
            return True
        head, rest = parts[0], parts[1:]
        got = self.bindings(mod).get(head)
        if got is None:
            sub = self.module(f"{mod}.{head}")
            if sub is not None:
                return self.resolve(sub, rest)
            return None if "__getattr__" in self.bindings(mod) and mod != "xreshard" else False
        return self._follow(got, rest)

    def _follow(self, got: tuple, rest: list[str]) -> bool | None:
        if got[0] == "module":
            target = self.module(got[1])
            return self.resolve(target, rest) if target else None
        if got[0] == "from":
            target = self.module(got[1])
            if target is None:
                return None
            return self.resolve(target, [got[2], *rest])
        if got[0] == "class":
            return self.member(got[1], got[2], rest)
        return True if not rest else None

    def member(self, cls: ast.ClassDef, mod: str, parts: list[str]) -> bool | None:
        """``parts`` looked up in class ``cls`` (of module ``mod``) and its bases: methods,
        nested classes, class-level names (dataclass fields, enum members) and attributes
        its methods set (``self.x = ...``, ``object.__setattr__(self, "x", ...)``)."""
        if not parts:
            return True
        head, rest = parts[0], parts[1:]
        for node in cls.body:
            if isinstance(node, ast.ClassDef) and node.name == head:
                return self.member(node, mod, rest)
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "__setattr__" and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
        if head in names:
            return True if not rest else None
        if "__getattr__" in names:
            return None
        for base in cls.bases:
            dotted = ast.unparse(base).split("[")[0].split(".")
            if dotted == ["object"]:
                continue
            got = self.bindings(mod).get(dotted[0])
            found = self._base_member(got, dotted[1:], parts)
            if found is not False:
                return found
        return False

    def _base_member(self, got: tuple | None, path: list[str], parts: list[str]) -> bool | None:
        if got is None:
            return None                          # a builtin base (Exception, ...)
        if got[0] == "from":
            target = self.module(got[1])
            if target is None:
                return None                      # a framework's base class
            got = self.bindings(target).get(got[2]) or (
                ("module", f"{target}.{got[2]}") if self.module(f"{target}.{got[2]}") else None)
            return self._base_member(got, path, parts)
        if got[0] == "class" and not path:
            return self.member(got[1], got[2], parts)
        return None


def _references(text: str, spans: re.Pattern) -> list[tuple[int, str]]:
    """``(line offset, dotted name)`` for each code span of ``text`` that is a dotted name
    (a trailing ``()`` allowed); code samples (``a.b(c)``, ``x = y.z``) and file names
    (``refit.py``) are not references."""
    out = []
    for m in spans.finditer(text):
        body = next(g for g in m.groups() if g is not None).strip()
        body = body[:-2] if body.endswith("()") else body
        if _DOTTED.fullmatch(body) and body.rpartition(".")[2] not in _FILE_SUFFIXES:
            out.append((text.count("\n", 0, m.start()), body))
    return out


def reference_breaks(checked: list[tuple[str, bool | None]] | None = None) -> list[str]:
    """Every double-backticked dotted name in a docstring (any string statement: module,
    class, function and field docstrings) and every backticked one in README.md and docs/
    that names an object of xreshard which does not exist.

    What counts as a reference: the whole code span is a dotted name (``a.b.c``, or
    ``a.b.c()``), and its first name is ``xreshard`` (or ``xr``, as in
    ``import xreshard as xr``), a name the docstring's module binds that leads into the
    package (a class, function or value defined there, or an xreshard import), a public
    name of ``xreshard`` (``Refit.close``), or the name of a class defined anywhere in the
    package (``CallOptions.halved``). Names of frameworks (``jax.Array``), locals
    (``self.world``, ``cfg.timeout``) and file names are not. A class member is anything
    the class or an xreshard base defines, including dataclass fields and attributes its
    methods set; members of a builtin or framework base, and attributes of functions or
    module values, are taken on trust."""
    index = _Index()
    top = {n: b for n, b in index.bindings("xreshard").items() if not n.startswith("_")}
    classes: dict[str, list[tuple]] = {}        # every class the package defines, by name
    for mod in index.trees:
        for b in index.bindings(mod).values():
            if b[0] == "class" and b[2] == mod:
                classes.setdefault(b[1].name, []).append(b)
    found = []

    def check(where: str, line: int, name: str, local: dict[str, tuple]) -> None:
        head, *rest = name.split(".")
        if head in ("xreshard", "xr"):
            ok = index.resolve("xreshard", rest)
        elif head in local and local[head][0] not in ("module", "from"):
            ok = index._follow(local[head], rest)
        elif head in local:
            target = local[head][1]
            if not (target == "xreshard" or target.startswith("xreshard.")):
                return                           # a framework's name
            ok = index._follow(local[head], rest)
        elif head in top:
            ok = index._follow(top[head], rest)
        elif head in classes:                   # a class of another module, by its name
            results = [index._follow(b, rest) for b in classes[head]]
            ok = True if True in results else None if None in results else False
        else:
            return
        if checked is not None:
            checked.append((name, ok))
        if ok is False:
            found.append(f"{where}:{line}: ``{name}`` names nothing in xreshard")

    docstring = re.compile(r"``([^`]+?)``")
    for mod, (path, tree) in index.trees.items():
        local = index.bindings(mod)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                for offset, name in _references(node.value.value, docstring):
                    check(str(path.relative_to(PACKAGE.parent)), node.lineno + offset, name,
                          local)
    code_span = re.compile(r"``(.+?)``|`([^`\n]+)`")
    for doc in DOCS:
        text = re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), doc.read_text(),
                      flags=re.S)                # fenced blocks run in test_docs.py
        for offset, name in _references(text, code_span):
            check(str(doc.relative_to(PACKAGE.parent)), offset + 1, name, {})
    return found


def test_docstring_and_docs_references_resolve():
    """Every dotted xreshard name the docstrings and docs/ mention exists (see
    ``reference_breaks`` for what counts): a renamed or removed object fails here."""
    assert reference_breaks() == []


def test_the_reference_check_can_fail():
    """The check sees the references (well over a hundred resolve) and tells a stale one:
    a missing module, function, class member or dataclass field, through re-exports and base
    classes; a module path from before the folders (``xreshard.layout``) is gone."""
    checked: list[tuple[str, bool | None]] = []
    reference_breaks(checked)
    assert sum(ok is True for _, ok in checked) > 100
    text = ("See ``xreshard.runtime.refit.Refit`` and ``RefitConfig.timeout()``; not "
            "``a.b(c)``, ``jax.Array`` or ``refit.py``.\n``x = y.z``")
    assert _references(text, re.compile(r"``([^`]+?)``")) == [
        (0, "xreshard.runtime.refit.Refit"), (0, "RefitConfig.timeout"), (0, "jax.Array")]
    index = _Index()
    good = ["runtime.refit.Refit", "Refit.start", "RefitConfig.timeout",
            "ir.layout.Layout.from_spec", "ir.layout.Mesh.ranks", "World.join",
            "transport.base.Transport"]
    bad = ["runtime.no_such", "runtime.refit.Refit.no_such", "RefitConfig.no_such_field",
           "ir.layout.Layout.no_such", "no_such", "ir.layout.Mesh.ranks.no_such.x"]
    assert [index.resolve("xreshard", n.split(".")) for n in good] == [True] * len(good)
    assert [index.resolve("xreshard", n.split(".")) for n in bad] == [False] * (len(bad) - 1) + [None]
    assert index.resolve("xreshard", ["layout", "Layout"]) is False
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("xreshard.layout")
    # taken on trust: a builtin base's member, an attribute of a value
    assert index.resolve("xreshard", ["RefitError", "args"]) is None
