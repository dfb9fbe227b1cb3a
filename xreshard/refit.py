"""The user-facing refit: one collective call moves every tensor shard to shard.

```python
world = xr.World.join(address, group="trainer", devices=jax.local_devices(), num_processes=3)
refit = xr.Refit(world, send=params)          # trainer: a pytree of jax.Arrays / a state dict
refit = xr.Refit(world, receive=state_dict)   # inference side: DTensors are written in place
report = refit()                              # collective; plans once, reuses the plan
```

Every call is collective over the whole world. The first call (and any call after a layout
changed) all-gathers the layouts as JSON, validates them identically in every process and
plans; errors (missing names, shape or dtype mismatches, uncovered regions, bindings that
do not fit) are raised on every rank before any byte moves. A call that fails mid-way
raises on every rank within the timeout and leaves the destination stale: ``version``
advances only when every process finished.

JAX arrays are immutable: a JAX destination never has its live arrays written. It gets new
arrays built from the received buffers (``refit.received``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from .errors import RefitError
from .execute import Executor, check_bindings
from .layout import Layout, Mesh, Region
from .plan import Plan, PlanCache, plan
from .schedule import Schedule, peer_counts, schedule

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefitConfig:
    """How a refit moves bytes. Every process of a world must pass the same values."""

    bucket_bytes: int = 64 << 20
    """The most bytes in one message between two ranks."""
    staging_bytes: int = 256 << 20
    """The most bytes one rank has in flight in one round (staging included)."""
    timeout: float = 300.0
    """Seconds any wait may take (a round, a metadata exchange) before raising."""
    wire_dtype: str | Mapping[str, str] | None = None
    """Cast to this dtype on the sender (e.g. "bfloat16" for fp32 master weights), for every
    tensor or, as a mapping, per tensor name; None requires equal dtypes on both sides."""
    transport: str = "auto"
    """"auto" (local copies inside a process, gloo or nccl across), or a kind the world knows."""

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if isinstance(self.wire_dtype, Mapping):
            d["wire_dtype"] = dict(sorted(self.wire_dtype.items()))
        return d


@dataclass
class Bound:
    """One side of a refit in this process: layouts plus where the bytes live.

    Adapters produce it from framework objects; custom engines can build it directly.

    Attributes:
        layouts: global layout of every tensor of this side.
        bindings: ``(world rank, name) -> array`` for this process's ranks, in canonical
            coordinates (see :mod:`xreshard.execute`).
        finish: called after a successful receive (JAX builds its new arrays here).
        errors: problems found while binding, raised on every rank by the refit.
        local_only: names whose layout covers only this process's ranks (e.g. a plain
            tensor each process holds whole); the refit unions them over processes.
    """

    layouts: dict[str, Layout]
    bindings: dict[tuple[int, str], Any]
    finish: Callable[[], Any] | None = None
    errors: list[str] = field(default_factory=list)
    local_only: set[str] = field(default_factory=set)

    def describe(self) -> dict[str, dict]:
        """JSON description of the layouts, for the metadata exchange."""
        out = {}
        for name, lay in self.layouts.items():
            d = lay.to_dict()
            if name in self.local_only:
                d["local_only"] = True
            out[name] = d
        return out


@dataclass(frozen=True)
class RefitReport:
    """What one call moved, seen from this process."""

    version: int
    seconds: float
    plan_seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    bytes_moved_world: int
    bytes_gather_broadcast_world: int
    num_rounds: int
    num_messages: int
    num_zero_copy: int
    staging_bytes: int
    replanned: bool

    @property
    def gbps(self) -> float:
        """GB/s through this process (sent + received)."""
        return (self.bytes_sent + self.bytes_received) / max(self.seconds, 1e-9) / 1e9

    def __str__(self) -> str:
        return (f"refit v{self.version}: sent {self.bytes_sent / 2**20:.1f} MiB, received "
                f"{self.bytes_received / 2**20:.1f} MiB in {self.seconds * 1e3:.1f} ms "
                f"({self.gbps:.2f} GB/s); world moved {self.bytes_moved_world / 2**20:.1f} MiB "
                f"vs {self.bytes_gather_broadcast_world / 2**20:.1f} MiB gather+broadcast")


class Refit:
    """A collective weight refit between the processes of a world.

    Args:
        world: the joined :class:`xreshard.world.World`.
        send: what this process sends: a JAX pytree, a torch state dict / module, or a
            :class:`Bound`.
        receive: what this process receives into: a torch state dict / module (written in
            place), a JAX pytree of arrays or ``ShapeDtypeStruct`` with shardings (new
            arrays in ``received``), or a :class:`Bound`.
        names: tensor names: a mapping from the default name (JAX path ``"a/b/0/c"``,
            state-dict key) to the canonical name, or a callable.
        transpose: canonical names whose local tensors are ``[in, out]`` kernels of an
            ``[out, in]`` tensor (Flax ``Dense``); the layout is taken transposed, the
            bytes are read/written through a transposed view.
        config: a :class:`RefitConfig`.
    """

    def __init__(self, world: Any, *, send: Any = None, receive: Any = None,
                 names: Mapping[str, str] | Callable[[str], str] | None = None,
                 transpose: Iterable[str] = (), config: RefitConfig | None = None):
        self.world = world
        self.config = config or RefitConfig()
        self.version = 0
        self.stale = False
        self.received: Any = None
        self._send = send
        self._receive = receive
        self._names = names
        self._transpose = frozenset(transpose)
        self._last_layouts: tuple | None = None     # this process's layouts, last call
        self._generation = 0                        # bumped when they change
        self._generations: tuple | None = None      # every process's, at the last plan
        self._plan: Plan | None = None
        self._schedule: Schedule | None = None
        self._executor: Executor | None = None
        self._cache = PlanCache()
        self._identity: list[dict] | None = None

    @property
    def plan(self) -> Plan | None:
        """The current plan (after the first call)."""
        return self._plan

    # ------------------------------------------------------------ binding

    def _rank_maps(self) -> dict[str, Any]:
        """Framework ids -> world ranks, from one all-gather (torch ranks, JAX device ids).

        A DTensor's mesh names torch default-group ranks and a JAX mesh names device ids;
        both are resolved among the processes of this process's world group, which is
        therefore expected to be one torch job / one JAX job.
        """
        if self._identity is None:
            me: dict[str, Any] = {"ranks": list(self.world.rank_ids)}
            try:
                import sys
                if "torch" in sys.modules:
                    import torch.distributed as dist
                    if dist.is_available() and dist.is_initialized():
                        me["torch_rank"] = dist.get_rank()
            except Exception:   # pragma: no cover - torch half-installed
                pass
            devs = [self.world.local_device(r) for r in self.world.rank_ids]
            if devs and all(type(d).__module__.startswith("jax") or hasattr(d, "platform")
                            for d in devs):
                me["jax_ids"] = [int(d.id) for d in devs]
            self._identity = self.world.allgather_json(me, timeout=self.config.timeout)
        # torch ranks and JAX device ids are only unique within one job; a job is one group
        # of the world (the trainer's processes, the engine's workers)
        torch_ranks, jax_ids = {}, {}
        my_group = self.world.processes[self.world.process_index]["group"]
        for p, info in enumerate(self._identity):
            if self.world.processes[p]["group"] != my_group:
                continue
            if info.get("torch_rank") is not None:
                torch_ranks[int(info["torch_rank"])] = info["ranks"][0]
            for i, r in zip(info.get("jax_ids", ()), info["ranks"]):
                jax_ids[int(i)] = r
        return {"torch": torch_ranks, "jax": jax_ids, "local": list(self.world.rank_ids)}

    def _bind(self, obj: Any, side: str, maps: dict[str, Any]) -> Bound | None:
        if obj is None:
            return None
        if isinstance(obj, Bound):
            return obj
        kind = _framework_of(obj)
        if kind == "torch":
            from xreshard.adapters import torch as adapter
            ranks = maps["torch"] or None
            return adapter.bind(obj, side, ranks=ranks, local_ranks=maps["local"],
                                names=self._names, transpose=self._transpose)
        if kind == "jax":
            from xreshard.adapters import jax as adapter
            return adapter.bind(obj, side, ranks=maps["jax"], names=self._names,
                                transpose=self._transpose)
        raise RefitError(f"cannot tell which framework {side}={type(obj).__name__} belongs to; "
                         "pass a JAX pytree, a torch state dict or module, or an xreshard Bound")

    # ------------------------------------------------------------ the collective

    def __call__(self, send: Any = None, receive: Any = None) -> RefitReport:
        """Run one refit (collective over the world). New ``send``/``receive`` objects may be
        passed for this and later calls (e.g. the trainer's params after an optimizer step).

        Raises:
            RefitError (and its PlanError/LayoutError/TransportTimeout kin): on every rank,
                before any byte moves for metadata problems, within the timeout for failures
                while moving.
        """
        if send is not None:
            self._send = send
        if receive is not None:
            self._receive = receive
        t0 = time.perf_counter()
        maps = self._rank_maps()
        src = self._bind(self._send, "send", maps)
        dst = self._bind(self._receive, "receive", maps)
        replanned = self._prepare(src, dst)
        assert self._plan is not None and self._schedule is not None
        plan_seconds = time.perf_counter() - t0
        executor = Executor(self._schedule, self._plan.src, self._plan.dst,
                            self._plan.wire_dtypes, _fit(src, self._plan.src),
                            _fit(dst, self._plan.dst), self.world.transport(self.config.transport),
                            self.config.timeout)
        if self._executor is not None:
            executor._arena = self._executor._arena     # staging is reused across calls
        self._executor = executor
        self.stale = True
        error = None
        try:
            stats = executor.run()
        except Exception as e:   # report to the others before raising here
            error = f"{type(e).__name__}: {e}"
            self._commit(error)
            raise
        self._commit(None)
        if dst is not None and dst.finish is not None:
            self.received = dst.finish()
        self.stale = False
        self.version += 1
        report = RefitReport(
            version=self.version, seconds=time.perf_counter() - t0, plan_seconds=plan_seconds,
            bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
            bytes_local=stats.bytes_local, bytes_moved_world=self._plan.stats.bytes_moved,
            bytes_gather_broadcast_world=self._plan.stats.bytes_gather_broadcast,
            num_rounds=stats.num_rounds, num_messages=stats.num_messages,
            num_zero_copy=stats.num_zero_copy, staging_bytes=stats.staging_bytes,
            replanned=replanned)
        logger.info("%s", report)
        return report

    def _commit(self, error: str | None) -> None:
        """All-gather every process's outcome; raise if any failed (the version stays)."""
        outcomes = self.world.allgather_json({"error": error}, timeout=self.config.timeout)
        failed = [(p, o["error"]) for p, o in enumerate(outcomes) if o["error"]]
        if failed and error is None:
            where = "; ".join(f"{self.world.describe_process(p)}: {e}" for p, e in failed)
            raise RefitError(f"refit v{self.version + 1} failed on {len(failed)} process(es), "
                             f"destination left stale at v{self.version}: {where}")

    def _prepare(self, src: Bound | None, dst: Bound | None) -> bool:
        """Exchange metadata and (re)plan when any layout changed. Returns whether it planned."""
        errors = (src.errors if src else []) + (dst.errors if dst else [])
        try:
            if src:
                check_bindings(src.layouts, src.bindings, "send")
            if dst:
                check_bindings(dst.layouts, dst.bindings, "receive")
        except RefitError as e:
            errors.append(str(e))
        # a process says only whether its layouts changed since its last call (comparing
        # Layout objects is cheap; serializing every layout on every refit is not)
        mine = tuple((b.layouts, frozenset(b.local_only)) if b else None for b in (src, dst))
        if mine != self._last_layouts:
            self._last_layouts = mine
            self._generation += 1
        gathered = self.world.allgather_json({"generation": self._generation, "errors": errors},
                                             timeout=self.config.timeout)
        problems = [f"{self.world.describe_process(p)}: {e}"
                    for p, g in enumerate(gathered) for e in g["errors"]]
        if problems:
            raise RefitError("refit refused before moving anything:\n  " + "\n  ".join(problems))
        key = tuple(g["generation"] for g in gathered)
        if key == self._generations and self._plan is not None:
            return False
        meta = {"send": src.describe() if src else {},
                "receive": dst.describe() if dst else {},
                "config": self.config.to_dict()}
        metas = self.world.allgather_json(meta, timeout=self.config.timeout)
        src_layouts = _merge([m["send"] for m in metas], "send", self.world)
        dst_layouts = _merge([m["receive"] for m in metas], "receive", self.world)
        configs = {json.dumps(m["config"], sort_keys=True) for m in metas}
        if len(configs) > 1:
            raise RefitError(f"processes pass different RefitConfigs: {sorted(configs)}; every "
                             "process must use the same config")
        new_plan = plan(src_layouts, dst_layouts, self.world, wire_dtype=self.config.wire_dtype,
                        cache=self._cache)
        local = list(self.world.rank_ids)
        counts = peer_counts(new_plan, local)
        everyone = self.world.allgather_json({str(r): c for r, c in counts.items()},
                                             timeout=self.config.timeout)
        all_counts = {int(r): c for d in everyone for r, c in d.items()}
        self._schedule = schedule(new_plan, local, all_counts,
                                  bucket_bytes=self.config.bucket_bytes,
                                  staging_bytes=self.config.staging_bytes)
        self._plan = new_plan
        self._generations = key
        logger.debug("refit planned: %s", new_plan.stats.to_dict())
        return True


def _framework_of(obj: Any) -> str:
    import sys
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.nn.Module):
            return "torch"
        if isinstance(obj, Mapping) and obj and all(
                isinstance(v, torch.Tensor) or type(v).__name__ == "Sharded" for v in obj.values()):
            return "torch"
    jax = sys.modules.get("jax")
    if jax is not None:
        leaves = jax.tree_util.tree_leaves(obj)
        if leaves and all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) for x in leaves):
            return "jax"
    return "unknown"


def _merge(per_process: list[dict[str, dict]], side: str, world: Any) -> dict[str, Layout]:
    """One layout per tensor from every process's description of its side.

    Global layouts (product form, or explicit) must agree between the processes that
    describe them; explicit layouts that each process gives for its own ranks only are
    unioned.
    """
    seen: dict[str, tuple[int, dict]] = {}
    explicit_parts: dict[str, dict[int, list]] = {}
    problems = []
    for p, layouts in enumerate(per_process):
        for name, d in layouts.items():
            if d.get("local_only"):
                part = explicit_parts.setdefault(name, {})
                for rank, regions in d["explicit"]:
                    part[int(rank)] = regions
                seen.setdefault(name, (p, d))
                continue
            if name in seen and seen[name][1] != d:
                problems.append(f"{name!r}: {world.describe_process(seen[name][0])} and "
                                f"{world.describe_process(p)} describe different layouts")
            seen.setdefault(name, (p, d))
    if problems:
        raise RefitError(f"the {side} side's processes disagree on layouts: "
                         + "; ".join(problems[:20]))
    out = {}
    for name, (_, d) in seen.items():
        if name in explicit_parts:
            out[name] = _union_layout(d, explicit_parts[name])
        else:
            out[name] = Layout.from_dict(d)
    return out


def _fit(bound: Bound | None, layouts: Mapping[str, Layout]) -> dict:
    """The bindings as the merged layouts want them: a ``local_only`` name is bound as a
    one-array list (explicit form), and ``_union_layout`` may have made it product form."""
    if bound is None:
        return {}
    return {key: b[0] if isinstance(b, list) and len(b) == 1 and layouts[key[1]].is_product
            else b for key, b in bound.bindings.items()}


def _union_layout(d: dict, parts: dict[int, list]) -> Layout:
    """Ranks that each hold a whole tensor -> a replicated product layout over them."""
    shape = tuple(d["shape"])
    full = [[0] * len(shape), list(shape)]
    ranks = sorted(parts)
    if all(regions == [full] for regions in parts.values()):
        return Layout.replicated(shape, d["dtype"], Mesh((len(ranks),), tuple(ranks)))
    return Layout.explicit_form(shape, d["dtype"], {
        r: [Region(tuple(a), tuple(b)) for a, b in parts[r]] for r in ranks})

