"""The content digest every integrity check compares: ``verify=``, delta fences and
``check_writes``. Keyed, with a collision bound that holds for every pair of inputs.

Decision record. The first checksum (xr64x2) summed 64-bit words with odd weights modulo
2**64. Fast (plain reductions), but blind by construction: adding 2**63 to two words adds
``2**63 * even`` = 0 to each sum, and bit 63 is the sign of every float64, of every odd
float32 element, of every fourth bf16 one. Negating a float64 tensor left it unchanged.
A checksum over a ring with zero divisors cannot prove anything about structured changes,
so this one is a universal hash with a proof, as in UMAC (Black, Halevi, Krawczyk, Krovetz,
Rogaway, CRYPTO 1999):

- **NH per block.** The bytes, zero-padded to whole 32-bit little-endian words, are cut
  into blocks of ``BLOCK_WORDS`` words (the last one shorter). A block of ``2h`` words
  ``w`` (the last one padded to an even count) is hashed per lane ``l`` as
  ``NH = sum_j ((w[j] + A[l,j]) mod 2**32) * ((w[h+j] + B[l,j]) mod 2**32)  mod 2**64``
  with key words ``A``, ``B`` uniform in ``[0, 2**32)``. For two different blocks of the
  same length, ``Pr[NH equal] <= 2**-32`` (UMAC, Theorem 4.2: NH is 2**-w-almost
  universal, here w = 32; the pairing ``(j, h+j)`` instead of ``(2j, 2j+1)`` is a fixed
  permutation of the words). ``LANES`` lanes with independent keys would multiply the
  bound; there is one (each lane costs a full pass: see Cost).
- **A polynomial over the blocks.** The block values (``LANES`` per block, each < 2**64)
  and last the byte length are the coefficients ``c_1 .. c_N`` of
  ``H = sum_i c_i r**(N-i)  mod p``, ``p = 2**127 - 1``, at a key point ``r`` uniform in
  ``[1, p)``. Two different coefficient sequences ending in their lengths give a nonzero
  difference polynomial of degree < N, zero at most at N - 1 points.

**The bound.** For any two different byte strings ``x``, ``y`` of at most ``n`` blocks,
chosen independently of the key: ``Pr[digest(x) == digest(y)] <= 2**-32 + n / (2**127 - 1)``
(same length: a block differs, and its NH values collide with probability <= 2**-32, else
the polynomial does with <= n/p; different lengths: the last coefficients differ). For any
size that fits in memory that is below ``2**-31.99``, for every change: sign flips, swapped
words, zeroed tiles, single bits alike; with a fresh key per call (``verify``) a change
that persists passes k calls with probability at most ``2**-32k``. It is not a MAC: a
process that sees the key can forge; the key is drawn where the comparison is made
(:func:`process_key` for comparisons inside one process, :func:`Key.of` from the world's
random instance nonce and the call for the ``verify`` exchange), so faults and careless
writes are independent of it.

The key words come from SHAKE-256 of the key's material, so numpy, CuPy and torch compute
the same digest from the same bytes, on any host, numpy version or device.

Cost: one 32x32->64 multiply per two words (numpy: two adds, one widening multiply and one
reduction per tile of blocks that stays in cache; large inputs are split over threads,
numpy releases the GIL): a few times the cost of xr64x2's plain sums on a CPU, and each
further lane would cost as much again, hence one (``benchmarks/bench_digest.py`` prints
them side by side). On a GPU both run far below the wire's time.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["BLOCK_WORDS", "LANES", "PRIME", "Hasher", "Key", "checksum", "device_digests",
           "finish", "process_key", "stream_hex"]

#: 32-bit words per NH block (64 KiB): one key word per word, per lane
BLOCK_WORDS = 16384
_HALF = BLOCK_WORDS // 2
_BLOCK_BYTES = BLOCK_WORDS * 4
#: independent NH lanes per block: each one's collision bound is 2**-32
LANES = 1
#: the polynomial's field
PRIME = (1 << 127) - 1
#: full blocks hashed per numpy tile (256 KiB: the tile's temporaries stay in cache)
_TILE_BLOCKS = 4
#: inputs of at least this many full blocks are split over threads (32 MiB)
_PARALLEL_BLOCKS = 512
_THREADS = max(1, min(4, os.cpu_count() or 1))
_M64 = (1 << 64) - 1


class Key:
    """The key of one digest: NH key words per lane and the polynomial's point, derived
    from ``material`` by SHAKE-256 (identical on every host and device).

    Attributes:
        material: what the key was derived from.
        low / high: ``(LANES, BLOCK_WORDS // 2)`` uint32 key words for a block's first and
            second half.
        point: the polynomial's point, in ``[1, PRIME)``.
    """

    __slots__ = ("material", "low", "high", "point", "_device")

    def __init__(self, material: bytes):
        raw = hashlib.shake_256(b"xreshard-digest-v1|" + material).digest(
            LANES * BLOCK_WORDS * 4 + 32)
        words = np.frombuffer(raw, "<u4", LANES * BLOCK_WORDS).reshape(LANES, 2, _HALF)
        self.material = material
        self.low = np.ascontiguousarray(words[:, 0]).astype(np.uint32)
        self.high = np.ascontiguousarray(words[:, 1]).astype(np.uint32)
        self.point = int.from_bytes(raw[-32:], "little") % (PRIME - 1) + 1
        self._device: dict[Any, Any] = {}       # (library, device) -> key words there

    @staticmethod
    def of(*parts: Any) -> Key:
        """The key derived from JSON-able ``parts`` (cached): every process that passes the
        same parts gets the same key (``Key.of("verify", world_nonce, version)``)."""
        material = json.dumps(parts, separators=(",", ":"), sort_keys=True).encode()
        with _LOCK:
            key = _KEYS.get(material)
            if key is None:
                if len(_KEYS) >= 64:
                    _KEYS.pop(next(iter(_KEYS)))
                key = _KEYS[material] = Key(material)
        return key

    def on_device(self, library: str, device: Any, make: Any) -> Any:
        """``make(low, high)`` on a device, made once per (library, device)."""
        have = self._device.get((library, device))
        if have is None:
            have = self._device[(library, device)] = make(self.low, self.high)
        return have

    def __repr__(self) -> str:
        return f"Key({hashlib.sha256(self.material).hexdigest()[:12]})"


_LOCK = threading.Lock()
_KEYS: dict[bytes, Key] = {}
_PROCESS_KEY: list[Key] = []


def process_key() -> Key:
    """This process's key, drawn at random on first use: for digests compared only inside
    this process (delta fences, ``check_writes``), never sent to another one."""
    with _LOCK:
        if not _PROCESS_KEY:
            _PROCESS_KEY.append(Key(b"process|" + secrets.token_bytes(32)))
        return _PROCESS_KEY[0]


# ---------------------------------------------------------------------------- host (numpy)


def _full_blocks(words: np.ndarray, key: Key, out: np.ndarray) -> None:
    """NH of every row of ``words`` (``(n, BLOCK_WORDS)`` uint32) into ``out[:, lane]``."""
    n = words.shape[0]
    tile = min(_TILE_BLOCKS, n)
    a = np.empty((tile, _HALF), np.uint32)
    b = np.empty((tile, _HALF), np.uint32)
    prod = np.empty((tile, _HALF), np.uint64)
    for i in range(0, n, tile):
        part = words[i:i + tile]
        m = part.shape[0]
        for lane in range(LANES):
            np.add(part[:, :_HALF], key.low[lane], out=a[:m])
            np.add(part[:, _HALF:], key.high[lane], out=b[:m])
            np.multiply(a[:m], b[:m], out=prod[:m], dtype=np.uint64)
            np.add.reduce(prod[:m], axis=1, out=out[i:i + m, lane])


def _tail_block(data: bytes | bytearray | np.ndarray, key: Key) -> list[int]:
    """NH per lane of a last, shorter block (``< BLOCK_WORDS`` words of bytes ``data``):
    zero-padded to ``2h`` words, keyed with the first ``h`` key words of each half."""
    raw = np.frombuffer(bytes(data), np.uint8)
    h = -(-raw.size // 8)
    words = np.zeros(2 * h, np.uint32)
    words.view(np.uint8)[:raw.size] = raw
    out = []
    with np.errstate(over="ignore"):
        for lane in range(LANES):
            a = (words[:h] + key.low[lane, :h]).astype(np.uint64)
            b = (words[h:] + key.high[lane, :h]).astype(np.uint64)
            out.append(int(np.add.reduce(a * b, dtype=np.uint64)))
    return out


def finish(values: Iterable[int], nbytes: int, key: Key) -> str:
    """The digest (32 hex digits) of the block values (``LANES`` per block, in order, each
    taken mod 2**64) of ``nbytes`` bytes: the polynomial at the key's point."""
    r, h = key.point, 0
    for v in values:
        h = (h * r + (int(v) & _M64)) % PRIME
    h = (h * r + nbytes) % PRIME
    return f"{h:032x}"


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    with _LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(_THREADS, thread_name_prefix="xreshard-digest"))
        return _POOL[0]


class Hasher:
    """The digest of a byte stream fed in pieces (host memory)."""

    __slots__ = ("_key", "_values", "_carry", "_nbytes")

    def __init__(self, key: Key | None = None) -> None:
        self._key = key or process_key()
        self._values: list[np.ndarray] = []         # (n, LANES) uint64 per run of blocks
        self._carry = bytearray()                   # bytes of a block not yet full
        self._nbytes = 0

    def update(self, data: np.ndarray) -> None:
        """Feed ``data``: a C-contiguous uint8 array."""
        n = data.size
        if n == 0:
            return
        self._nbytes += n
        start = 0
        if self._carry:
            take = min(_BLOCK_BYTES - len(self._carry), n)
            self._carry += data[:take].tobytes()
            start = take
            if len(self._carry) < _BLOCK_BYTES:
                return
            self._blocks(np.frombuffer(bytes(self._carry), np.uint8))
            self._carry = bytearray()
        full = (n - start) // _BLOCK_BYTES
        if full:
            self._blocks(data[start:start + full * _BLOCK_BYTES])
        rest = data[start + full * _BLOCK_BYTES:]
        if rest.size:
            self._carry += rest.tobytes()

    def _blocks(self, data: np.ndarray) -> None:
        if data.ctypes.data % 4:
            data = data.copy()              # 32-bit words need 4-byte alignment
        words = data.view("<u4").reshape(-1, BLOCK_WORDS)
        out = np.empty((words.shape[0], LANES), np.uint64)
        n = words.shape[0]
        if n >= _PARALLEL_BLOCKS and _THREADS > 1:
            step = -(-n // _THREADS)
            runs = [(words[i:i + step], out[i:i + step]) for i in range(0, n, step)]
            for f in [_pool().submit(_full_blocks, w, self._key, o) for w, o in runs]:
                f.result()
        else:
            _full_blocks(words, self._key, out)
        self._values.append(out)

    def hexdigest(self) -> str:
        values: list[int] = []
        for run in self._values:
            values.extend(run.reshape(-1).tolist())
        if self._carry:
            values.extend(_tail_block(self._carry, self._key))
        return finish(values, self._nbytes, self._key)


def stream_hex(pieces: Iterable[np.ndarray], key: Key | None = None) -> tuple[str, int]:
    """The digest of C-contiguous uint8 ``pieces`` in order, and their byte count."""
    h, n = Hasher(key), 0
    for piece in pieces:
        h.update(piece)
        n += piece.size
    return h.hexdigest(), n


def checksum(data: np.ndarray, key: Key | None = None) -> str:
    """The digest of a C-contiguous uint8 array (``key``: :func:`process_key`)."""
    h = Hasher(key)
    h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------- CuPy


def device_digests(arrays: Sequence[Any], key: Key | None = None) -> list[str]:
    """Digests of CuPy arrays' bytes in row-major order, one host sync for all.

    Strided arrays are made contiguous as same-size unsigned ints (CuPy copies any dtype
    that way; its kernels refuse float8, and bf16 without ml_dtypes). The same uint32 adds,
    widening multiplies and uint64 sums as the host path, so the same digests.
    """
    import cupy

    from ..dtypes import bits

    key = key or process_key()
    values, sizes = [], []
    for arr in arrays:
        with cupy.cuda.Device(arr.device.id):    # allocations and kernels on its device
            values.append(_device_values(cupy, bits(arr), key))
        sizes.append(int(arr.nbytes))
    if not values:
        return []
    counts = [int(v.size) for v in values]
    host = np.concatenate([v.get() for v in values]).tolist()
    out, at = [], 0
    for c, n in zip(counts, sizes):
        out.append(finish(host[at:at + c], n, key))
        at += c
    return out


def _device_values(cupy: Any, arr: Any, key: Key) -> Any:
    """The block values (``LANES`` per block, uint64, in order) of a CuPy array's bytes,
    computed on its device: the host path's formula (:func:`_full_blocks`,
    :func:`_tail_block`) with CuPy's identical uint32 and uint64 arithmetic."""
    low, high = key.on_device("cupy", arr.device.id,
                              lambda lo, hi: (cupy.asarray(lo), cupy.asarray(hi)))
    flat = cupy.ascontiguousarray(arr).reshape(-1).view(cupy.uint8)
    n = int(flat.size)
    full, tail = divmod(n, _BLOCK_BYTES)
    h = -(-tail // 8)
    padded_bytes = full * _BLOCK_BYTES + 8 * h
    if padded_bytes != n or int(flat.data.ptr) % 4:
        padded = cupy.zeros(padded_bytes, cupy.uint8)
        padded[:n] = flat
        flat = padded
    words = flat.view(cupy.uint32)
    parts = []
    if full:
        blocks = words[:full * BLOCK_WORDS].reshape(full, BLOCK_WORDS)
        lanes = [cupy.multiply(blocks[:, :_HALF] + low[lane], blocks[:, _HALF:] + high[lane],
                               dtype=cupy.uint64).sum(axis=1, dtype=cupy.uint64)
                 for lane in range(LANES)]
        parts.append(cupy.stack(lanes, axis=1).reshape(-1))
    if tail:
        last = words[full * BLOCK_WORDS:]
        parts.append(cupy.concatenate([
            cupy.multiply(last[:h] + low[lane, :h], last[h:] + high[lane, :h],
                          dtype=cupy.uint64).sum(dtype=cupy.uint64).reshape(1)
            for lane in range(LANES)]))
    return cupy.concatenate(parts) if parts else cupy.zeros(0, cupy.uint64)
