"""In-memory LoRA refits into a live vLLM engine's adapter slots: the engine side.

A trainer's :class:`~xreshard.adapters.lora.LoRAAdapter` moves shard to shard into every
vLLM worker, each TP rank receiving exactly the part of each factor its LoRA layer reads,
and is served under ``LoRARequest(name, lora_id, "xreshard://<name>")``
(:func:`lora_request`) without a file ever being written. The trainer side is
:mod:`xreshard.adapters.vllm.lora_send`; both run inside the ``"xreshard"``
weight-transfer backend's world and control plane (``update_weights({"lora": ...})``).

Decision record.

* **Which elements a rank needs is asked of vLLM, not re-derived.** vLLM's LoRA layers
  slice a full adapter themselves (``set_lora`` -> ``slice_lora_a`` / ``slice_lora_b``:
  column-parallel layers keep A whole and cut B's rows, merged ``gate_up`` and ``qkv``
  layers per sub-module with ``kv_shard_id = tp_rank // num_kv_head_replicas``,
  row-parallel layers cut A's columns and keep B, ``fully_sharded_loras`` also cuts A's
  rank rows or B's output rows). :func:`read_regions` runs this worker's live layer's own
  slicing functions on index probes (``arange`` rows and columns, expanded, so nothing
  the size of the factor is allocated) and reads back which rows and columns come out.
  Whatever vLLM slices, a rank receives exactly that, and a layer whose slicing is not a
  box of rows x columns is refused by name.
* **vLLM still does every arithmetic step.** A worker receives its regions into a
  full-shape buffer per factor (zeros elsewhere, in the trainer's dtype) and hands those
  to ``LoRAModel.from_lora_tensors``, which casts to ``lora_dtype``; vLLM's adapter
  manager then packs, folds ``alpha / r`` into B **in place**
  (``LoRAModelManager._create_merged_loras_inplace`` -> ``LoRALayerWeights.optimize``:
  ``lora_b *= scaling``) and ``set_lora`` slices exactly the received regions into the
  slot. So the slot holds the bits a directory load of the same adapter gives. The
  received buffers are kept unscaled and every build starts from a clone of them: an
  adapter that vLLM's LRU evicts (or ``finish_weight_update``'s ``reset_lora_state``
  drops) is rebuilt from the same unscaled bytes, never scaled twice.
* **The hook is one method, checked against the installed vLLM.** vLLM turns a
  ``LoRARequest`` into a ``LoRAModel`` only in ``WorkerLoRAManager._load_adapter`` (which
  reads ``lora_path`` as a directory); every in-memory loader (verl, SkyRL, ms-swift)
  patches it. :func:`install_hook` wraps it once per process: a request whose path has the
  ``xreshard://`` scheme and names an adapter this worker committed is built from memory,
  anything else goes to vLLM's own method untouched. The wrapper is installed only in a
  worker that receives a LoRA round, and only when :func:`vllm_problem` finds the vLLM
  version it was checked against (0.32) and the signatures it calls.
* **The previous adapter is served until the new one is complete.** A round receives
  into fresh buffers; only after every process confirmed the round (the stream's outcome
  exchange) does the worker commit them and drop the registered old version, so the next
  batch that names the adapter builds the new one. A refused or failed round leaves every
  slot as it was.
* **Bad input is refused before any byte moves, alike on every process.** A round runs
  two metadata exchanges before the refit: ``lora/specs`` (each trainer process describes
  its adapters; the union is the round) and ``lora/check`` (each worker's verdict on them:
  target modules of this engine, ``r`` within ``max_lora_rank``, shapes of the base
  weights, vLLM's own ``PEFTHelper.validate_legal``); any problem raises
  :class:`~xreshard.adapters.lora.LoRAError` with the same message on every process.
* **Memory.** A worker holds each committed adapter as full-shape factors (only its
  regions written), as vLLM holds a directory-loaded adapter in its CPU cache.

Linear target modules only (``q/k/v/o_proj``, ``gate/up/down_proj`` and the like);
embedding, LM-head and MoE-expert LoRA are refused with a message.
TODO(lora-moe): expert LoRA (vLLM slices it per expert-parallel rank elsewhere).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from xreshard.adapters.lora import LoRAError, merge_specs
from xreshard.dtypes import itemsize
from xreshard.ir.layout import Layout, Region

from .destination import layouts_from_pieces, replicate_layout
from .record import Piece, import_torch, import_vllm

logger = logging.getLogger(__name__)

__all__ = ["LORA_SCHEME", "SUPPORTED_VLLM", "lora_request", "vllm_problem", "install_hook",
           "read_regions", "LoRAReceiver"]

#: the ``lora_path`` scheme of adapters refit into memory
LORA_SCHEME = "xreshard://"

#: vLLM versions (major, minor) whose ``WorkerLoRAManager._load_adapter`` the hook was
#: checked against
SUPPORTED_VLLM = ((0, 32),)


def lora_request(name: str, lora_id: int) -> Any:
    """The ``vllm.lora.request.LoRARequest`` that serves adapter ``name`` refit into slot
    ``lora_id`` from memory: ``llm.generate(..., lora_request=lora_request("policy", 1))``."""
    import_vllm()
    from vllm.lora.request import LoRARequest
    return LoRARequest(lora_name=name, lora_int_id=int(lora_id), lora_path=LORA_SCHEME + name)


@functools.cache
def vllm_problem() -> str | None:
    """Why the in-memory hook may not be installed into this vLLM (None: it may)."""
    import_vllm()
    import vllm
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.worker_manager import WorkerLoRAManager

    version = getattr(vllm, "__version__", "?")
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        major = minor = -1
    if (major, minor) not in SUPPORTED_VLLM:
        return (f"in-memory LoRA refits wrap vLLM's WorkerLoRAManager._load_adapter, checked "
                f"against vLLM {', '.join(f'{a}.{b}' for a, b in SUPPORTED_VLLM)}; this is vLLM "
                f"{version} - use a checked version, or load adapters from a directory "
                "(xreshard.adapters.lora.write_peft_dir)")
    params = list(inspect.signature(WorkerLoRAManager._load_adapter).parameters)
    wanted = {"lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size",
              "weights_mapper", "skip_prefixes"}
    have = set(inspect.signature(LoRAModel.from_lora_tensors).parameters)
    if params != ["self", "lora_request"] or not wanted <= have:
        return (f"vLLM {version}: WorkerLoRAManager._load_adapter{tuple(params)} or "
                f"LoRAModel.from_lora_tensors (missing {sorted(wanted - have)}) differ from "
                "what the in-memory LoRA hook was checked against")
    return None


# ---------------------------------------------------------------------------- the hook

@dataclass
class _Committed:
    """One adapter as a worker holds it: unscaled full-shape factors (its regions
    written) and the PEFT config; ``version`` counts the rounds that refit it."""

    name: str
    lora_id: int
    config: dict[str, Any]
    tensors: dict[str, Any]
    version: int


#: adapter manager (one per model, in its worker process) -> lora_id -> committed adapter
_STORES: weakref.WeakKeyDictionary[Any, dict[int, _Committed]] = weakref.WeakKeyDictionary()


def _peft_helper(config: Mapping[str, Any], max_position_embeddings: Any) -> Any:
    from vllm.lora.peft_helper import PEFTHelper
    return PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": max_position_embeddings})


def _build(manager: Any, committed: _Committed) -> Any:
    """What ``WorkerLoRAManager._load_adapter`` makes of a directory, made of the committed
    factors: the same ``PEFTHelper``, checks and ``from_lora_tensors`` call, on clones (vLLM
    scales B in place)."""
    peft = _peft_helper(committed.config, manager.max_position_embeddings)
    peft.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=committed.lora_id,
        tensors={n: t.clone() for n, t in committed.tensors.items()},
        peft_helper=peft, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    lora.is_3d_lora_weight = False
    return lora


def install_hook() -> None:
    """Wrap ``WorkerLoRAManager._load_adapter`` (once per process) so that requests for
    ``xreshard://<name>`` adapters this worker committed are built from memory.

    Raises:
        LoRAError: :func:`vllm_problem` found a vLLM the hook was not checked against.
    """
    problem = vllm_problem()
    if problem:
        raise LoRAError(problem)
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    if getattr(original, "__xreshard__", False):
        return

    @functools.wraps(original)
    def _load_adapter(self: Any, lora_request: Any) -> Any:
        path = getattr(lora_request, "lora_path", "") or ""
        if not path.startswith(LORA_SCHEME):
            return original(self, lora_request)
        committed = _STORES.get(self._adapter_manager, {}).get(lora_request.lora_int_id)
        if committed is None or committed.name != path[len(LORA_SCHEME):]:
            # what vLLM raises for a directory that is not there
            raise LoRAAdapterNotFoundError(lora_request.lora_name, path)
        return _build(self, committed)

    hooked: Any = _load_adapter     # a function takes the mark that getattr reads above
    hooked.__xreshard__ = True
    WorkerLoRAManager._load_adapter = hooked


# ---------------------------------------------------------------------------- regions

def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``indices`` as ``[start, stop)`` runs."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def read_regions(layer: Any, index: int | None, shape: Sequence[int], factor: str
                 ) -> list[Region]:
    """The regions of a full ``[rows, cols]`` factor (``"A"`` or ``"B"``) that ``layer``'s
    ``set_lora`` copies into this rank's slot: vLLM's own slicing, run on index probes.

    Args:
        layer: a live ``BaseLinearLayerWithLoRA`` of this worker.
        index: the sub-module's slot in a packed layer (q, k, v of ``qkv_proj``), or None.
        shape: the factor's full shape (PEFT orientation).
        factor: ``"A"`` or ``"B"``.

    Raises:
        LoRAError: the slice is not rows x columns of the factor, or does not fit the
            layer's stacked buffers.
    """
    rows, cols = (int(n) for n in shape)
    stacked = (layer.lora_a_stacked if factor == "A" else layer.lora_b_stacked)[index or 0]
    if layer.tp_size == 1:
        got_rows, got_cols, regions = rows, cols, [Region.of([(0, rows), (0, cols)])]
    else:
        torch = import_torch()
        slicer = layer.slice_lora_a if factor == "A" else layer.slice_lora_b

        def sliced(probe: Any) -> Any:
            if index is None:
                return slicer(probe)
            arg = [None] * layer.n_slices
            arg[index] = probe
            return slicer(arg)[index]

        by_row = sliced(torch.arange(rows).view(rows, 1).expand(rows, cols))
        by_col = sliced(torch.arange(cols).view(1, cols).expand(rows, cols))
        got_rows, got_cols = (int(n) for n in by_row.shape)
        if by_row.numel() == 0:
            return []
        row_ids, col_ids = by_row[:, 0], by_col[0, :]
        if not (torch.equal(by_row, row_ids[:, None].expand_as(by_row))
                and torch.equal(by_col, col_ids[None, :].expand_as(by_col))):
            raise LoRAError(f"{type(layer).__name__}.slice_lora_{factor.lower()} takes a part of "
                            "the factor that is not rows x columns; xreshard cannot lay it out")
        regions = [Region.of([r, c]) for r in _runs(row_ids.tolist())
                   for c in _runs(col_ids.tolist())]
    # the non-rank dim must fill the slot exactly (set_lora would copy a short slice silently)
    fixed, limit = (got_cols, stacked.shape[3]) if factor == "A" else (got_rows, stacked.shape[2])
    ranks, max_rank = ((got_rows, stacked.shape[2]) if factor == "A"
                       else (got_cols, stacked.shape[3]))
    if fixed != limit or ranks > max_rank:
        raise LoRAError(f"{type(layer).__name__}: the {factor} factor {rows}x{cols} slices to "
                        f"{got_rows}x{got_cols} on this rank but its slot holds "
                        f"{tuple(stacked.shape[2:])}; the factor's shape does not fit the base "
                        "layer")
    return regions


# ---------------------------------------------------------------------------- the engine's modules

class _Modules:
    """The LoRA layers of one worker's model, as the adapter manager knows them: a PEFT
    module name -> (layer, index in its packed layer or None)."""

    def __init__(self, manager: Any) -> None:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

        self.manager = manager
        self.linear = BaseLinearLayerWithLoRA
        self.by_name: dict[str, tuple[Any, int | None, int]] = {}    # + sub-modules packed
        for name, layer in manager.modules.items():
            subs = manager.packed_modules.get(name)
            if subs:
                for i, sub in enumerate(subs):
                    self.by_name[sub] = (layer, i, len(subs))
            else:
                self.by_name[name] = (layer, None, 1)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.mapper = None if mapper is None else mapper.get_rename_mapper()

    def find(self, tensor_name: str) -> tuple[str, bool, Any, int | None]:
        """(module, is A, layer, packed index) of a PEFT tensor name, as vLLM resolves it."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        try:
            module, is_a = parse_fine_tuned_lora_name(tensor_name, self.mapper)
        except ValueError as e:
            raise LoRAError(f"{tensor_name!r}: {e}") from e
        got = self.by_name.get(module)
        if got is None:
            known = sorted({m.rsplit(".", 1)[-1] for m in self.by_name})
            raise LoRAError(f"target module {module!r} is not a LoRA module of this engine "
                            f"(its LoRA modules end in {known}; enable_lora wraps the modules "
                            "of lora_target_modules, or every supported one)")
        layer, index, num_packed = got
        if not isinstance(layer, self.linear):
            raise LoRAError(f"target module {module!r} is a {type(layer).__name__}; in-memory "
                            "LoRA refits take linear modules (embedding, LM-head and expert "
                            "LoRA load from a directory)")
        if index is not None and num_packed != layer.n_slices:
            raise LoRAError(f"target module {module!r}: its packed layer has {layer.n_slices} "
                            "slices but a different number of sub-modules")
        return module, is_a, layer, index


    def base_shape(self, module: str, layer: Any, index: int | None,
                   hf: Mapping[str, Sequence[int]]) -> Sequence[int]:
        """The ``[out, in]`` of the weight a PEFT module's factors adapt: its checkpoint
        tensor, or, for a packed slot the checkpoint fills from a sibling (Gemma4's
        ``k_eq_v`` layers: vLLM loads ``k_proj`` into the K and the V slot of ``qkv_proj``,
        and packs the V slot's LoRA from ``v_proj``), that sibling's where the two slots
        are alike on every rank."""
        base = hf.get(module + ".weight")
        if base is not None:
            return base
        slices: Sequence[int] = getattr(layer, "output_slices", ())
        if index is not None and index < len(slices):
            for sub, (other, j, _) in self.by_name.items():
                if other is layer and j is not None and j != index and j < len(slices) \
                        and slices[j] == slices[index] and sub + ".weight" in hf:
                    return hf[sub + ".weight"]
        raise LoRAError(f"the engine's checkpoint has no {module}.weight to size the factor by")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


# -------------------------------------------------------------------------- the round's agreements

def _refuse(problems: Sequence[str]) -> None:
    """Raise the same LoRAError on every process that saw the same ``problems``."""
    problems = list(dict.fromkeys(problems))       # every worker reports a bad module
    if problems:
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise LoRAError("LoRA refit refused before moving anything: "
                        + "; ".join(problems[:10]) + more)


def agree_specs(world: Any, specs: Sequence[Mapping[str, Any]], errors: Sequence[str],
                timeout: float) -> list[dict[str, Any]]:
    """``lora/specs``: every process's adapters (trainers) and early problems; returns the
    round's adapters, or raises the same :class:`LoRAError` everywhere. Collective."""
    got = world.allgather_json({"errors": list(errors), "adapters": list(specs)},
                               timeout=timeout, kind="lora/specs")
    adapters, problems = merge_specs([g["adapters"] for g in got])
    problems = [e for g in got for e in g["errors"]] + problems
    if not adapters and not problems:
        problems.append("no trainer process passed an adapter")
    _refuse(problems)
    return adapters


def agree_check(world: Any, errors: Sequence[str], timeout: float) -> None:
    """``lora/check``: every worker's verdict on the round's adapters; raises the same
    :class:`LoRAError` everywhere if any found a problem. Collective."""
    got = world.allgather_json({"errors": list(errors)}, timeout=timeout, kind="lora/check")
    _refuse([e for g in got for e in g["errors"]])


def refit_names(adapters: Sequence[Mapping[str, Any]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Refit name (``"<adapter>/<PEFT tensor>"``) -> (shape, dtype) of a round."""
    return {f"{a['name']}/{t}": (tuple(s), d) for a in adapters for t, (s, d) in
            a["tensors"].items()}


def lora_refit_config(config: Any) -> Any:
    """The refit config of LoRA rounds: the backend's, with no wire cast (the factors
    travel in their own dtype and vLLM casts them to ``lora_dtype``, as from a file)."""
    import dataclasses
    return dataclasses.replace(config, wire_dtype=None)


# ---------------------------------------------------------------------------- a worker's receiver

class LoRAReceiver:
    """One vLLM worker's side of LoRA rounds, built by the ``"xreshard"`` backend's worker
    engine on its first round (``update_weights({"lora": {...}})``).

    Args:
        engine: the worker's ``XreshardWeightTransferEngine`` (joined: world, destination,
            recording, stream).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stream: Any = None
        self.version = 0
        self.last: dict[str, Any] = {}
        self.last_error: str | None = None
        self._layouts: dict[str, dict[str, Layout]] = {}     # the last good round's, by spec
        self._modules: _Modules | None = None

    @property
    def manager(self) -> Any:
        """The model's ``LoRAModelManager`` (None: the engine runs without ``enable_lora``)."""
        return getattr(self.engine.model, "lora_manager", None)

    def receive(self, info: Mapping[str, Any]) -> None:
        """One LoRA round (collective with the trainer's ``send_loras``). Errors are raised
        on the last worker only and logged on the others (the backend's convention: vLLM's
        multiprocess executor reads the first failed reply and queues the rest)."""
        dest = self.engine._dest
        try:
            self._round(info)
            self.last_error = None
        except Exception as e:  # noqa: BLE001 - the same error on every process
            self.last_error = f"{type(e).__name__}: {e}"
            if dest.rec.worker != dest.rec.num_workers - 1:
                logger.error("xreshard: LoRA round %d failed on every rank: %s",
                             self.version + 1, self.last_error)
                return
            raise

    def _round(self, info: Mapping[str, Any]) -> None:
        from xreshard.adapters.vllm.stream import Stream

        eng = self.engine
        world, timeout = eng.world, eng.stream.config.timeout
        early: list[str] = []
        if self.manager is None:
            early.append("the vLLM engine runs without LoRA; start it with enable_lora=True "
                         "(and max_lora_rank, max_loras) to refit adapters")
        else:
            try:
                install_hook()
            except LoRAError as e:
                early.append(str(e))
        if self.stream is None:     # collective with the trainer's first LoRA round
            self.stream = Stream(world, "receive", config=lora_refit_config(eng.stream.config))
        adapters = agree_specs(world, [], early, timeout)
        key = _digest(adapters)
        layouts = self._layouts.get(key)
        if layouts is None:
            # nothing here may raise on one worker alone: the others would wait in the
            # gathers; every problem goes into lora/check instead
            try:
                regions, errors = self._check(adapters)
            except Exception as e:  # noqa: BLE001 - reported to every process
                regions, errors = {}, [f"{type(e).__name__}: {e}"]
            everyone = self._gather_workers(regions)
            found: dict[str, Layout] = {}
            if not errors:
                try:
                    found = self._layouts_of(adapters, everyone)
                except Exception as e:  # noqa: BLE001 - deterministic: alike on every worker
                    errors.append(f"{type(e).__name__}: {e}")
            agree_check(world, errors, timeout)     # found is complete past here
            layouts = found
            self._layouts = {key: layouts}
        else:
            agree_check(world, [], timeout)
        self._move(adapters, layouts, info)

    # ------------------------------------------------------------ checks and layouts

    def _check(self, adapters: Sequence[Mapping[str, Any]]) -> tuple[dict, list[str]]:
        """(refit name -> this worker's regions as JSON, problems) for a round's adapters."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        mgr, eng = self.manager, self.engine
        if self._modules is None:
            self._modules = _Modules(mgr)
        hf = eng._recording.shapes
        max_pos = getattr(eng.vllm_config.model_config.hf_config.get_text_config(),
                          "max_position_embeddings", None)
        regions: dict[str, list] = {}
        errors: list[str] = []
        for spec in adapters:
            where = f"adapter {spec['name']!r}"
            try:
                peft = _peft_helper(spec["config"], max_pos)
                peft.validate_legal(mgr.lora_config)
            except (ValueError, TypeError) as e:
                errors.append(f"{where}: {e}")
                continue
            if spec["config"].get("modules_to_save"):
                errors.append(f"{where}: modules_to_save is not refit in memory")
            factors: dict[str, set[bool]] = {}
            for tname, (shape, _) in spec["tensors"].items():
                try:
                    module, is_a, layer, index = self._modules.find(tname)
                    factors.setdefault(module, set()).add(is_a)
                    rank = peft.get_rank_and_scaling(parse_fine_tuned_lora_name(tname)[0])[0]
                    base = self._modules.base_shape(module, layer, index, hf)
                    want = [rank, base[1]] if is_a else [base[0], rank]
                    if list(shape) != want:
                        raise LoRAError(f"{tname!r} is {list(shape)} but {module}.weight is "
                                        f"{list(base)} and r={rank}: expected {want}")
                    regions[f"{spec['name']}/{tname}"] = [
                        [[s, e] for s, e in zip(r.starts, r.stops)]
                        for r in read_regions(layer, index, shape, "A" if is_a else "B")]
                except Exception as e:  # noqa: BLE001 - every problem goes to lora/check
                    text = str(e) if isinstance(e, LoRAError) else f"{type(e).__name__}: {e}"
                    errors.append(f"{where}: {text}")
            errors += [f"{where}: module {m!r} has lora_{'A' if True in ab else 'B'} but "
                       f"no lora_{'B' if True in ab else 'A'}"
                       for m, ab in sorted(factors.items()) if len(ab) != 2]
        return regions, errors

    def _gather_workers(self, regions: Mapping[str, list]) -> list[Mapping[str, list]]:
        """Every worker's regions of this engine (vLLM's own CPU group; the world's
        exchanges carry only verdicts). Collective over the engine's workers."""
        rec = self.engine._dest.rec
        if rec.num_workers == 1:
            return [regions]
        from vllm.distributed import parallel_state as ps

        from .build import allgather_json
        return allgather_json(regions, ps.get_world_group().cpu_group)

    def _layouts_of(self, adapters: Sequence[Mapping[str, Any]],
                    everyone: Sequence[Mapping[str, list]]) -> dict[str, Layout]:
        """Refit name -> layout over the world's rollout ranks (every engine alike)."""
        specs = refit_names(adapters)
        pieces = {w: {n: [Piece(n, Region.of(r), n, Region.of(r)) for r in regs]
                      for n, regs in regions.items()} for w, regions in enumerate(everyone)}
        one = layouts_from_pieces(pieces, {n: s for n, (s, _) in specs.items()},
                                  {n: d for n, (_, d) in specs.items()})
        ranks = self.engine.world.group_ranks("rollout")
        n = len(everyone)
        per_engine = [list(ranks[e * n:(e + 1) * n]) for e in range(len(ranks) // n)]
        return {name: replicate_layout(lay, per_engine) for name, lay in one.items()}

    # ------------------------------------------------------------ moving and committing

    def _move(self, adapters: Sequence[Mapping[str, Any]], layouts: Mapping[str, Layout],
              info: Mapping[str, Any]) -> None:
        """Receive every factor into fresh buffers (one planned call), then commit them
        once every process confirmed the round."""
        from xreshard.adapters.torch import tensor_view
        from xreshard.runtime.binding import Bound

        torch = import_torch()
        eng, rank = self.engine, self.engine._dest.rank
        device = "cpu" if eng.device.type == "cpu" else eng.device
        specs = refit_names(adapters)
        names = sorted(specs)
        self.stream.set_groups([names])
        buffers: dict[str, Any] = {}

        def part(g: int, group: list[str], errs: list[str]) -> Bound:
            bindings = {}
            for n in group:
                shape, dt = specs[n]
                buf = buffers[n] = torch.zeros(shape, dtype=getattr(torch, dt), device=device)
                views = [tensor_view(buf[r.slices()]) for r in layouts[n].regions(rank)]
                if views:
                    bindings[(rank, n)] = views[0] if layouts[n].is_product else views
            return Bound({n: layouts[n] for n in group}, bindings, errors=errs)

        report = self.stream.run({n: s for n, (s, _) in specs.items()}, [], part)
        self.version += 1
        store = _STORES.setdefault(self.manager, {})
        for spec in adapters:
            prefix = spec["name"] + "/"
            old = store.get(spec["lora_id"])
            for lora_id in [i for i, c in store.items() if c.name == spec["name"]]:
                del store[lora_id]      # a name lives in one slot
            store[spec["lora_id"]] = _Committed(
                spec["name"], spec["lora_id"], dict(spec["config"]),
                {n[len(prefix):]: buffers[n] for n in names if n.startswith(prefix)},
                old.version + 1 if old is not None and old.name == spec["name"] else 1)
            # drop the registered old version: the next batch naming it builds the new one
            self.manager.remove_adapter(spec["lora_id"])
        self.last = {
            "lora_version": self.version, "trainer_version": info.get("version"),
            "adapters": {c.name: {"lora_id": c.lora_id, "version": c.version}
                         for c in store.values()},
            "bytes_received": report.bytes_received, "bytes_local": report.bytes_local,
            "shard_bytes": sum(r.size * itemsize(specs[n][1]) for n in names
                               for r in layouts[n].regions(rank)),
            "num_tensors": len(names), "num_messages": report.num_messages,
            "replanned": report.replanned, "seconds": report.seconds}
        logger.info("xreshard: LoRA round %d: %d tensors of %s received (%d bytes, %d "
                    "messages)", self.version, len(names), [a["name"] for a in adapters],
                    report.bytes_received, report.num_messages)

    def report(self) -> dict[str, Any]:
        """The last LoRA round as this worker saw it (JSON)."""
        dest = self.engine._dest
        return {"tp_rank": dest.rec.tp_rank, "worker": dest.rec.worker, "world_rank": dest.rank,
                "lora_version": self.version, "last_error": self.last_error, **self.last}
