"""Which sent torch tensors were written while a refit read them: the torch side of
``RefitConfig(check_writes=True)`` (the core's side is :mod:`xreshard.runtime.writes`).

Decision record. A refit reads its sources from the moment the call begins
(``Refit.start()`` returns at once) until its last send; a write in between hands the
receivers a mix of two versions (a fused optimizer step overlapping a started refit: some
tensors of step k, some of step k+1). Torch's version counters (``tensor._version``) were
the first check and miss the common writes: ``AdamW``/``Adam``/``SGD(fused=True)`` update
parameters without moving them, and so do writes through ``.data`` and through a numpy
view (``t.numpy()[:] = ...``). So the check compares content:

- **what**: the xr64x2 checksum (:func:`xreshard.runtime.verify.checksum`, 128 bits, the
  one ``verify=True`` uses) of every local tensor of the send object (a DTensor's local
  shard, a plain tensor whole), and its version counter; a tensor whose digest or counter
  moved was written (so ``t.add_(0)`` counts, through its counter). The whole local tensor,
  not only the regions this rank sends: which regions go where is known only after the
  refit's first collective, in its own thread, when the caller may already be writing.
- **when**: ``Refit.start()`` takes the first digests before it returns, in the caller's
  thread, so every later write of the caller falls inside the window; a blocking call
  takes them as it begins. The second digests are taken when the executor has returned:
  every read of every source is then done, on every stream.
- **where**: on the tensor's device. A CPU tensor is hashed in place with numpy (the
  checksum's own host path); a CUDA tensor with torch ops queued on the current stream
  (for a started refit, the caller's stream, which ``Refit.start`` captures), without
  waiting: the first digests are ordered before any kernel the caller queues after
  ``start()`` returns (a fused optimizer step), and the host waits once, when the check
  reads the digests back. :func:`checksum` gives the same digest as the host path on any
  device (tested on CPU here, on a GPU by ``scripts/gpu_check.sh``).

Not seen: a write that leaves every byte as it was by the refit's end without moving a
counter (``p.data.add_(0)``: harmless, unless the refit read the bytes in between, which
no content check can see), and a change the checksum maps to the same digest (for
accidental changes about 2**-64; it is not cryptographic). Rejected: a snapshot copy of
the sources (twice the memory, for a debug option), and hashing only the sent regions
(known too late, above).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["Taken", "changes", "checksum", "snapshot"]


def snapshot(tensors_of: Callable[[], Mapping[str, Any]]) -> Callable[[], list[str]]:
    """Take the digests and version counters of ``tensors_of()`` now; return ``written()``,
    which takes them again and lists the tensors written since (see :func:`changes`)."""
    before = Taken(tensors_of())

    def written() -> list[str]:
        return changes(before, Taken(tensors_of()))
    return written


class Taken:
    """Digests and version counters of named tensors at one moment; CUDA digests stay on
    their devices (queued on the current stream) until :meth:`digests` reads them."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.versions: dict[str, int] = {}
        self._digests: dict[str, str] = {}
        self._pending: dict[str, tuple[Any, int]] = {}      # name -> (device sums, bytes)
        self._same: dict[str, str] = {}                     # tied tensors -> the first name
        first: dict[tuple, str] = {}
        for name, t in tensors.items():
            self.versions[name] = int(t._version)
            if not _strided(t):
                continue        # binding refuses it: nothing is sent to check
            where = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if where in first:      # tied weights (one tensor under two names): hash once
                self._same[name] = first[where]
                continue
            first[where] = name
            if t.device.type == "cpu":
                self._digests[name] = _host_checksum(t)
            else:
                self._pending[name] = _device_sums(t)

    def digests(self) -> dict[str, str]:
        """Every digest as hex (waits for the device ones: one copy per device)."""
        if self._pending:
            import torch
            from ..runtime.verify import checksum_hex
            by_device: dict[Any, list[tuple[str, Any, int]]] = {}
            for name, (sums, nbytes) in self._pending.items():
                by_device.setdefault(sums.device, []).append((name, sums, nbytes))
            for items in by_device.values():
                host = torch.stack([s for _, s, _ in items]).cpu().tolist()
                for (name, _, nbytes), (h1, h2) in zip(items, host):
                    self._digests[name] = checksum_hex(h1, h2, nbytes)
            self._pending = {}
        for name, same in self._same.items():
            self._digests[name] = self._digests[same]
        return self._digests


def changes(before: Taken, after: Taken) -> list[str]:
    """``"'name' (what changed)"`` for each tensor written between ``before`` and ``after``
    (its bytes, its version counter), removed from or added to the sent object."""
    old, new = before.digests(), after.digests()
    out = []
    for name, version in before.versions.items():
        if name not in after.versions:
            out.append(f"{name!r} (removed from the sent object)")
            continue
        what = []
        if old.get(name) != new.get(name):
            what.append("bytes changed")
        if after.versions[name] != version:
            what.append(f"version {version} -> {after.versions[name]}")
        if what:
            out.append(f"{name!r} ({', '.join(what)})")
    out += [f"{name!r} (added to the sent object)" for name in after.versions
            if name not in before.versions]
    return out


def checksum(t: Any) -> str:
    """The xr64x2 digest of a tensor's elements' bytes in row-major order, computed with
    torch ops on the tensor's device (the same digest as
    :func:`xreshard.runtime.verify.checksum` of the same bytes; waits for the device)."""
    from ..runtime.verify import checksum_hex
    sums, nbytes = _device_sums(t)
    h1, h2 = sums.cpu().tolist()
    return checksum_hex(h1, h2, nbytes)


def _strided(t: Any) -> bool:
    import torch
    return t.layout == torch.strided and t.device.type != "meta"


def _host_checksum(t: Any) -> str:
    """xr64x2 of a CPU tensor with numpy, in place (a copy only when it is strided)."""
    from ..runtime.verify import checksum as host_checksum
    from .torch import tensor_view
    return host_checksum(tensor_view(t))


#: device -> (P, Q) as int64 tensors there (the uint64 weights' bits), grown on demand
_WEIGHTS: dict[Any, tuple[Any, Any]] = {}


def _weights(device: Any, num_rows: int) -> tuple[Any, Any]:
    import torch
    from ..runtime.verify import checksum_weights
    have = _WEIGHTS.get(device)
    if have is None or have[0].numel() < num_rows:
        p, q = checksum_weights(max(num_rows, 1024))
        have = (torch.from_numpy(p.view(np.int64)).to(device),
                torch.from_numpy(q.view(np.int64)).to(device))
        _WEIGHTS[device] = have
    return have[0][:num_rows], have[1]


def _device_sums(t: Any) -> tuple[Any, int]:
    """xr64x2's two weighted sums of ``t``'s bytes as an int64 tensor ``[h1, h2]`` on
    ``t``'s device, queued on the current stream (not waited for), and the byte count.

    The bytes are little-endian 64-bit words in rows of ``ROW_WORDS``, the last row
    zero-padded; ``h1`` weighs the row sums, ``h2`` the column sums (see
    :mod:`xreshard.runtime.verify`). Int64 sums and products wrap like uint64 ones.
    """
    import torch
    from ..runtime.verify import ROW_WORDS

    flat = t.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()            # row-major, as the host path reads it
    data = flat.reshape(-1).view(torch.uint8)
    if data.storage_offset() % 8:
        data = data.clone()                 # 64-bit words need 8-byte alignment
    nbytes, row = data.numel(), ROW_WORDS * 8
    full, tail = divmod(nbytes, row)
    rowsums = [torch.zeros(0, dtype=torch.int64, device=data.device)]
    colsum = torch.zeros(ROW_WORDS, dtype=torch.int64, device=data.device)
    if full:
        words = data[:full * row].view(torch.int64).view(full, ROW_WORDS)
        rowsums.append(words.sum(dim=1))
        colsum = colsum + words.sum(dim=0)
    if tail:
        last = torch.zeros(row, dtype=torch.uint8, device=data.device)
        last[:tail] = data[full * row:]
        words = last.view(torch.int64)
        rowsums.append(words.sum().reshape(1))
        colsum = colsum + words
    sums = torch.cat(rowsums)
    p, q = _weights(data.device, int(sums.numel()))
    return torch.stack([(sums * p).sum(), (colsum * q).sum()]), nbytes
