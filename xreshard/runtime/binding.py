"""Bindings: where, in this process's memory, each held region lives, and their checks.

A binding is what a rank holds of a tensor, in the tensor's canonical coordinates: an array
(numpy on CPU, CuPy on GPU) for product layouts, a list of arrays (one per region, in
``layout.regions(rank)`` order) for explicit ones. Adapters produce a :class:`Bound` (the
layouts of one side plus the bindings of this process's ranks); custom engines can build
one directly.

``binding_problems`` is what stands between a careless caller and a silent wrong weight:
every binding must have its layout's exact shape and dtype (not only its element size),
be writable when it receives, never write one element twice (no stride-0 or overlapping
views), and every rank of this process that a layout says holds a region must bind it.
Receiving memory that overlaps other receiving memory or a source is refused by address
range, host and device (CuPy, torch: the CUDA Array Interface) alike, in every process
before any byte moves (``side_problems`` feeds the refit's first exchange).
"""

from __future__ import annotations

import os
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..dtypes import dtype_name, numpy_dtype
from ..errors import BindingError, XreshardError
from ..ir.layout import Layout

__all__ = ["Bindings", "Bound", "Rebuilt", "RowBindings", "binding_problems",
           "side_problems", "canonical_name"]

#: (rank, tensor name) -> binding
Bindings = Mapping[tuple[int, str], Any]


class RowBindings(dict):
    """Bindings some of which are rows of a few host blocks, saying so: ``rows`` maps such
    a binding's key to ``(block, row)`` (an index into ``blocks``, the row of that block
    the binding is a view of; kept from call to call while the rows mean the same, so a
    plan made from it can be kept too) and ``blocks`` holds this call's C-contiguous
    blocks. The executor copies a run of consecutive rows out of their block at once
    instead of gathering the bindings one by one (``runtime/hostcopy.py``).

    Only the adapter that made the rows vouches for them: any change to the dict (a
    binding set, deleted, updated) forgets them (``rows`` becomes empty, and every binding
    is read as itself), and a copy (``copy.copy``, ``deepcopy``, pickling, ``dict(...)``)
    is a plain dict; :meth:`same` is the one copy that keeps them."""

    __slots__ = ("rows", "blocks")

    def __init__(self, items: Any, rows: Mapping[tuple[int, str], tuple[int, int]],
                 blocks: list[np.ndarray]):
        super().__init__(items)
        self.rows = rows
        self.blocks = blocks

    def same(self) -> RowBindings:
        """A copy that still says which bindings are rows (the same blocks)."""
        return RowBindings(self, self.rows, self.blocks)

    def _forget(self) -> None:
        self.rows, self.blocks = {}, []

    def __setitem__(self, key: Any, value: Any) -> None:
        self._forget()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._forget()
        super().__delitem__(key)

    def __ior__(self, other: Any) -> RowBindings:
        self._forget()
        return super().__ior__(other)  # type: ignore[misc,no-any-return]

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._forget()
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._forget()
        return super().setdefault(key, default)

    def pop(self, *args: Any) -> Any:
        self._forget()
        return super().pop(*args)

    def popitem(self) -> Any:
        self._forget()
        return super().popitem()

    def clear(self) -> None:
        self._forget()
        super().clear()

    def copy(self) -> dict:  # type: ignore[override]
        return dict(self)

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        import copy
        return copy.deepcopy(dict(self), memo)

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


@dataclass
class Bound:
    """One side of a refit in this process: layouts plus where the bytes live.

    Attributes:
        layouts: global layout of every tensor of this side.
        bindings: ``(world rank, name) -> array`` for this process's ranks, in canonical
            coordinates, each array of its layout's dtype.
        finish: called after a successful receive (JAX builds its new arrays here).
        errors: problems found while binding, raised on every rank by the refit.
        local_only: names whose layout covers only this process's ranks (e.g. a plain
            tensor each process holds whole); the refit unions them over processes.
        quantized: name -> :class:`~xreshard.ir.formats.QuantizedTensor` of the tensors
            this (receiving) side stores quantized: codes under the name, scales under its
            ``scale`` (a sender offering the values has them quantized on the way).
        checked: the adapter vouches for the bindings, so :func:`side_problems` skips
            its per-binding walk (shapes, dtypes, coverage, and for a receiving side
            writability and overlaps): a lookup, not a walk, call after call. A sending
            side: every binding is a host array cut from a geometry (sharding, shape,
            dtype) whose shard shapes and dtype the adapter already compared with the
            layout, one binding per local rank of each layout. A receiving JAX side: every
            binding is a host buffer (or a row of one) the adapter took for this call
            alone, of a geometry it compared the same way. Either side: every entry is
            the very one of the last call's side, which passed (:func:`carried_over`).
            False for anything built by hand.
        passed: set by :func:`side_problems`: nothing was wrong with this side.
        fresh: a receiving side whose every binding is memory its adapter took for this
            call alone (a new host buffer, a row of one, or a recycled one nothing else
            references: ``adapters/jax_landing.py``), so no send binding can alias it and
            :func:`side_problems` does not compare the two sides' memory. False for
            anything built by hand.
    """

    layouts: dict[str, Layout]
    bindings: dict[tuple[int, str], Any]
    finish: Callable[[], Any] | None = None
    errors: list[str] = field(default_factory=list)
    local_only: set[str] = field(default_factory=set)
    quantized: dict[str, Any] = field(default_factory=dict)
    checked: bool = False
    passed: bool = False
    fresh: bool = False

    def describe(self) -> dict[str, dict]:
        """JSON description of the layouts, for the metadata exchange."""
        out = {}
        for name, lay in self.layouts.items():
            d = lay.to_dict()
            if name in self.local_only:
                d["local_only"] = True
            out[name] = d
        return out

    def stored_transposed(self) -> list[str]:
        """The 2-D tensors whose every binding in this process is stored transposed
        (column-major: a JAX ``[in, out]`` kernel bound as its ``[out, in]`` view), for the
        metadata exchange (with ``Tuning.send_stored``): where every sender says so, the
        call sends them in that order (``xreshard.planner.formats.wire_orders``). Only a
        speed hint: the executor reads any strides, whatever is declared."""
        flat: dict[str, bool] = {}
        for (_, name), b in self.bindings.items():
            if flat.get(name, True):
                flat[name] = all(_column_major(a) for a in (b if isinstance(b, list) else [b]))
        return sorted(n for n, t in flat.items()
                      if t and n in self.layouts and self.layouts[n].ndim == 2)

    def describe_quantized(self) -> dict[str, dict]:
        """JSON description of :attr:`quantized`, for the metadata exchange."""
        return {name: q.to_dict() for name, q in sorted(self.quantized.items())}


def _column_major(a: Any) -> bool:
    """A 2-D array whose columns are contiguous and rows are not (a transposed kernel)."""
    strides = getattr(a, "strides", None)
    return (getattr(a, "ndim", 0) == 2 and strides is not None and a.shape[0] > 1
            and strides[0] == a.itemsize and strides[1] > strides[0])


class Rebuilt:
    """A side built anew at every call from the world: ``build(world)`` returns a
    :class:`Bound` (or any object an adapter binds, or None).

    For hand-built layouts in an elastic world (``World.join(elastic=True)``), whose ranks
    are renumbered when members change, even in the middle of a call that finishes without
    a lost member: ``Refit(world, receive=Rebuilt(lambda w: Bound(layouts_from(w), ...)))``.
    """

    def __init__(self, build: Callable[[Any], Any]):
        if not callable(build):
            raise XreshardError(f"Rebuilt takes a callable world -> side, got {build!r}")
        self.build = build


def canonical_name(default: str, names: Mapping[str, str] | Callable[[str], str] | None) -> str:
    """The canonical name of ``default`` (a JAX path, a state-dict key) under ``names=``.

    A mapping renames the keys it has; a callable is the user's code, so whatever it raises
    becomes a :class:`BindingError` that keeps the exception's type, message and where it was
    raised (every process then reports the same words, and the user finds the line)::

        names= raised KeyError('x') at my_module.py:12 in to_hf, for 'layers/0/kernel'

    Raises:
        BindingError: the callable raised, or returned something other than a string.
    """
    if names is None:
        return default
    if not callable(names):
        return names.get(default, default)
    try:
        out = names(default)
    except Exception as e:  # noqa: BLE001 - the user's code: any exception is bad input
        raise BindingError(f"names= raised {e!r}{_raised_at(e)}, for {default!r}; fix the "
                           "names= callable (or pass a mapping)") from e
    if not isinstance(out, str):
        raise BindingError(f"names= returned {out!r} ({type(out).__name__}) for {default!r}; "
                           "it must return the canonical name as a str")
    return out


def _raised_at(e: BaseException) -> str:
    """`` at file.py:12 in fn`` for the innermost Python frame that raised ``e`` (where the
    user's code failed, or the library it called), or "" without a traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    if len(frames) < 2:          # only canonical_name's own frame: raised in C below it
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def _arrays(binding: Any, layout: Layout) -> list[Any]:
    if layout.is_product:
        return [binding]
    if not isinstance(binding, (list, tuple)):
        raise XreshardError("an explicit layout binds a list of arrays, one per region")
    return list(binding)


def _array_problem(a: Any, shape: tuple[int, ...], dtype: str, writes: bool) -> str | None:
    """What is wrong with one bound array, or None."""
    a_shape = getattr(a, "shape", None)
    a_dtype = getattr(a, "dtype", None)
    if a_shape is None or a_dtype is None or not hasattr(a, "strides"):
        return f"bound a {type(a).__name__}, expected an array (numpy, CuPy)"
    if tuple(a_shape) != shape:
        return f"local shape {tuple(a_shape)}, layout says {shape}"
    if a_dtype != _np_dtype(dtype):
        try:
            got = dtype_name(a_dtype)
        except XreshardError:
            got = str(a_dtype)
        hint = (" (view the memory as its real dtype; a raw-bits view would make the executor "
                "write the layout's bits into it)" if np.dtype(a_dtype).itemsize
                == np.dtype(_np_dtype(dtype)).itemsize else "")
        return f"local dtype {got}, layout says {dtype}{hint}"
    if writes:
        flags = getattr(a, "flags", None)
        if flags is not None and not getattr(flags, "writeable", True):
            return "read-only memory cannot receive (bind a writable array)"
    if writes and a.size > 1 and not _contiguous(a):
        for n, s in zip(a.shape, a.strides):
            if n > 1 and s == 0:
                return ("aliased memory: a dim of stride 0 (expand()/broadcast_to) would write "
                        "every element of it to one place; bind a real buffer")
        extent = sum((n - 1) * abs(s) for n, s in zip(a.shape, a.strides)) + a.itemsize
        if extent < a.nbytes:
            return "self-overlapping strides: some elements share memory"
    return None


def _contiguous(a: Any) -> bool:
    flags = getattr(a, "flags", None)
    return bool(flags is not None and (flags.c_contiguous or flags.f_contiguous))


def _np_dtype(name: str) -> Any:
    return numpy_dtype(name)


def _extent(a: Any) -> tuple[int, int] | None:
    """[lo, hi) bytes the array ``a`` spans (host memory, or device memory through the CUDA
    Array Interface), or None when it holds nothing or exposes no address."""
    if not isinstance(a, np.ndarray):
        a = _address_proxy(a)
        if a is None:
            return None
    if a.size == 0:
        return None
    lo = hi = a.__array_interface__["data"][0]
    if a.flags.c_contiguous:        # the common case: its bytes in one run
        return lo, lo + a.nbytes
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + a.itemsize


class _Addresses:
    """A device array's address, shape and strides as a numpy array interface, so that
    ``np.shares_memory`` can decide overlaps by arithmetic on the addresses (it never reads
    the memory; nothing here does)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], item: int):
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "strides": strides,
                                    "typestr": f"|V{item}", "version": 3}


def _address_proxy(a: Any) -> np.ndarray | None:
    """A numpy array at the device addresses of ``a`` (CuPy, torch, anything with a
    ``__cuda_array_interface__``): for overlap arithmetic only, never to be read. None when
    ``a`` exposes no device address."""
    cai = getattr(a, "__cuda_array_interface__", None)
    if not isinstance(cai, Mapping):
        return None
    shape = tuple(int(n) for n in cai["shape"])
    item = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is None:             # C-contiguous (the interface's convention)
        strides, step = [], item
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        strides = tuple(reversed(strides))
    ptr = int(cai["data"][0])
    if ptr == 0 or 0 in shape:
        return None
    return np.asarray(_Addresses(ptr, shape, tuple(int(s) for s in strides), item))


def _overlaps(items: list[tuple[str, Any]], sources: list[tuple[str, Any]] = ()
              ) -> list[str]:
    """Pairs of arrays that share an element (a sweep by address): two receiving arrays of
    ``items``, or, when ``sources`` are given, a receiving array of ``items`` and a sending
    one of ``sources`` (a receive would overwrite bytes a send still reads). Host arrays
    and device arrays alike: CUDA's unified addressing gives every byte of a process, host
    or any of its GPUs, one address, so one sweep over all of them is exact."""
    if not sources and _swept_before(items):
        return []
    spans = [(span, label, _as_addresses(a), False) for label, a in items
             if (span := _extent(a)) is not None]
    spans += [(span, label, _as_addresses(a), True) for label, a in sources
              if (span := _extent(a)) is not None]
    spans.sort(key=lambda x: x[0])
    problems: list[str] = []
    active: list[tuple[tuple[int, int], str, Any, bool]] = []
    for span, label, a, sends in spans:
        active = [x for x in active if x[0][1] > span[0]]
        for _, other_label, other, other_sends in active:
            if sources and sends == other_sends:
                continue
            try:
                shared = np.shares_memory(a, other, max_work=100_000)
            except np.exceptions.TooHardError:
                shared = True
            if shared and sources:
                dst, src = (other_label, label) if sends else (label, other_label)
                problems.append(f"receive {dst} shares memory with send {src}: a receive "
                                f"would overwrite bytes a send still reads (bind a copy)")
            elif shared:
                problems.append(f"{label} and {other_label} share memory: a receive would "
                                f"write the same bytes twice")
            if len(problems) >= 5:
                return problems
        active.append((span, label, a, sends))
    if not sources and not problems:
        _remember_swept(items)
    return problems


#: the last host arrays found not to overlap: (weak references, (shape, strides) of each).
#: A refit binds the same receiving views call after call (the torch adapter keeps them);
#: an ndarray's address never changes, so the same objects with the same shapes and
#: strides span the same bytes and need no new sweep. Weak: nothing is kept alive.
_SWEPT: tuple[list[Any], list[tuple]] = ([], [])


def _swept_before(items: list[tuple[str, Any]]) -> bool:
    """Whether ``items`` are the very arrays, of the same shapes and strides, in the same
    order, that the last clean sweep found not to overlap."""
    refs, geometry = _SWEPT
    if len(refs) != len(items) or not refs:
        return False
    for (_, a), ref, (shape, strides) in zip(items, refs, geometry):
        if ref() is not a or a.shape != shape or a.strides != strides:
            return False
    return True


def _remember_swept(items: list[tuple[str, Any]]) -> None:
    global _SWEPT
    if not items or not all(type(a) is np.ndarray for _, a in items):
        return
    _SWEPT = ([weakref.ref(a) for _, a in items], [(a.shape, a.strides) for _, a in items])


def _as_addresses(a: Any) -> np.ndarray:
    """``a`` itself when a host array, else its address proxy (see ``_address_proxy``)."""
    return a if isinstance(a, np.ndarray) else _address_proxy(a)


def _bound_arrays(bound: Bound) -> list[tuple[str, Any]]:
    """(label, array) of every array ``bound`` binds, host or device (lists of an explicit
    layout's regions included)."""
    out = []
    for (rank, name), b in bound.bindings.items():
        for a in (b if isinstance(b, (list, tuple)) else (b,)):
            if isinstance(a, np.ndarray) or hasattr(a, "__cuda_array_interface__"):
                out.append((f"{name!r} on rank {rank}", a))
    return out


def binding_problems(layouts: Mapping[str, Layout], bindings: Bindings, side: str,
                     local_ranks: Iterable[int] = ()) -> list[str]:
    """Everything wrong with this process's bindings of one side; empty when all is well.

    Args:
        layouts: the side's layouts (merged over processes or this process's own).
        bindings: ``(rank, name) -> binding``.
        side: "send" or "receive" (receiving memory must also be writable and unaliased).
        local_ranks: this process's ranks: each one a layout assigns a non-empty region
            must bind it.

    Returns:
        Messages naming tensor and rank, at most a few per kind of problem.
    """
    from .gcpause import gc_paused
    with gc_paused():
        return _binding_problems(layouts, bindings, side, local_ranks)


def _binding_problems(layouts: Mapping[str, Layout], bindings: Bindings, side: str,
                      local_ranks: Iterable[int]) -> list[str]:
    writes = side == "receive"
    bad: list[str] = []
    receiving: list[tuple[str, Any]] = []
    ndarray = np.ndarray
    #: (layout, rank) -> (local shape, numpy dtype) of a product layout, False for an
    #: explicit one: a model has a few hundred distinct layouts, so geometry is asked once
    #: each; found by the layout object's id first (layouts are interned: one object per
    #: value, and every one stays alive in ``layouts``), by value for a new object
    expected: dict[tuple[Layout, int], Any] = {}
    by_id: dict[tuple[int, int], Any] = {}
    for (rank, name), b in bindings.items():
        lay = layouts.get(name)
        if lay is None:
            bad.append(f"{name!r} on rank {rank}: bound but not in the {side} layouts")
            continue
        if type(b) is ndarray:     # the common case, in one look
            want = by_id.get((id(lay), rank))
            if want is None:
                want = expected.get((lay, rank))
                if want is None:
                    want = expected[(lay, rank)] = lay.is_product and (
                        tuple(lay.local_shape(rank)), _np_dtype(lay.dtype))
                by_id[(id(lay), rank)] = want
            if want and b.shape == want[0] and b.dtype == want[1] and (
                    not writes or (b.flags.writeable and b.flags.c_contiguous)):
                if writes:
                    receiving.append((f"{name!r} on rank {rank}", b))
                continue
        _check_one(lay, rank, name, b, writes, bad, receiving)
    for rank in local_ranks:
        for name, lay in layouts.items():
            if (rank, name) in bindings or rank not in lay.rank_set \
                    or lay.num_elements(rank) == 0:
                continue
            bad.append(f"{name!r} on rank {rank}: its {side} layout gives this rank "
                       f"{[str(r) for r in lay.regions(rank)][:3]}, but nothing is bound "
                       f"there")
    if writes:
        bad.extend(_overlaps(receiving))
    return bad


def _check_one(lay: Layout, rank: int, name: str, b: Any, writes: bool, bad: list[str],
               receiving: list[tuple[str, Any]]) -> None:
    """Every check of one binding (any array type, either layout form)."""
    if lay.is_product:
        shapes = [tuple(lay.local_shape(rank))]
    else:
        shapes = [tuple(r.shape) for r in lay.regions(rank)]
    try:
        arrays = _arrays(b, lay)
    except XreshardError as e:
        bad.append(f"{name!r} on rank {rank}: {e}")
        return
    if len(arrays) != len(shapes):
        bad.append(f"{name!r} on rank {rank}: {len(arrays)} arrays for {len(shapes)} regions")
        return
    for i, (a, shape) in enumerate(zip(arrays, shapes)):
        problem = _array_problem(a, shape, lay.dtype, writes)
        if problem:
            bad.append(f"{name!r} on rank {rank}: {problem}")
        elif writes:
            receiving.append((f"{name!r} on rank {rank}"
                              + (f" (region {i})" if not lay.is_product else ""), a))


def side_problems(sides: Mapping[str, Bound | None], local_ranks: Iterable[int],
                  is_local: Callable[[int], bool], wire_dtype: Any) -> list[list[str]]:
    """This process's own problems with its sides, before any exchange: the adapters'
    errors, names, :func:`binding_problems`, ranks of other processes, and (only when all
    that is well) what the devices holding the bindings cannot do.

    Args:
        sides: ``{"send": Bound | None, "receive": Bound | None}``.
        local_ranks: this process's world ranks.
        is_local: whether a world rank is one of this process's.
        wire_dtype: ``RefitConfig.wire_dtype``.

    Returns:
        ``[error class name, message]`` entries, for the refit's error exchange.
    """
    from .devices import device_problems
    local_ranks = list(local_ranks)
    out = []
    for side, bound in sides.items():
        if bound is None:
            continue
        before = len(out)
        out += [["RefitError", e] for e in bound.errors]
        for name in bound.layouts:
            if not isinstance(name, str):
                out.append(["RefitError", f"{side} tensor name {name!r} is not a str"])
        problems = [] if bound.checked else binding_problems(
            bound.layouts, bound.bindings, side, local_ranks=local_ranks)
        if problems:
            out.append(["BindingError", f"{side} bindings do not match their layouts: "
                        + "; ".join(problems[:20])])
        bound_ranks = {rank: None for rank, _ in bound.bindings}     # in order, once each
        for rank in bound_ranks:
            if not is_local(rank):
                out.append(["BindingError", f"{side} binds world rank {rank}, which is not "
                            f"one of this process's ranks {local_ranks}"])
                break
        bound.passed = len(out) == before
    send, receive = sides.get("send"), sides.get("receive")
    if not out and send is not None and receive is not None and not receive.fresh:
        aliased = _overlaps(_bound_arrays(receive), _bound_arrays(send))
        if aliased:
            out.append(["BindingError", "receive bindings alias send bindings: "
                        + "; ".join(aliased)])
    if not out and not all(set(map(type, b.bindings.values())) <= {np.ndarray}
                           for b in sides.values() if b):
        # only some device binding can fail on its device (host arrays: checked in C)
        held = {side: (b.bindings, b.layouts) for side, b in sides.items() if b}
        out += [["RefitError", e] for e in device_problems(
            held, lambda side, name: _wire_of(name, held[side][1][name], wire_dtype))]
    return out


def carried_over(bound: Bound, cache: dict, known: Mapping[Any, Any] | None) -> Bound:
    """``bound`` marked ``checked`` when it is, entry for entry, the side the same adapter
    bound on the last call and that side passed :func:`side_problems`: the same layout
    and binding objects over the same memory, so the same answer (for a receiving side
    too: its views' writability and overlaps are properties of those objects and that
    memory). Kept in ``cache["bound"]`` for the next call.

    Args:
        bound: this call's side, from an adapter that keeps its entries across calls in
            ``cache["known"]`` (``{entry key: record}``), each record carried over
            unchanged (the same object) when its tensor, spec and memory are unchanged.
        cache: the adapter's per-side cache.
        known: ``cache["known"]`` as it was before this call's binding.
    """
    last, now = cache.get("bound"), cache.get("known")
    bound.checked = bool(
        last is not None and last.passed and known and now is not None and not bound.errors
        and not bound.quantized and len(now) == len(known) == len(bound.layouts)
        == len(last.layouts) and len(bound.bindings) == len(last.bindings)
        and all(known.get(k) is entry for k, entry in now.items()))
    cache["bound"] = bound
    return bound


def _wire_of(name: str, layout: Layout, wire: Any) -> str:
    """The wire dtype of ``name`` as this process knows it before planning: the cast the
    config asks for, else the tensor's own dtype (both sides must then agree)."""
    if isinstance(wire, Mapping):
        wire = wire.get(name)
    return dtype_name(wire) if wire is not None else layout.dtype
