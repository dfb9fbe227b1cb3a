"""In-memory LoRA refits into vLLM: the trainer side (:class:`LoRASender`).

One call sends any number of adapters (one per slot), every factor of every adapter in one
planned refit: the executor packs the thousands of small tensors of a large adapter into
buckets per peer, so a call costs a few messages per pair of ranks, not one per tensor.
See the decision record in :mod:`xreshard.adapters.vllm.lora`; the user-facing call is
``XreshardTrainerWeightTransferEngine.send_loras``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from xreshard.adapters.lora import LoRAAdapter, LoRAError
from xreshard.config import RefitConfig, RefitReport
from xreshard.runtime.binding import Bound
from xreshard.runtime.world import World

from .lora import agree_check, agree_specs, lora_refit_config, refit_names

__all__ = ["LoRASender"]


def _framework(t: Any) -> str:
    module = type(t).__module__
    if module.startswith(("jax", "jaxlib")):
        return "jax"
    if module.startswith("torch"):
        if type(t).__name__ == "DTensor":
            # TODO(lora-dtensor): bind through the torch adapter's rank map, as Refit does
            raise LoRAError("DTensor LoRA factors are not supported yet; pass each "
                            "process's whole copy as a plain tensor (t.full_tensor()), or "
                            "JAX arrays")
        return "torch"
    if module.startswith("numpy"):
        return "numpy"
    raise LoRAError(f"a LoRA factor is a {type(t).__name__}; pass JAX arrays, torch tensors "
                    "or numpy arrays")


class LoRASender:
    """One trainer process's side of LoRA rounds into vLLM workers.

    Args:
        world: the backend's world (group ``"trainer"``).
        config: the backend's refit config (LoRA rounds move factors without a wire cast).
        jax_ranks: JAX device id -> world rank of the trainer processes (the backend's
            ``WeightSender.stream.jax_ranks``).
    """

    def __init__(self, world: World, config: RefitConfig, jax_ranks: Mapping[int, int]) -> None:
        self.world, self.jax_ranks = world, dict(jax_ranks)
        self.config = lora_refit_config(config)
        self.stream: Any = None

    @property
    def version(self) -> int:
        """LoRA rounds every process completed."""
        return 0 if self.stream is None else self.stream.version

    def send(self, adapters: Sequence[LoRAAdapter], bound: Bound | None = None) -> RefitReport:
        """One LoRA round (collective with every trainer process and every worker's
        ``update_weights({"lora": ...})``): this process's part of ``adapters`` (any
        shard of them; possibly none).

        ``bound``: this process's factors already bound, named as the refit names them
        (``<adapter>/<PEFT tensor name>``) and oriented as PEFT does (e.g. views of the
        shards of 3-D Tunix factors through naming rules, ``jax.bind_named``); the
        adapters then only describe the round (their factors need ``shape`` and ``dtype``
        only). Default: the adapters' own factors, bound here.

        Raises:
            LoRAError: an adapter does not fit the engine, or trainer processes disagree;
                on every process, before any byte moves.
        """
        from .stream import Stream

        errors: list[str] = []
        specs: list[dict] = []
        try:
            names = [a.name for a in adapters]
            ids = [a.lora_id for a in adapters]
            if len(set(names)) != len(names) or len(set(ids)) != len(ids):
                raise LoRAError(f"one call refits each adapter name and lora_id once; got "
                                f"names {names} and ids {ids}")
            specs = [a.spec() for a in adapters]
        except Exception as e:  # noqa: BLE001 - refused on every process, not a hang
            errors.append(f"{type(e).__name__}: {e}")
        if self.stream is None:     # collective with the workers' first LoRA round
            self.stream = Stream(self.world, "send", config=self.config)
        timeout = self.config.timeout
        round_adapters = agree_specs(self.world, specs, errors, timeout)
        agree_check(self.world, [], timeout)
        try:
            bound = self._bind(adapters) if bound is None else _checked(bound, adapters)
        except Exception as e:  # noqa: BLE001 - raised on every rank by the refit's check
            bound = Bound({}, {}, errors=[f"{type(e).__name__}: {e}"])
        shapes = {n: s for n, (s, _) in refit_names(round_adapters).items()}

        def part(g: int, group: list[str], errs: list[str]) -> Bound:
            wanted = set(group)
            return Bound({n: lay for n, lay in bound.layouts.items() if n in wanted},
                         {k: b for k, b in bound.bindings.items() if k[1] in wanted},
                         errors=errs + (bound.errors if g == 0 else []),
                         local_only={n for n in bound.local_only if n in wanted})
        return self.stream.run(shapes, [], part)

    def _bind(self, adapters: Sequence[LoRAAdapter]) -> Bound:
        """This process's factors, bound by their framework's adapter (JAX arrays through
        their shardings, torch and numpy as this process's whole copy); kernel-layout
        factors through transposed views."""
        by_kind: dict[str, dict[str, Any]] = {}
        transpose: set[str] = set()
        for a in adapters:
            for tname, t in a.tensors().items():
                name = a.refit_name(tname)
                kind = _framework(t)
                if kind == "numpy":
                    t, kind = _torch_of(t), "torch"
                by_kind.setdefault(kind, {})[name] = t
                if a.kernel_layout:
                    transpose.add(name)
        parts = []
        if "jax" in by_kind:
            from xreshard.adapters import jax as jax_adapter
            if not self.jax_ranks:
                raise LoRAError("JAX LoRA factors need the trainer to join with its JAX "
                                "devices (devices=jax.local_devices())")
            parts.append(jax_adapter.bind(by_kind["jax"], "send", ranks=self.jax_ranks,
                                          transpose=frozenset(transpose)))
        if "torch" in by_kind:
            from xreshard.adapters import torch as torch_adapter
            # a plain tensor is this process's whole copy, held by its first rank
            parts.append(torch_adapter.bind(by_kind["torch"], "send", ranks=None,
                                            local_ranks=self.world.rank_ids[:1],
                                            transpose=frozenset(transpose)))
        out = Bound({}, {})
        for b in parts:
            out.layouts.update(b.layouts)
            out.bindings.update(b.bindings)
            out.errors.extend(b.errors)
            out.local_only.update(b.local_only)
        return out


def _checked(bound: Bound, adapters: Sequence[LoRAAdapter]) -> Bound:
    """``bound`` if it binds exactly the adapters' tensors, with their shapes as PEFT
    orients them (a bound made elsewhere must not move other bytes than the round's)."""
    want = {a.refit_name(n): tuple(s) for a in adapters for n, (s, _) in a.shapes().items()}
    got = {n: tuple(lay.shape) for n, lay in bound.layouts.items()}
    if got != want:
        odd = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
        raise LoRAError(f"the bound LoRA factors differ from the adapters' tensors at "
                        f"{odd[:3]} (bound: {[got.get(n) for n in odd[:3]]}, adapters: "
                        f"{[want.get(n) for n in odd[:3]]})")
    return bound


def _torch_of(arr: Any) -> Any:
    """A torch tensor over a numpy array's memory (bf16 through its bits)."""
    import numpy as np
    import torch

    from xreshard.dtypes import dtype_name
    if dtype_name(arr.dtype) == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))
