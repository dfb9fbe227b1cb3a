"""LoRA adapters as a trainer holds them: names, PEFT config, and the directory format.

A :class:`LoRAAdapter` is what a trainer refits into a serving engine's LoRA slot: per
target module the two factors ``A`` and ``B`` (JAX arrays with any sharding, torch
tensors, numpy arrays), the rank ``r`` and ``alpha``. It names its tensors the way PEFT
saves them (``base_model.model.<module>.lora_A.weight``, ``[r, in]``; ``lora_B``,
``[out, r]``), so the engine side meets exactly what it would read from a PEFT directory,
and :func:`write_peft_dir` writes that directory (``adapter_config.json`` +
``adapter_model.safetensors``) for a reference load or a checkpoint.

The factors may also be held as kernels, ``A`` ``[in, r]`` and ``B`` ``[r, out]``
(``kernel_layout=True``: Flax ``Dense`` kernels, ``x @ A @ B``); they are then bound
through transposed views, never copied.

Imports nothing heavy: arrays are only asked for ``shape`` and ``dtype`` until
:func:`write_peft_dir` reads them.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..dtypes import dtype_name
from ..errors import LayoutError, RefitError

__all__ = ["LoRAError", "LoRAAdapter", "write_peft_dir", "PEFT_PREFIX", "peft_module", "check_spec",
           "merge_specs"]

#: how PEFT prefixes the module names of a saved adapter
PEFT_PREFIX = "base_model.model."

_FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64"})


class LoRAError(RefitError):
    """An adapter does not fit the engine it is refit into (target modules, rank, shapes,
    dtypes, ids), or the engine cannot take it; raised on every process of the round,
    with the same message, before any byte moves."""


def peft_module(tensor_name: str) -> tuple[str, str]:
    """``(module, "A" | "B")`` of a PEFT tensor name
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    ``("model.layers.0.self_attn.q_proj", "A")``)."""
    parts = tensor_name.removeprefix(PEFT_PREFIX).split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise LoRAError(f"{tensor_name!r} is not a PEFT LoRA tensor name "
                        f"('{PEFT_PREFIX}<module>.lora_A.weight' or '.lora_B.weight')")
    return ".".join(parts[:-2]), parts[-2][-1]


@dataclass(frozen=True)
class LoRAAdapter:
    """One LoRA adapter, as a trainer holds it.

    Attributes:
        name: the adapter's name in the engine (vLLM's ``lora_name``); also the prefix of
            its tensors' names in a refit (``"<name>/<PEFT tensor name>"``). No ``/``.
        lora_id: the engine slot identity (vLLM's ``lora_int_id``, >= 1). Refitting an id
            again replaces that adapter once every rank holds the new one.
        r: the LoRA rank (``A`` has ``r`` rows, ``B`` ``r`` columns).
        alpha: ``lora_alpha``; the engine applies ``alpha / r`` (``alpha / sqrt(r)`` with
            ``use_rslora``) once, as when it loads the same adapter from a directory.
        weights: module name (the base model's, e.g. ``"model.layers.0.self_attn.q_proj"``)
            -> ``(A, B)``: ``A`` ``[r, in]``, ``B`` ``[out, r]`` (``[in, r]`` and ``[r, out]``
            with ``kernel_layout``). JAX arrays (any sharding), torch tensors or numpy
            arrays; float dtypes.
        kernel_layout: the factors are kernels (``x @ A @ B``), bound transposed.
        use_rslora: PEFT's rank-stabilized scaling.
        extra_config: more ``adapter_config.json`` fields (``rank_pattern``, ...), passed
            to the engine as they are.
    """

    name: str
    lora_id: int
    r: int
    alpha: float
    weights: Mapping[str, tuple[Any, Any]]
    kernel_layout: bool = False
    use_rslora: bool = False
    extra_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"LoRA adapter {self.name!r}"
        if not self.name or "/" in self.name:
            raise LoRAError(f"{where}: a name must be non-empty and free of '/' (it prefixes "
                            "the adapter's tensor names in a refit)")
        if int(self.lora_id) < 1:
            raise LoRAError(f"{where}: lora_id must be >= 1 (vLLM's lora_int_id), got "
                            f"{self.lora_id}")
        if int(self.r) < 1:
            raise LoRAError(f"{where}: r must be >= 1, got {self.r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) \
                or not math.isfinite(alpha) or alpha <= 0:
            raise LoRAError(f"{where}: alpha (lora_alpha) must be a finite number > 0, got "
                            f"{alpha!r}; the engine scales the adapter by alpha / r, so "
                            f"a NaN or negative alpha would serve NaN or wrong logits")
        if not self.weights:
            raise LoRAError(f"{where}: no target modules in weights")
        for module, pair in self.weights.items():
            self._check_pair(module, pair)

    def _check_pair(self, module: str, pair: Any) -> None:
        where = f"LoRA adapter {self.name!r} module {module!r}"
        if module.startswith(PEFT_PREFIX) or module.endswith((".weight", ".lora_A", ".lora_B")):
            raise LoRAError(f"{where}: name modules as the base model does "
                            "('model.layers.0.self_attn.q_proj'), not as PEFT tensors")
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise LoRAError(f"{where}: expected a pair (A, B), found {type(pair).__name__}")
        a, b = (tuple(int(n) for n in t.shape) for t in pair)
        if len(a) != 2 or len(b) != 2:
            raise LoRAError(f"{where}: A and B must be 2-D, found {a} and {b}")
        a, b = (a[::-1], b[::-1]) if self.kernel_layout else (a, b)
        if a[0] != self.r or b[1] != self.r:
            held = "A [in, r], B [r, out]" if self.kernel_layout else "A [r, in], B [out, r]"
            raise LoRAError(f"{where}: A is {a[0]}x{a[1]} and B {b[0]}x{b[1]} as PEFT "
                            f"orients them ([r, in], [out, r]) but r={self.r}; the factors "
                            f"must be held as {held}")
        for t, ab in zip(pair, "AB"):
            dt = dtype_name(t.dtype)
            if dt not in _FLOAT_DTYPES:
                raise LoRAError(f"{where}: {ab} has dtype {dt}; LoRA factors are floats "
                                f"({', '.join(sorted(_FLOAT_DTYPES))})")

    # ------------------------------------------------------------ names

    def tensors(self) -> dict[str, Any]:
        """PEFT tensor name -> the array as held (A and B of every module)."""
        out = {}
        for module, (a, b) in self.weights.items():
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
        return out

    def refit_name(self, tensor_name: str) -> str:
        """The name a PEFT tensor of this adapter moves under in a refit."""
        return f"{self.name}/{tensor_name}"

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """PEFT tensor name -> (shape as PEFT orients it, dtype name)."""
        out = {}
        for name, t in self.tensors().items():
            shape = tuple(int(n) for n in t.shape)
            out[name] = (shape[::-1] if self.kernel_layout else shape, dtype_name(t.dtype))
        return out

    def num_bytes(self) -> int:
        """Bytes of every factor (what a gather-and-broadcast sends each engine rank)."""
        from ..dtypes import itemsize
        return sum(math.prod(s) * itemsize(d) for s, d in self.shapes().values())

    def peft_config(self) -> dict[str, Any]:
        """The ``adapter_config.json`` of this adapter (PEFT's fields vLLM reads)."""
        targets = sorted({m.rsplit(".", 1)[-1] for m in self.weights})
        alpha = float(self.alpha)
        return {"peft_type": "LORA", "r": int(self.r),
                "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
                "target_modules": targets, "bias": "none", "use_rslora": bool(self.use_rslora),
                **dict(self.extra_config)}

    def spec(self) -> dict[str, Any]:
        """What the engine needs to know of this adapter before bytes move (JSON)."""
        return {"name": self.name, "lora_id": int(self.lora_id), "config": self.peft_config(),
                "tensors": {n: [list(s), d] for n, (s, d) in sorted(self.shapes().items())}}


# ---------------------------------------------------------------------------- the directory

def _host_tensor(t: Any, transpose: bool) -> Any:
    """A CPU torch tensor with ``t``'s values (JAX, numpy or torch), PEFT-oriented."""
    import numpy as np
    import torch

    if isinstance(t, torch.Tensor):
        out = t.detach().to("cpu")
    else:
        arr = np.array(t)               # a sharded JAX array is gathered here: a helper
        name = dtype_name(arr.dtype)
        if name == "bfloat16":
            out = torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(np.ascontiguousarray(arr))
    return (out.t() if transpose else out).contiguous()


def write_peft_dir(adapter: LoRAAdapter, path: str) -> str:
    """Write ``adapter`` as a PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``, factors in their own dtype) that vLLM loads with
    ``LoRARequest(name, id, path)``; returns ``path``. Gathers sharded arrays: for
    references and checkpoints, not for refits."""
    from ..extras import require
    save_file = require("safetensors.torch", "vllm", "write_peft_dir").save_file   # vLLM brings it
    os.makedirs(path, exist_ok=True)
    tensors = {n: _host_tensor(t, adapter.kernel_layout) for n, t in adapter.tensors().items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter.peft_config(), f, indent=1)
    return path


def check_spec(spec: Any) -> list[str]:
    """What is wrong with an adapter spec received as JSON (:meth:`LoRAAdapter.spec`)."""
    if not isinstance(spec, Mapping):
        return [f"an adapter spec is a JSON object, found {type(spec).__name__}"]
    problems = []
    for key, kind in (("name", str), ("lora_id", int), ("config", Mapping), ("tensors", Mapping)):
        if not isinstance(spec.get(key), kind):
            problems.append(f"adapter spec field {key!r} is missing or not a {kind.__name__}")
    if problems:
        return problems
    for tname, entry in spec["tensors"].items():
        try:
            peft_module(tname)
            shape, dt = entry
            if len(shape) != 2 or dtype_name(dt) not in _FLOAT_DTYPES:
                raise LayoutError(f"shape {shape}, dtype {dt}")
        except (LoRAError, LayoutError, TypeError, ValueError) as e:
            problems.append(f"adapter {spec['name']!r} tensor {tname!r}: {e}")
    return problems


def merge_specs(per_process: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The adapters of one round from what every trainer process described (a process
    describes the adapters it holds any part of; processes that hold parts of one adapter
    must describe it alike), and what is wrong with them, in process order.

    Args:
        per_process: one list of :meth:`LoRAAdapter.spec` dicts per process.

    Returns:
        (the adapters sorted by name, the problems).
    """
    by_name: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for p, specs in enumerate(per_process):
        for spec in specs or ():
            bad = check_spec(spec)
            if bad:
                problems += bad
                continue
            seen = by_name.setdefault(spec["name"], spec)
            if seen != spec:
                problems.append(f"trainer processes describe adapter {spec['name']!r} "
                                f"differently (process {p}: r={spec['config'].get('r')}, "
                                f"{len(spec['tensors'])} tensors); every process holding a "
                                "part of it must pass the same adapter")
    ids: dict[int, str] = {}
    for name, spec in sorted(by_name.items()):
        other = ids.setdefault(spec["lora_id"], name)
        if other != name:
            problems.append(f"adapters {other!r} and {name!r} both use lora_id "
                            f"{spec['lora_id']}; one call refits each slot once")
    return [by_name[n] for n in sorted(by_name)], problems
