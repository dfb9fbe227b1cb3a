"""Which sent torch tensors were written while a refit read them: the torch side of
``RefitConfig(check_writes=True)`` (the core's side is :mod:`xreshard.runtime.writes`).

Decision record. A refit reads its sources from the moment the call begins
(``Refit.start()`` returns at once) until its last send; a write in between hands the
receivers a mix of two versions (a fused optimizer step overlapping a started refit: some
tensors of step k, some of step k+1). Torch's version counters (``tensor._version``) were
the first check and miss the common writes: ``AdamW``/``Adam``/``SGD(fused=True)`` update
parameters without moving them, and so do writes through ``.data`` and through a numpy
view (``t.numpy()[:] = ...``). So the check compares content:

- **what**: the keyed digest (:mod:`xreshard.runtime.digest`, the one ``verify=True`` uses,
  under this process's random key) of every local tensor of the send object (a DTensor's local
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
no content check can see), and a change the digest maps to the same value (at most
``2**-32 + n/(2**127 - 1)`` for any change of n 64 KiB blocks made without the key, a
sign flip or swapped words included; it is not a MAC). Rejected: a snapshot copy of
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
        self._pending: dict[str, tuple[Any, int]] = {}      # name -> (block values, bytes)
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
            from ..runtime import digest
            by_device: dict[Any, list[tuple[str, Any, int]]] = {}
            for name, (values, nbytes) in self._pending.items():
                by_device.setdefault(values.device, []).append((name, values, nbytes))
            for items in by_device.values():
                host = torch.cat([v for _, v, _ in items]).cpu().tolist()
                at = 0
                for name, values, nbytes in items:
                    count = int(values.numel())
                    self._digests[name] = digest.finish(host[at:at + count], nbytes,
                                                        digest.process_key())
                    at += count
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
    """The digest of a tensor's elements' bytes in row-major order, computed with torch ops
    on the tensor's device (the same digest as :func:`xreshard.runtime.verify.checksum` of
    the same bytes, under this process's key; waits for the device)."""
    from ..runtime import digest
    values, nbytes = _device_sums(t)
    return digest.finish(values.cpu().tolist(), nbytes, digest.process_key())


def _strided(t: Any) -> bool:
    import torch
    return t.layout == torch.strided and t.device.type != "meta"


def _host_checksum(t: Any) -> str:
    """The digest of a CPU tensor with numpy, in place (a copy only when it is strided)."""
    from ..runtime.verify import checksum as host_checksum
    from .torch import tensor_view
    return host_checksum(tensor_view(t))


def _device_sums(t: Any) -> tuple[Any, int]:
    """The digest's block values of ``t``'s bytes (:mod:`xreshard.runtime.digest`: NH per
    block and lane) as an int64 tensor on ``t``'s device, queued on the current stream (not
    waited for), and the byte count.

    Torch has no uint32 arithmetic, so the 32-bit words are int64 here: ``(w + k) & M32``
    is the uint32 add, and int64 products and sums wrap modulo 2**64 as uint64 ones do; the
    values' bits are the host path's.
    """
    import torch
    from ..runtime import digest

    key = digest.process_key()
    flat = t.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()            # row-major, as the host path reads it
    data = flat.reshape(-1).view(torch.uint8)
    nbytes = data.numel()
    full, tail = divmod(nbytes, digest.BLOCK_WORDS * 4)
    half = digest.BLOCK_WORDS // 2
    h = -(-tail // 8)
    padded = full * digest.BLOCK_WORDS * 4 + 8 * h
    if padded != nbytes or data.storage_offset() % 4:
        grown = torch.zeros(padded, dtype=torch.uint8, device=data.device)
        grown[:nbytes] = data
        data = grown
    low, high = key.on_device("torch", data.device, lambda lo, hi: (
        torch.from_numpy(lo.astype(np.int64)).to(data.device),
        torch.from_numpy(hi.astype(np.int64)).to(data.device)))
    words = data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    parts = []
    if full:
        blocks = words[:full * digest.BLOCK_WORDS].view(full, digest.BLOCK_WORDS)
        lanes = [(((blocks[:, :half] + low[lane]) & 0xFFFFFFFF)
                  * ((blocks[:, half:] + high[lane]) & 0xFFFFFFFF)).sum(dim=1)
                 for lane in range(digest.LANES)]
        parts.append(torch.stack(lanes, dim=1).reshape(-1))
    if tail:
        last = words[full * digest.BLOCK_WORDS:]
        parts.append(torch.stack([(((last[:h] + low[lane, :h]) & 0xFFFFFFFF)
                                   * ((last[h:] + high[lane, :h]) & 0xFFFFFFFF)).sum()
                                  for lane in range(digest.LANES)]))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=data.device), nbytes
    return torch.cat(parts), nbytes
