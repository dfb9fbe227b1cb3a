"""Old module paths of modules that moved into ``ir/``, ``planner/`` and ``runtime/``.

``import xreshard.layout`` (documented before the move) still works: it is the same module
object as ``xreshard.ir.layout``, so a monkeypatch through either name patches both. The
finder answers only for the names below and imports nothing until one is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

#: old name (under ``xreshard.``) -> new module path
MOVED: dict[str, str] = {
    **{m: f"xreshard.ir.{m}" for m in ("geometry", "intervals", "layout", "topology")},
    **{m: f"xreshard.planner.{m}" for m in ("templates", "streams", "balance", "plan",
                                             "schedule", "relay")},
    **{m: f"xreshard.runtime.{m}" for m in ("world", "world_transports", "store", "binding",
                                             "metadata", "execute", "copies", "wire",
                                             "devices", "verify", "refit", "handle",
                                             "registry", "commcount")},
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        pass        # already executed under its new name


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``xreshard.<old>`` as the module now at ``MOVED[old]``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        head, _, tail = fullname.partition(".")
        if head != "xreshard" or tail not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(MOVED[tail]))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
