"""The trainer's side of a refit into vLLM that needs no trainer engine: :class:`LLMClient`
(vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``vllm.LLM``) and
:class:`WeightSender` (one trainer process's binding and sending of each streamed round).
:class:`~xreshard.adapters.vllm.trainer.XreshardTrainerWeightTransferEngine` drives both.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from xreshard.config import RefitConfig, RefitReport
from xreshard.errors import RefitError
from xreshard.ir.layout import LayoutMemo
from xreshard.runtime.binding import Bound, canonical_name
from xreshard.runtime.world import World

from ..jax import bind_named
from ..naming import NameMap
from .source import is_weight_source, source_tensors
from .stream import Stream

__all__ = ["LLMClient", "WeightSender"]


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``vllm.LLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class WeightSender:
    """One trainer process's side of refits into vLLM: binds and sends each round.

    Constructing it is collective with the workers joining (their backend builds its side
    of the :class:`Stream` in ``init_transfer_engine``): build it right after joining, as
    :meth:`XreshardTrainerWeightTransferEngine.trainer_init` does.

    Args:
        world: the joined world (group ``"trainer"``).
        rules: naming rules (e.g. ``jax_llama_rules(tied=True)``) turning a JAX pytree
            into HF tensors as views of its shards (:func:`bind_named`); None: an HF-named
            torch state dict or module (``names`` / ``transpose`` map its keys), or a
            :class:`~xreshard.runtime.refit.Bound`.
        rule_params: sizes the rules name (``NameMap(params=...)``).
        names, transpose: as for :class:`~xreshard.runtime.refit.Refit` (without ``rules``).
        config: the :class:`~xreshard.runtime.refit.RefitConfig` every process uses.
        subset: send only the tensors of the workers' groups (known before the first
            round) and leave the rest of the weights (a draft's part of the policy's tree).
    """

    def __init__(self, world: World, *, rules: Sequence[Any] | None = None,
                 rule_params: Mapping[str, int] | None = None, names: Any = None,
                 transpose: Iterable[str] = (), config: RefitConfig | None = None,
                 subset: bool = False) -> None:
        self.world = world
        self._subset = subset
        self._namemap = None if rules is None else NameMap(rules, rule_params)
        self._memo = LayoutMemo()       # the trainer arrays' layouts, kept across rounds
        self._names = names
        self._transpose = frozenset(transpose)
        self.stream = Stream(world, "send", config=config or RefitConfig(), names=names,
                             transpose=transpose)

    @property
    def version(self) -> int:
        """Rounds every process completed."""
        return self.stream.version

    def send_weights(self, weights: Any) -> RefitReport:
        """Send this round's weights (collective with the workers' ``update_weights``), one
        group of layers at a time, in the groups the workers derived from their layouts."""
        errors: list[str] = []
        try:
            obj, shapes = self._bind(weights)
        except Exception as e:  # noqa: BLE001 - refused on every process, not a hang on the others
            obj, shapes = Bound({}, {}), {}
            errors.append(f"{type(e).__name__}: {e}")
        if self._subset and self.stream.groups:
            wanted = {n for g in self.stream.groups for n in g}
            shapes = {n: s for n, s in shapes.items() if n in wanted}

        def part(g: int, names: list[str], errs: list[str]) -> Any:
            wanted = set(names)
            if isinstance(obj, Bound):
                return Bound({n: lay for n, lay in obj.layouts.items() if n in wanted},
                             {k: b for k, b in obj.bindings.items() if k[1] in wanted},
                             errors=errs + (obj.errors if g == 0 else []),
                             local_only={n for n in obj.local_only if n in wanted})
            sub = {k: t for k, t in obj.items() if self._canonical(k) in wanted}
            return sub if sub and not errs else Bound({}, {}, errors=errs)

        return self.stream.run(shapes, errors, part)

    def _canonical(self, key: str) -> str:
        return canonical_name(key, self._names)

    def _bind(self, weights: Any) -> tuple[Any, dict[str, tuple[int, ...]]]:
        """(what to split into groups, canonical name -> global shape)."""
        if isinstance(weights, Bound):
            return weights, {n: lay.shape for n, lay in weights.layouts.items()}
        if self._namemap is not None:
            ranks = self.stream.jax_ranks
            if not ranks:
                raise RefitError("naming rules bind JAX pytrees: join the world with JAX "
                                 "devices (jax.local_devices())")
            bound = bind_named(weights, self._namemap, ranks, memo=self._memo)
            return bound, {n: lay.shape for n, lay in bound.layouts.items()}
        if is_weight_source(weights):
            tensors, shapes = source_tensors(weights, self.world)
            return tensors, {self._canonical(k): s[::-1] if self._canonical(k) in self._transpose
                             else s for k, s in shapes.items()}
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        if isinstance(weights, Mapping) and all(hasattr(t, "shape") for t in weights.values()):
            shapes = {}
            for k, t in weights.items():
                name = self._canonical(k)
                shape = tuple(int(n) for n in t.shape)
                shapes[name] = shape[::-1] if name in self._transpose else shape
            return dict(weights), shapes
        raise RefitError(f"cannot send {type(weights).__name__} into vLLM: pass a JAX pytree "
                         "with naming rules (rules=...), an HF-named torch state dict or "
                         "module, a vLLM WeightSource (source=ModuleSource(model)), or an "
                         "xreshard Bound")
