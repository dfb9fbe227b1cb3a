"""Parameter inventories of real models (names, shapes, dtypes; no weights).

The package ships one JSON file per model under ``xreshard/catalog/models/``: the *stacked* layout
for mixture-of-experts models (experts fused into 3-D tensors, as transformers >= 5 and
grouped-GEMM trainers hold them) and the only layout of dense models. The *per-expert*
layout (one tensor per routed expert, as the published checkpoints, transformers 4.x, vLLM
and SGLang name them) is generated from the stacked file by the exact inverse of
transformers' checkpoint conversion (``qwen2_moe`` rule: stack experts on dim 0, then
concatenate gate and up on dim 1)::

    stacked                                          per expert e
    model.layers.N.mlp.experts.gate_up_proj [E,2I,H] -> ...experts.e.gate_proj.weight [I,H]
                                                        ...experts.e.up_proj.weight   [I,H]
    model.layers.N.mlp.experts.down_proj    [E,H,I]  -> ...experts.e.down_proj.weight [H,I]

Per-expert tensors take the place of the two stacked ones, expert by expert
(e0.gate, e0.up, e0.down, e1.gate, ...), which is the published per-expert order.

File schema (``docs/models.md`` §3; how the files were made: §4): ``{"model", "dtype",
"dtype_overrides": {name: dtype}, "layout": "stacked" | "per_expert" | "dense", "config",
"params": [[name, shape], ...]}``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

from ..dtypes import itemsize
from ..errors import XreshardError

__all__ = ["Param", "Model", "ModelError", "load_model", "list_models", "MODELS_DIR"]

#: where the packaged inventories live
MODELS_DIR = Path(__file__).with_name("models")

LAYOUTS = ("per_expert", "stacked")

_STACKED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\."
                         r"(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


class ModelError(XreshardError):
    """A model inventory cannot be found or read."""


class Param(NamedTuple):
    """One tensor of a model: canonical (HF) name, global shape, dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class Model:
    """A model's parameter inventory.

    ``params`` is in module order; ``layout`` is ``"per_expert"``, ``"stacked"`` or
    ``"dense"``; ``config`` holds the shape-relevant HF config values.
    """

    name: str
    params: tuple[Param, ...]
    config: Mapping[str, Any] = field(default_factory=dict)
    layout: str = "dense"

    @property
    def num_tensors(self) -> int:
        return len(self.params)

    @property
    def total_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(p.shape) * itemsize(p.dtype) for p in self.params)

    def __str__(self) -> str:
        return (f"{self.name} ({self.layout}, {self.num_tensors} tensors, "
                f"{self.total_bytes / 2**30:.1f} GiB)")


def list_models() -> list[str]:
    """Names ``load_model`` resolves: the packaged inventories, without ``_stacked``."""
    return sorted({p.stem.removesuffix("_stacked") for p in MODELS_DIR.glob("*.json")})


def load_model(name_or_path: str | Path, layout: str = "per_expert") -> Model:
    """Load a model inventory by packaged name (``"deepseek_v3"``) or JSON path.

    Args:
        name_or_path: a packaged name (see ``list_models()``; a ``_stacked`` suffix is
            accepted) or the path of a JSON inventory in the schema above.
        layout: ``"per_expert"`` or ``"stacked"``: how routed experts are listed. Dense
            models have one layout and ignore it. Either layout is derived from a file
            in the other.

    Returns:
        A ``Model``; repeated calls return the same (immutable) object.

    Raises:
        ModelError: unknown name, unreadable file, or an unknown ``layout``.
    """
    if layout not in LAYOUTS:
        raise ModelError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    return _load(str(_resolve(name_or_path)), layout)


def _resolve(name_or_path: str | Path) -> Path:
    text = str(name_or_path)
    looks_like_path = text.endswith(".json") or "/" in text or "\\" in text
    if looks_like_path:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ModelError(f"model file {text!r} does not exist; pass a packaged model name "
                             f"({', '.join(list_models())}) or the path of a JSON inventory")
        return path
    base = text.removesuffix("_stacked")
    for stem in (f"{base}_stacked", base):
        path = MODELS_DIR / f"{stem}.json"
        if path.is_file():
            return path
    raise ModelError(f"unknown model {text!r}; packaged models are {', '.join(list_models())} "
                     "(or pass the path of a JSON inventory)")


@lru_cache(maxsize=32)
def _load(path: str, layout: str) -> Model:
    try:
        with open(path) as f:
            data = json.load(f)
        raw = data["params"]
        default = data.get("dtype", "bfloat16")
        overrides = data.get("dtype_overrides") or {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot read model inventory {path!r}: {e}; expected JSON with "
                         '"params": [[name, shape], ...] and "dtype"') from e
    params = tuple(Param(n, tuple(int(d) for d in s), overrides.get(n, default)) for n, s in raw)
    file_layout = data.get("layout") or _detect_layout(params)
    if file_layout != "dense" and file_layout != layout:
        params = to_per_expert(params) if layout == "per_expert" else to_stacked(params)
    out_layout = file_layout if file_layout == "dense" else layout
    name = str(data.get("model") or Path(path).stem.removesuffix("_stacked"))
    return Model(name, params, MappingProxyType(dict(data.get("config") or {})), out_layout)


def _detect_layout(params: tuple[Param, ...]) -> str:
    for p in params:
        if _STACKED.match(p.name):
            return "stacked"
        if _PER_EXPERT.match(p.name):
            return "per_expert"
    return "dense"


def to_per_expert(params: tuple[Param, ...] | list[Param]) -> tuple[Param, ...]:
    """Stacked expert tensors -> one tensor per expert, in the published checkpoint order.

    Raises:
        ModelError: a layer's ``gate_up_proj`` and ``down_proj`` are not adjacent or their
            shapes disagree (``[E, 2I, H]`` and ``[E, H, I]``).
    """
    out: list[Param] = []
    i, n = 0, len(params)
    while i < n:
        p = params[i]
        m = _STACKED.match(p.name)
        if m is None:
            out.append(p)
            i += 1
            continue
        nxt = params[i + 1] if i + 1 < n else None
        prefix = m["prefix"]
        if (m["kind"] != "gate_up_proj" or nxt is None
                or nxt.name != f"{prefix}.down_proj"):
            raise ModelError(f"stacked expert tensor {p.name!r} is not followed by "
                             f"{prefix}.down_proj; a stacked layer lists gate_up_proj then "
                             "down_proj")
        if len(p.shape) != 3 or len(nxt.shape) != 3 or p.shape[1] % 2:
            raise ModelError(f"{p.name!r} {p.shape} / {nxt.name!r} {nxt.shape}: expected "
                             "[E, 2I, H] and [E, H, I]")
        num_experts, two_i, hidden = p.shape
        inter = two_i // 2
        if nxt.shape != (num_experts, hidden, inter):
            raise ModelError(f"{nxt.name!r} has shape {nxt.shape}; with {p.name!r} "
                             f"{p.shape} it must be {(num_experts, hidden, inter)}")
        for e in range(num_experts):
            out.append(Param(f"{prefix}.{e}.gate_proj.weight", (inter, hidden), p.dtype))
            out.append(Param(f"{prefix}.{e}.up_proj.weight", (inter, hidden), p.dtype))
            out.append(Param(f"{prefix}.{e}.down_proj.weight", (hidden, inter), nxt.dtype))
        i += 2
    return tuple(out)


def to_stacked(params: tuple[Param, ...] | list[Param]) -> tuple[Param, ...]:
    """Per-expert tensors -> stacked ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.

    Each layer's experts must be listed 0..E-1, consecutively (the checkpoint order).
    """
    out: list[Param] = []
    i, n = 0, len(params)
    while i < n:
        p = params[i]
        m = _PER_EXPERT.match(p.name)
        if m is None:
            out.append(p)
            i += 1
            continue
        prefix, e = m["prefix"], 0
        gate = p
        while i < n:
            m = _PER_EXPERT.match(params[i].name)
            if m is None or m["prefix"] != prefix:
                break
            trio = params[i:i + 3]
            want = [f"{prefix}.{e}.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")]
            if [t.name for t in trio] != want:
                raise ModelError(f"expected {want} at position {i}, found "
                                 f"{[t.name for t in trio]}; per-expert tensors must be listed "
                                 "expert by expert (gate, up, down)")
            i += 3
            e += 1
        inter, hidden = gate.shape
        out.append(Param(f"{prefix}.gate_up_proj", (e, 2 * inter, hidden), gate.dtype))
        out.append(Param(f"{prefix}.down_proj", (e, hidden, inter), params[i - 1].dtype))
    return tuple(out)
