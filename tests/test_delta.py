"""Delta kernels (xreshard.delta): bit-exact round trips, the same bytes from numpy, JAX
and torch, and a receiver that refuses any malformed or truncated message untouched.

Arrays are made from random bits (so NaN payloads, -0.0/+0.0, denormals and every fp8
code occur), changed by replacing bits (a change is any bit difference, never a value
difference), in patterns that include none, all, and runs at both edges.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from xreshard import delta
from xreshard.delta import codec, host
from xreshard.dtypes import numpy_dtype

DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
          "int16", "int32", "int64", "float64", "complex64", "complex128", "bool"]
#: what JAX holds without jax_enable_x64 (the kernels work on its uint32 words)
JAX_DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8",
              "uint8", "int16", "int32", "bool"]
PATTERNS = ["none", "all", "random", "prefix", "suffix", "edges", "first", "last", "blocks"]
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
#: the JAX and torch kernels compile or dispatch per shape: fewer, still every dtype
DEVICE_SETTINGS = settings(SETTINGS, max_examples=50)


def _bits(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    dt = numpy_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(np.uint8).view(bool)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt)


def _mask(pattern: str, n: int, rng: np.random.Generator) -> np.ndarray:
    m = np.zeros(n, bool)
    k = int(rng.integers(1, max(2, n // 3 + 1)))
    if pattern == "all":
        m[:] = True
    elif pattern == "random":
        m = rng.random(n) < rng.choice([0.001, 0.01, 0.3, 0.9])
    elif pattern == "prefix":
        m[:k] = True
    elif pattern == "suffix":
        m[n - k:] = True
    elif pattern == "edges":
        m[:k] = m[n - k:] = True
    elif pattern == "first":
        m[:1] = True
    elif pattern == "last":
        m[n - 1:] = True
    elif pattern == "blocks":
        for s in rng.integers(0, max(n, 1), 4):
            m[s:s + int(rng.integers(1, 9))] = True
    return m


def _pair(dtype: str, n: int, pattern: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(old, new, changed): new differs from old in exactly the changed elements' bits."""
    rng = np.random.default_rng(seed)
    old = _bits(dtype, n, rng)
    mask = _mask(pattern, n, rng)
    new = old.copy()
    if dtype == "bool":
        new[mask] = ~old[mask]
    else:
        words = new.view(np.uint8).reshape(n, old.dtype.itemsize)
        flip = rng.integers(0, 256, words.shape, dtype=np.uint8)
        flip[:, -1] |= 0x80             # the top bit too: -0.0 vs +0.0, NaN sign and payload
        words[mask] ^= flip[mask]
    return old, new, mask


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), pattern=st.sampled_from(PATTERNS),
       seed=st.integers(0, 2**31), chunk=st.sampled_from([8, 16, 40, host.CHUNK]))
def test_numpy_round_trip_is_bit_exact_idempotent_and_smallest(dtype, n, pattern, seed, chunk):
    old, new, mask = _pair(dtype, n, pattern, seed)
    saved, host.CHUNK = host.CHUNK, chunk       # runs and values across chunk boundaries
    try:
        msg = delta.encode(old, new)
    finally:
        host.CHUNK = saved
    buf = msg.to_bytes()
    assert buf.size == msg.nbytes
    target = old.copy()
    delta.apply(buf, target)
    assert _same_bits(target, new)
    delta.apply(buf, target)                    # again: overwrite, not XOR
    assert _same_bits(target, new)
    count, isz = int(mask.sum()), old.dtype.itemsize
    runs = int(np.count_nonzero(np.diff(np.concatenate(([0], mask.view(np.int8)))) == 1))
    sizes = codec.payload_sizes(n, count, runs, isz)
    assert msg.nbytes == codec.HEADER_BYTES + min(sizes.values())
    assert msg.nbytes <= codec.HEADER_BYTES + n * isz      # never more than dense
    if msg.kind != "dense":
        assert msg.header.count == count


@SETTINGS
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 300), pattern=st.sampled_from(PATTERNS),
       seed=st.integers(0, 2**31), chunk=st.sampled_from([8, 16, 40, host.CHUNK]),
       cuts=st.lists(st.integers(0, 300), max_size=5))
def test_parts_encode_and_apply_as_the_whole_region(dtype, n, pattern, seed, chunk, cuts):
    """A bucket's items read in place (``encode_parts``) give the message of the packed
    bucket, byte for byte, with chunks that straddle parts of any length (so packed mask
    bytes across part boundaries); ``apply_parts`` into the items' own memory writes what
    applying to the packed region writes."""
    old, new, _ = _pair(dtype, n, pattern, seed)
    bounds = [0] + sorted(min(c, n) for c in cuts) + [n]
    o_bits = old.view(f"u{old.dtype.itemsize}") if old.dtype.itemsize <= 8 else old
    w_bits = new.view(o_bits.dtype)
    parts = [w_bits[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    saved, host.CHUNK = host.CHUNK, chunk
    try:
        whole = host.encode_numpy(o_bits, w_bits)
        got = host.encode_parts(o_bits, parts)
    finally:
        host.CHUNK = saved
    if got is None:
        assert whole.kind == "dense"
    else:
        assert got.to_bytes().tobytes() == whole.to_bytes().tobytes()
    target = o_bits.copy()
    host.apply_parts(whole.to_bytes(), [target[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                     old.dtype.itemsize, n)
    assert target.tobytes() == w_bits.tobytes()


def test_apply_parts_validates_everything_before_writing():
    old = np.zeros(64, np.uint16)
    new = old.copy()
    new[[3, 40]] = 1
    msg = host.encode_numpy(old, new).to_bytes()
    parts = [old[:10].copy(), old[10:].copy()]
    with pytest.raises(delta.DeltaFormatError):
        host.apply_parts(msg[:-2], parts, 2, 64)           # truncated: nothing written
    assert not any(p.any() for p in parts)
    with pytest.raises(ValueError, match="the parts hold 63 elements"):
        host.apply_parts(msg, [parts[0], parts[1][:-1]], 2, 64)
    assert not any(p.any() for p in parts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_minus_zero_and_nan_payloads_are_changes(dtype):
    dt = numpy_dtype(dtype)
    bits = np.dtype(f"u{dt.itemsize}")
    old = np.array([0.0, np.nan, 1.0], dt)
    new = old.copy()
    nb = new.view(bits)
    nb[0] ^= bits.type(1) << bits.type(8 * dt.itemsize - 1)    # +0.0 -> -0.0: equal values
    nb[1] ^= bits.type(1)                                        # another NaN payload
    msg = delta.encode(old, new)
    assert msg.kind != "dense" or msg.header.count == 3
    target = old.copy()
    delta.apply(msg.to_bytes(), target)
    assert _same_bits(target, new) and not _same_bits(target, old)


@DEVICE_SETTINGS
@given(dtype=st.sampled_from(DTYPES), n=st.sampled_from([0, 1, 7, 8, 9, 64, 255]),
       pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2**31))
def test_torch_encodes_the_same_bytes_and_applies_alike(dtype, n, pattern, seed):
    torch = pytest.importorskip("torch")
    old, new, _ = _pair(dtype, n, pattern, seed)
    want = delta.encode(old, new).to_bytes()
    as_torch = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
                "float8_e5m2": torch.float8_e5m2}

    def t(a: np.ndarray):
        if a.size == 0:     # torch.from_numpy of an empty array has stride 0: no views
            return torch.empty(0, dtype=as_torch.get(dtype) or getattr(torch, dtype))
        if dtype in as_torch:
            return torch.from_numpy(a.view(np.uint8).copy()).view(as_torch[dtype])
        return torch.from_numpy(a.copy())
    for kernels in ("device", "auto"):      # torch ops; the host kernels on a CPU view
        got = delta.encode(t(old), t(new), kernels=kernels)
        assert got.to_bytes().tobytes() == want.tobytes(), kernels
    target = t(old)
    delta.apply(want, target, kernels="device")
    delta.apply(want, target)
    assert n == 0 or target.view(torch.uint8).numpy().tobytes() == new.tobytes()


@settings(DEVICE_SETTINGS, max_examples=30)    # XLA compiles per shape
@given(dtype=st.sampled_from(JAX_DTYPES), n=st.sampled_from([0, 1, 9, 255]),
       pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2**31))
def test_jax_encodes_the_same_bytes_and_applies_alike(dtype, n, pattern, seed):
    jax = pytest.importorskip("jax")
    old, new, _ = _pair(dtype, n, pattern, seed)
    want = delta.encode(old, new).to_bytes()
    for kernels in ("device", "auto"):      # jitted XLA; the host kernels on a CPU view
        got = delta.encode(jax.numpy.asarray(old), jax.numpy.asarray(new), kernels=kernels)
        assert got.to_bytes().tobytes() == want.tobytes(), kernels
    out = delta.apply(want, jax.numpy.asarray(old), kernels="device")
    out = delta.apply(want, out)
    assert np.asarray(out).tobytes() == new.tobytes()


def test_jax_kernels_run_per_shard_on_each_device():
    """A rank's bucket is one device's buffer: each addressable shard of a sharded array
    encodes on its own device to the bytes numpy gives for that shard, and applies there."""
    jax = pytest.importorskip("jax")
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = jax.devices()[:2]
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    sharding = NamedSharding(mesh, P("x"))
    old, new, _ = _pair("bfloat16", 64 * len(devices), "random", 3)
    a, b = jax.device_put(old, sharding), jax.device_put(new, sharding)
    with pytest.raises(ValueError, match="encode each addressable shard"):
        delta.encode(a, b, kernels="device")
    for sa, sb in zip(a.addressable_shards, b.addressable_shards):
        msg = delta.encode(sa.data, sb.data, kernels="device")
        host = delta.encode(np.asarray(sa.data), np.asarray(sb.data)).to_bytes()
        assert msg.to_bytes().tobytes() == host.tobytes()
        out = delta.apply(host, sa.data, kernels="device")
        assert out.devices() == {sa.device}
        assert np.asarray(out).tobytes() == np.asarray(sb.data).tobytes()


# ---------------------------------------------------------------------------- refusals

def _corruptions(buf: np.ndarray, kind: int, n: int) -> list[tuple[str, np.ndarray]]:
    out = []
    for cut in sorted({0, 1, 31, 32, buf.size // 2, buf.size - 1}):
        if cut < buf.size:
            out.append((f"truncated to {cut}", buf[:cut].copy()))
    out.append(("one byte too many", np.concatenate([buf, np.zeros(1, np.uint8)])))
    for offset, value, what in [(0, ord("Y"), "magic"), (4, 9, "version"), (5, 7, "kind"),
                                (6, 3, "itemsize"), (7, 2, "width"), (8, 0xFF, "n"),
                                (16, 0xFF, "count"), (24, 0xFF, "nruns")]:
        bad = buf.copy()
        bad[offset] ^= value
        out.append((what, bad))
    if kind == codec.RUNS and buf.size > 40:
        bad = buf.copy()                         # first start past the region
        bad[32:36] = np.frombuffer(np.uint32(n + 5).tobytes(), np.uint8)
        out.append(("run start out of range", bad))
        bad = buf.copy()                         # first length zero
        nruns = int(np.frombuffer(buf[24:32].tobytes(), "<u8")[0])
        at = 32 + 4 * nruns
        bad[at:at + 4] = 0
        out.append(("run of length zero", bad))
        if nruns > 1:                            # two runs swapped: out of order
            bad = buf.copy()
            bad[32:36], bad[36:40] = buf[36:40].copy(), buf[32:36].copy()
            out.append(("runs out of order", bad))
    if kind == codec.BITMASK:
        bad = buf.copy()
        bad[32] ^= 1                             # popcount no longer count
        out.append(("mask bit flipped", bad))
        if n % 8:
            bad = buf.copy()
            bad[32 + (n + 7) // 8 - 1] |= 0x80   # a bit past the last element
            out.append(("mask bit past n", bad))
    return out


@settings(SETTINGS, max_examples=60)
@given(dtype=st.sampled_from(["float32", "bfloat16", "float8_e4m3fn", "complex128"]),
       n=st.integers(1, 200), pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2**31))
def test_malformed_or_truncated_messages_are_refused_and_nothing_is_written(dtype, n, pattern,
                                                                            seed):
    old, new, _ = _pair(dtype, n, pattern, seed)
    msg = delta.encode(old, new)
    buf = msg.to_bytes()
    for what, bad in _corruptions(buf, msg.header.kind, n):
        target = old.copy()
        try:
            delta.apply(bad, target)
        except delta.DeltaFormatError as e:
            assert "nothing written" in str(e)
            assert _same_bits(target, old), what
            continue
        pytest.fail(f"{what}: accepted")


def test_a_message_for_another_region_is_refused():
    old, new, _ = _pair("float32", 100, "random", 1)
    buf = delta.encode(old, new).to_bytes()
    for target in (np.zeros(99, np.float32), np.zeros(100, np.float16)):
        with pytest.raises(delta.DeltaFormatError, match="the region has"):
            delta.apply(buf, target)


def test_import_loads_neither_jax_nor_torch():
    import subprocess
    import sys
    code = ("import sys, xreshard.delta as d; import numpy as np; "
            "d.apply(d.encode(np.zeros(4), np.ones(4)).to_bytes(), np.zeros(4)); "
            "print('jax' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_delta_composes_with_relay_atomic_and_casts_on_both_kinds_of_bindings(monkeypatch):
    """``delta_problems`` at ``refit/check``: host and device bindings (or the device path
    on the host, as the tests run it) compose delta with relay, ``atomic`` and casts,
    together too (FP8 destinations: tests/test_device_path.py); device bindings are refused
    by name, on both sides, where no framework can run the device ops."""
    import xreshard as xr
    from xreshard.config import Tuning
    from xreshard.runtime import device_ops
    from xreshard.runtime.delta_wire import delta_problems

    def refused(config, on_device, tuning=Tuning()):
        return [m for _, m in delta_problems(config, on_device, tuning=tuning)]

    relay = "auto"
    for config in (xr.RefitConfig(delta=True, atomic=True),
                   xr.RefitConfig(delta=True, relay=relay),
                   xr.RefitConfig(delta=True, relay=relay, atomic=True),
                   xr.RefitConfig(delta=True, wire_dtype="bfloat16")):
        assert refused(config, False) == []        # host bindings compose
        assert refused(config, True) == []         # and so do device bindings
    # the device path, run on the host
    assert refused(xr.RefitConfig(delta=True, relay=relay, atomic=True), False,
                   Tuning(host_device_ops="torch")) == []
    # ... unless no framework can run the device ops
    monkeypatch.setattr(device_ops, "_available", lambda kind: False)
    found = refused(xr.RefitConfig(delta=True, relay=relay), True)
    assert len(found) == 2 and all("neither is installed" in m for m in found), found


def test_split_block_pieces_kept_under_the_fence():
    """The bf16 pieces of split FP8 blocks a receiver kept become the base of the next
    delta only when the outcome confirmed their call; a failed call drops them with the
    claims; a delta without them raises (never applied to a wrong base)."""
    from types import SimpleNamespace

    from xreshard.errors import RefitError
    from xreshard.runtime.delta_wire import DeltaState

    state = DeltaState()
    b = SimpleNamespace(src=0, dst=1, tag=7)
    call = state.begin([state.claims(None, None)[0]], SimpleNamespace(
        schedule=SimpleNamespace(rounds=[]), stages=[]))
    call.local_dst.add(1)
    call.keep_pieces(b, np.arange(4, dtype=np.uint8))
    with pytest.raises(RefitError, match="holds no base of its split FP8 blocks' pieces"):
        call.pieces_base(b, 4)          # not confirmed yet
    state.commit(call, None, None)
    again = state.begin([state.claims(None, None)[0]], SimpleNamespace(
        schedule=SimpleNamespace(rounds=[]), stages=[]))
    held = again.pieces_base(b, 4)
    assert held.tobytes() == bytes(range(4))
    held[0] = 9                         # a copy: the kept base is not written
    assert again.pieces_base(b, 4)[0] == 0
    with pytest.raises(RefitError):
        again.pieces_base(b, 5)         # another size: not this bucket's base
    state.abort()                       # not atomic: every claim and piece goes
    assert state.pieces == {}
