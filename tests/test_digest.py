"""The digest every integrity check compares (xreshard.runtime.digest): it computes exactly
the keyed hash its docstring defines (a pure-Python model of the definition, the one the
bound is proved for), it changes under every structured change class the old checksum
missed, on every dtype xreshard moves, and numpy, CuPy (fake) and torch give one digest.

The old checksum (xr64x2, weighted sums mod 2**64) failed the first of these: adding
2**63 to two words adds nothing, so ``checksum(a) == checksum(-a)`` for float64 ``a``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xreshard.dtypes import ITEMSIZE, numpy_dtype
from xreshard.runtime import digest, verify
from xreshard.runtime.digest import BLOCK_WORDS, LANES, PRIME, Key

KEYS = [Key.of("test_digest", i) for i in range(3)]
M32, M64 = (1 << 32) - 1, (1 << 64) - 1


def model(data: bytes, key: Key) -> str:
    """The digest as the module docstring defines it, in Python ints: NH per block of
    ``BLOCK_WORDS`` 32-bit little-endian words (the last block ``2h`` words, zero-padded),
    ``LANES`` lanes, then Horner at the key's point mod 2**127 - 1, the length last."""
    coefficients = []
    block = BLOCK_WORDS * 4
    for at in range(0, len(data), block):
        chunk = data[at:at + block]
        h = BLOCK_WORDS // 2 if len(chunk) == block else -(-len(chunk) // 8)
        chunk = chunk + b"\0" * (8 * h - len(chunk))
        words = [int.from_bytes(chunk[4 * i:4 * i + 4], "little") for i in range(2 * h)]
        for lane in range(LANES):
            low, high = key.low[lane].tolist(), key.high[lane].tolist()
            coefficients.append(sum(((words[j] + low[j]) & M32) * ((words[h + j] + high[j]) & M32)
                                    for j in range(h)) & M64)
    acc = 0
    for c in coefficients + [len(data)]:
        acc = (acc * key.point + c) % PRIME
    return f"{acc:032x}"


@pytest.mark.parametrize("size", [0, 1, 3, 4, 7, 8, 9, 4 * BLOCK_WORDS - 1, 4 * BLOCK_WORDS,
                                  4 * BLOCK_WORDS + 5, 3 * 4 * BLOCK_WORDS + 100])
def test_the_digest_is_the_documented_hash(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    for key in KEYS[:2]:
        assert digest.checksum(data, key) == model(data.tobytes(), key)


def test_fed_in_pieces_and_over_threads_it_is_the_same_digest(monkeypatch):
    data = np.random.default_rng(1).integers(0, 256, 40 * 4 * BLOCK_WORDS + 77, np.uint8)
    key = KEYS[0]
    whole = digest.checksum(data, key)
    cuts = [0, 1, 4 * BLOCK_WORDS - 3, 4 * BLOCK_WORDS * 7 + 11, data.size]
    assert digest.stream_hex([data[a:b] for a, b in zip(cuts, cuts[1:])], key)[0] == whole
    monkeypatch.setattr(digest, "_PARALLEL_BLOCKS", 2)
    monkeypatch.setattr(digest, "_THREADS", 3)
    assert digest.checksum(data, key) == whole
    assert digest.checksum(data[1:], key) != whole       # unaligned: copied, another input


def test_keys_are_derived_alike_and_differ_per_call():
    a, b = Key.of("verify", "w", "nonce", 3), Key.of("verify", "w", "nonce", 4)
    assert a is Key.of("verify", "w", "nonce", 3)               # cached, same material
    assert a.point != b.point and not np.array_equal(a.low, b.low)
    assert digest.process_key() is digest.process_key()
    x = np.arange(1000, dtype=np.uint8)
    assert digest.checksum(x, a) != digest.checksum(x, b)


# ---------------------------------------------------------------------------- change classes


def _values(dtype: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
    v = rng.standard_normal(n).astype(np.float32)
    if dtype == "float8_e8m0fnu":
        v = np.abs(v) + 0.5
    return v.astype(dt)


def _flip(raw: np.ndarray, bit: int) -> np.ndarray:
    out = raw.copy()
    out[bit // 8] ^= np.uint8(1 << (bit % 8))
    return out


def _changes(x: np.ndarray) -> dict[str, np.ndarray]:
    """Every structured change class, as new bytes of ``x`` (those that change them)."""
    raw = x.view(np.uint8).reshape(-1)
    item = x.dtype.itemsize
    top = 8 * item - 1                         # the sign bit of an element (little-endian)
    out: dict[str, np.ndarray] = {}
    sign = raw.copy()
    sign.reshape(-1, item)[:, -1] ^= 0x80       # every element's top bit: negation
    out["negate every element"] = sign
    odd = raw.copy()
    odd.reshape(-1, item)[1::2, -1] ^= 0x80
    out["negate every odd element"] = odd
    for i, j in [(0, 1), (3, 700), (5, raw.size // item - 1)]:
        two = _flip(_flip(raw, i * 8 * item + top), j * 8 * item + top)
        out[f"sign of elements {i} and {j}"] = two
    if item >= 8:       # bit 63 of two 64-bit words: the old checksum's blind spot
        out["bit 63 of words 0 and 1"] = _flip(_flip(raw, 63), 127)
    words = raw[: raw.size // 4 * 4].view("<u4").copy()
    for i, j in [(0, 1), (2, 9), (0, words.size - 1)]:
        if words[i] != words[j]:
            sw = words.copy()
            sw[[i, j]] = sw[[j, i]]
            out[f"32-bit words {i} and {j} swapped"] = np.concatenate(
                [sw.view(np.uint8), raw[words.size * 4:]])
    elems = raw.reshape(-1, item)
    if not np.array_equal(elems[0], elems[1]):
        sw = elems.copy()
        sw[[0, 1]] = sw[[1, 0]]
        out["elements 0 and 1 swapped"] = sw.reshape(-1)
    for at, size in [(0, 4 * BLOCK_WORDS), (raw.size // 3, 512), (raw.size - 64, 64)]:
        z = raw.copy()
        z[at:at + size] = 0
        out[f"bytes {at}..{at + size} zeroed"] = z
    for bit in (0, 7, top, 8 * raw.size - 1):
        out[f"bit {bit} flipped"] = _flip(raw, bit)
    return {k: v for k, v in out.items() if not np.array_equal(v, raw)}


@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_every_structured_change_changes_the_digest_on_every_dtype(dtype):
    n = 3 * BLOCK_WORDS + 123       # several blocks and a ragged last one
    x = _values(dtype, n, seed=len(dtype))
    changes = _changes(x)
    assert len(changes) >= 8, sorted(changes)
    for key in KEYS:
        base = digest.checksum(x.view(np.uint8).reshape(-1), key)
        for what, changed in changes.items():
            assert digest.checksum(changed, key) != base, (dtype, what)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "complex64"])
def test_negated_and_conjugated_tensors_differ_through_verify_checksum(dtype):
    a = _values(dtype, 1024, 0).reshape(32, 32)
    assert verify.checksum(a) != verify.checksum(-a)
    assert verify.checksum(a.T) != verify.checksum((-a).T)      # strided: copied, same rule
    if dtype == "complex64":
        assert verify.checksum(a) != verify.checksum(np.conj(a))
    odd = a.copy()
    odd[:, 1::2] *= -1
    assert verify.checksum(a) != verify.checksum(odd)


@given(st.binary(min_size=1, max_size=9000), st.data())
@settings(max_examples=100, deadline=None)
def test_any_single_byte_change_or_swap_changes_it(data, draw):
    a = np.frombuffer(data, np.uint8).copy()
    i = draw.draw(st.integers(0, a.size - 1))
    j = draw.draw(st.integers(0, a.size - 1))
    b = a.copy()
    b[i] ^= np.uint8(draw.draw(st.integers(1, 255)))
    assert digest.checksum(a, KEYS[0]) != digest.checksum(b, KEYS[0])
    if a[i] != a[j]:
        c = a.copy()
        c[[i, j]] = c[[j, i]]
        assert digest.checksum(a, KEYS[0]) != digest.checksum(c, KEYS[0])


# ---------------------------------------------------------------------------- other devices


@pytest.mark.parametrize("size", [0, 5, 4 * BLOCK_WORDS, 4 * BLOCK_WORDS * 2 + 13])
def test_cupy_path_gives_the_host_digest(monkeypatch, size):
    from tests import fake_cupy
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake_cupy.module())
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    on_device = fake_cupy.on_device(data, 1)
    assert digest.device_digests([on_device], KEYS[1]) == [digest.checksum(data, KEYS[1])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64", "int8"])
def test_torch_path_gives_the_host_digest(dtype):
    torch = pytest.importorskip("torch")
    from xreshard.adapters import torch_writes
    from xreshard.adapters.torch import tensor_view
    t = torch.from_numpy(_values("float32", 3 * BLOCK_WORDS + 7, 2)).to(getattr(torch, dtype))
    assert torch_writes.checksum(t) == verify.checksum(tensor_view(t))
    assert torch_writes.checksum(-t) != torch_writes.checksum(t)
    m = t[: 3 * BLOCK_WORDS].reshape(-1, 64).T      # strided: made contiguous first
    assert torch_writes.checksum(m) == verify.checksum(tensor_view(m.contiguous()))
