"""Issue 33 (the third review of the GPU paths, shared/reference/gpu_review.md), on CPU:
each point tested with the smallest fake of the CUDA or NCCL rule it breaks. The GPU runs
of the same paths are scripts/gpu_check.sh's probes (``a1_shrink``, ``a3_fp8_stage``,
``b1_slow_producer``, ``b2_split_blocks``)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from xreshard.runtime import comm_epochs, world_links
from xreshard.runtime.comm_epochs import Abilities

from . import fake_cupy


# ---------------------------------------------------------------------------- A4

class _Parked:
    usable = True

    def close(self):
        pass


class _World:
    """The few members ``EpochLinks.nccl_epoch`` reads of its world, over a world of 3
    processes (one rank each) whose process c died; the other process's NCCL is
    ``theirs``."""

    def __init__(self, theirs):
        self.theirs = theirs
        self.num_ranks = 2
        self.rank_ids = (0,)
        self._store = None
        self.world_id = "w"

    def allgather_json(self, payload, timeout, kind):
        other = {**payload, "can": self.theirs} if "can" in payload else dict(payload)
        return [payload, other]

    def _wait_seconds(self):
        return 5.0


def _links(theirs):
    links = world_links.EpochLinks(_World(theirs))
    links.parked_nccl = (_Parked(), ("a/0", "b/0", "c/0"))
    links.rank_members = lambda ranks: tuple(("a/0", "b/0")[r] for r in ranks)
    return links


@pytest.mark.parametrize("theirs, action", [
    ({"shrink": True, "grow": True, "split": True}, "shrink"),
    ({"shrink": False, "grow": False, "split": True}, "recreate"),   # an NCCL < 2.27 there
])
def test_nccl_epoch_abilities_are_agreed_over_the_processes(monkeypatch, theirs, action):
    """A4: this process's NCCL can shrink, the other's cannot: both must take the same step
    (recreate), not shrink here while the other makes a fresh communicator."""
    from xreshard.transport import nccl as nccl_module
    from xreshard.transport import routed
    monkeypatch.setattr(world_links, "_nccl_abilities",
                        lambda: Abilities(shrink=True, grow=True, split=True, name="nccl"))
    seen = []
    real = comm_epochs.decide

    def decide(*args):
        step = real(*args)
        seen.append(step.action)
        return step
    monkeypatch.setattr(comm_epochs, "decide", decide)
    monkeypatch.setattr(world_links, "_resize", lambda *a: "resized")
    monkeypatch.setattr(nccl_module, "NcclTransport", lambda *a, **k: "made")
    monkeypatch.setattr(routed, "RenumberedTransport", lambda inner, index, kind: inner)
    got = _links(theirs).nccl_epoch("w/e1", (0, 1), {0: 0})
    assert seen == [action]
    assert got == ("resized" if action == "shrink" else "made")


def test_common_abilities_count_a_missing_answer_as_unable():
    mine = Abilities(shrink=True, grow=True, split=True, name="nccl")
    got = world_links._common_abilities(mine, [{"shrink": True, "grow": True, "split": True},
                                               None, ])
    assert (got.shrink, got.grow, got.split, got.name) == (False, False, False, "nccl")
    got = world_links._common_abilities(mine, [{"shrink": True, "grow": False, "split": True}])
    assert (got.shrink, got.grow, got.split) == (True, False, True)


# ---------------------------------------------------------------------------- A3

class _Dev:
    """A device of the fake below: a context manager (allocations land on the current
    device), synchronizable, hashable by id."""

    current = [0]

    def __init__(self, i):
        self.id = i

    def __enter__(self):
        self.current.append(self.id)
        return self

    def __exit__(self, *exc):
        self.current.pop()

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _Dev) and other.id == self.id

    def __hash__(self):
        return self.id


def _supported(dtype):
    """CuPy 14 ``_dtype.pyx`` ``check_supported_dtype``: only dtypes with a C type name
    (no float8; ml_dtypes' types are kind "V") can be allocated or run through a kernel."""
    if np.dtype(dtype).kind not in "biufc?":
        raise ValueError(f"Unsupported dtype {np.dtype(dtype)}")


class _CupyArray:
    """A CuPy array (not a numpy one): views of any dtype, but allocation and elementwise
    copies only of supported ones."""

    def __init__(self, a, device=0):
        self._a, self.device = a, _Dev(device)

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    nbytes = property(lambda self: self._a.nbytes)

    def view(self, dtype):
        return _CupyArray(self._a.view(dtype), self.device.id)

    def __setitem__(self, key, value):
        _supported(self.dtype)
        _supported(value.dtype)
        self._a[key] = value._a


def _empty(shape, dtype):
    _supported(dtype)
    return _CupyArray(np.zeros(shape, dtype), _Dev.current[-1])


def test_float8_device_bindings_are_staged_as_bits(monkeypatch):
    """A3: ``atomic=True`` (and elastic FP8 engines in reload mode, catch-up snapshots)
    stage float8 CUDA destinations: allocated and copied as unsigned ints, bit-exact."""
    import ml_dtypes

    from xreshard.runtime.atomic import Staging
    from xreshard.runtime.binding import Bound
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=_empty))
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 255, (4, 6), dtype=np.uint8)
    codes[codes == 0x7F] = 0                      # no NaN codes: compare bits anyway
    real = _CupyArray(codes.view(ml_dtypes.float8_e4m3fn).copy(), device=1)
    scales = _CupyArray(rng.standard_normal(3).astype(np.float32), device=1)
    bound = Bound({}, {(0, "w"): real, (0, "w.scale"): scales})
    staging = Staging()
    staged = staging.stage(bound)
    shadow = staged.bindings[(0, "w")]
    assert shadow is not real and shadow.dtype == real.dtype
    assert shadow._a.view(np.uint8).tobytes() == codes.tobytes()
    new = rng.integers(0, 0x70, (4, 6), dtype=np.uint8)
    shadow._a.view(np.uint8)[...] = new
    staging.commit()
    assert real._a.view(np.uint8).tobytes() == new.tobytes()
    again = staging.stage(bound)                  # kept across calls, refreshed
    assert again.bindings[(0, "w")] is shadow and staging.nbytes == 24 + 12


# ---------------------------------------------------------------------------- fakes

class _Gpu(_CupyArray):
    """``_CupyArray`` with what the device ops touch: reshape, slicing, ``data.ptr``."""

    def view(self, dtype):
        return _Gpu(self._a.view(dtype), self.device.id)

    def reshape(self, *shape):
        return _Gpu(self._a.reshape(*shape), self.device.id)

    def __getitem__(self, key):
        return _Gpu(self._a[key], self.device.id)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self._a.ctypes.data)


def _gpu_empty(shape, dtype):
    _supported(dtype)
    return _Gpu(np.zeros(shape, dtype), _Dev.current[-1])


@pytest.fixture
def cupy_streams(monkeypatch):
    """fake_cupy's per-thread devices and streams as ``cupy``, xreshard's own streams
    made afresh there; ids past CuPy's default-stream handles (0, 1, 2)."""
    from xreshard.runtime import devices
    cupy = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(devices, "_OWN_STREAMS", {})
    for _ in range(3):
        fake_cupy.Event()
    return cupy


# ---------------------------------------------------------------------------- B1

def test_device_delta_orders_its_streams_before_the_encoder_starts(monkeypatch, cupy_streams):
    """B1: the encoder's threads pack on xreshard's own stream as soon as the delta
    executor's ``run`` starts them, so that stream must already wait for the bindings'
    producers (the caller's current stream: a JAX step still running)."""
    from xreshard.runtime import devices
    from xreshard.runtime.codecs.delta import DeltaCodec
    from xreshard.runtime.delta_device import DeviceDeltaCodec
    codec = object.__new__(DeviceDeltaCodec)
    ex = types.SimpleNamespace(_devices=lambda: {0: 1, 1: None})
    seen = []
    monkeypatch.setattr(DeltaCodec, "start", lambda self, ex: seen.append(
        [e.recorded_on for e in devices.own_stream(1).waited]))
    with fake_cupy.Device(1):
        producer = cupy_streams.cuda.Stream(non_blocking=True)
        with producer:
            codec.start(ex)
    assert seen == [[producer]]


# ---------------------------------------------------------------------------- A5 / B3

def test_every_step_of_a_delta_group_enters_its_buckets_device():
    """A5/B3: a process with ranks on two GPUs: each bucket's payload pack and post, header
    post, receive post and landing run with its rank's device current (without it CuPy
    refuses the other device's arrays, or with peer access packs on device 0 while NCCL on
    device 1 sends unfilled staging)."""
    import contextlib

    from xreshard.runtime.codecs.delta import DeltaCodec
    from xreshard.runtime.execute import Executor
    dev = {0: 0, 1: 1, 2: 0, 3: 1}
    ex = object.__new__(Executor)
    ex._on = lambda rank: fake_cupy.Device(dev[rank])
    codec = ex.codec = object.__new__(DeltaCodec)
    codec.ex = ex
    seen = []

    def here():
        return fake_cupy._tls.device
    b_prev = types.SimpleNamespace(src=1, dst=2, tag=0)
    b_new = types.SimpleNamespace(src=3, dst=0, tag=1)
    b_in = types.SimpleNamespace(src=0, dst=3, tag=2)
    codec._open = lambda buckets, offsets, stats: (
        [(b_in, "buf", "unpack")], [("buf", b_in)], [(b_prev, None)], list(buckets))

    class Transport:
        group = staticmethod(lambda timeout: contextlib.nullcontext())

        def recv(self, buf, src, dst, tag):
            seen.append(("recv", dst, here()))
    ex.transport, ex.timeout = Transport(), 5.0
    codec._send_payload = lambda b, enc, offsets, stats, send: (
        seen.append(("payload", b.src, here())), (None, None))[1]
    codec._send_header = lambda b, stats, send: seen.append(("header", b.src, here()))
    codec._land = lambda b, buf, how: seen.append(("land", b.dst, here()))
    ex._group(1, [b_new], types.SimpleNamespace(per_round_seconds=[]))
    assert [s[0] for s in seen] == ["recv", "payload", "header", "land"]
    assert all(d == dev[rank] for _, rank, d in seen), seen


# ---------------------------------------------------------------------------- B2

def test_split_block_scratch_is_read_on_the_stream_that_wrote_it(monkeypatch, cupy_streams):
    """B2: the rounds' unpacks wrote the split blocks' scratch on xreshard's own stream
    (non-blocking); ``quantized.finish`` must read it there, not on the caller's."""
    from xreshard.runtime import devices, quantized
    read_on = []

    def ascontiguousarray(a):
        read_on.append((fake_cupy._tls.device, fake_cupy.get_current_stream()))
        return a
    cupy_streams.ascontiguousarray = ascontiguousarray
    monkeypatch.setattr(quantized, "_write", lambda *a: None)
    region = types.SimpleNamespace(starts=(0, 0), stops=(2, 4))
    fmt = types.SimpleNamespace(data_region=lambda blocks, shape: region)
    scratch = types.SimpleNamespace(key=(0, "w#scratch"), blocks=[(0,)], rank=0, name="w",
                                    region=types.SimpleNamespace(starts=(0, 0)))
    quant = types.SimpleNamespace(scratch={"w": [scratch]},
                                  tensors={"w": types.SimpleNamespace(format=fmt, shape=(2, 4))})
    buf = _Gpu(np.zeros((2, 4), np.uint16), device=1)
    quantized.finish(quant, {scratch.key: buf})
    assert read_on == [(1, devices.own_stream(1))]


# ---------------------------------------------------------------------------- A6

def test_jax_device_ops_get_an_aligned_address(monkeypatch):
    """A6: XLA's GPU executables refuse parameters not 16-byte aligned (``CheckAlignment``);
    a bound view that starts mid-row is copied to an aligned buffer first."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from xreshard.runtime.device_ops import DeviceOps
    cupy = types.SimpleNamespace(empty=_gpu_empty,
                                 cuda=types.SimpleNamespace(Device=_Dev))
    monkeypatch.setitem(sys.modules, "cupy", cupy)

    def from_dlpack(x):
        if x.data.ptr % 16:
            raise RuntimeError(f"Address of buffer 0 must be a multiple of 10, but was "
                               f"{x.data.ptr:#x}")
        return jnp.asarray(np.array(x._a))
    monkeypatch.setattr(jax.dlpack, "from_dlpack", from_dlpack)
    base = np.arange(96, dtype=np.uint8)
    start = next(s for s in range(16) if (base.ctypes.data + s) % 16 == 6)
    view = _Gpu(base[start:start + 48], device=0)
    got = DeviceOps("jax").wrap(view)
    assert np.asarray(got).tobytes() == base[start:start + 48].tobytes()


# ---------------------------------------------------------------------------- A7

def test_torch_results_are_imported_on_their_device(monkeypatch, cupy_streams):
    """A7: torch's ``__dlpack__`` exports only from its current device ("Can't export
    tensors on a different CUDA device index"); the encoder and verify threads start on
    device 0, the tensor is on device 1."""
    pytest.importorskip("torch")
    from xreshard.runtime.device_ops import DeviceOps

    class Tensor:
        device = types.SimpleNamespace(index=1)

        def contiguous(self):
            return self

        def reshape(self, *shape):
            return self

        def view(self, dtype):
            return self

    def from_dlpack(t):
        if t.device.index != fake_cupy._tls.device:
            raise BufferError("Can't export tensors on a different CUDA device index")
        return "imported"
    cupy_streams.from_dlpack = from_dlpack
    assert DeviceOps("torch").unwrap(Tensor(), like=object()) == "imported"


# ---------------------------------------------------------------------------- B4

def test_fence_checksums_read_on_the_callers_stream_and_device(monkeypatch, cupy_streams):
    """B4: ``delta_fence.sums_of``'s pool threads read device bindings on the calling
    thread's stream and on the array's device, not on their own legacy stream of device 0."""
    from xreshard.runtime import delta_fence, verify
    monkeypatch.setattr(delta_fence, "_PARALLEL_BYTES", 0)
    seen = []

    def checksum(a):
        seen.append((fake_cupy._tls.device, fake_cupy.get_current_stream()))
        return "x"
    monkeypatch.setattr(verify, "checksum", checksum)
    arrays = {(0, "a"): fake_cupy.on_device(np.zeros(8, np.uint8), 1),
              (0, "b"): fake_cupy.on_device(np.ones(8, np.uint8), 1)}
    with fake_cupy.Device(1):
        producer = cupy_streams.cuda.Stream(non_blocking=True)
        with producer:
            with fake_cupy.Device(0):
                sums = delta_fence.sums_of(types.SimpleNamespace(bindings=arrays))
    assert len(sums) == 2 and seen == [(1, producer)] * 2


# ---------------------------------------------------------------------------- A2

@pytest.fixture
def inexact_divide(monkeypatch):
    """float32 division as XLA's GPU backend compiles it (``div.full.f32``, not correctly
    rounded), modelled on CPU as ``x * (1 / y)``: two roundings, 1 ulp off IEEE for many
    operands. Every jitted function is traced anew under it, and again afterwards."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax._src.lax import lax as lax_impl

    from xreshard.quant import jax_ops
    exact = lax_impl.div

    def div(x, y):
        if jnp.result_type(x, y) == jnp.float32:
            return lax_impl.mul(x, exact(np.float32(1.0), y))
        return exact(x, y)

    def fresh():
        jax.clear_caches()
        jax_ops._block_fn.cache_clear()
        jax_ops._mx_fn.cache_clear()
    monkeypatch.setattr(lax_impl, "div", div)
    fresh()
    yield
    monkeypatch.undo()
    fresh()


def _off_by_an_ulp(fp8_max: float) -> np.ndarray:
    """bf16 magnitudes whose ``x / fp8_max`` and ``x * (1 / fp8_max)`` differ in float32."""
    import ml_dtypes
    bits = (np.arange(0x3800, 0x4400, dtype=np.uint32) << 16)       # ~1e-4 .. 512
    x = bits.view(np.float32)
    inv = np.float32(1.0) / np.float32(fp8_max)
    differ = (x / np.float32(fp8_max)) != (x * inv)
    return x[differ].astype(ml_dtypes.bfloat16)


def test_jax_fp8_scales_are_vllms_under_an_inexact_divide(inexact_divide):
    """A2: block FP8 scales (``amax / fp8_max``, and ``1 / scale`` for the codes) and MXFP8
    scale bytes from the JAX quantizer equal the host quantizer's (vLLM's bytes) even where
    the backend's float division is not IEEE's: the block divisions run on the host, the
    MXFP8 one in integers."""
    import jax.numpy as jnp
    import ml_dtypes

    from xreshard.quant import BlockFP8, MXFP8, host, jax_ops
    rng = np.random.default_rng(7)
    special = _off_by_an_ulp(448.0)
    assert len(special) > 50
    x = (rng.standard_normal((512, 1024)) * 0.02).astype(ml_dtypes.bfloat16)
    blocks = x.reshape(4, 128, 8, 128)
    flat = blocks.transpose(0, 2, 1, 3).reshape(32, -1)
    for i in range(32):             # each block's amax one that an inexact divide rounds off
        flat[i, rng.integers(flat.shape[1])] = special[rng.integers(len(special))]
    x = flat.reshape(4, 8, 128, 128).transpose(0, 2, 1, 3).reshape(512, 1024)
    for fmt, fn in ((BlockFP8(), host.quantize_block_fp8),
                    (BlockFP8(ue8m0=True), host.quantize_block_fp8),
                    (MXFP8(), host.quantize_mxfp8)):
        codes, scales = jax_ops.quantize(jnp.asarray(x), fmt)
        want_codes, want_scales = fn(x, fmt, name="w")
        assert np.asarray(scales).tobytes() == want_scales.tobytes(), fmt
        assert np.asarray(codes).tobytes() == want_codes.tobytes(), fmt


@pytest.mark.parametrize("divisor", [448.0, 240.0, 57344.0])
def test_integer_division_is_ieee_for_every_mantissa(divisor):
    """``div_exact_bits`` (MXFP8's ``amax / 448`` on the device) against numpy's IEEE
    float32 division, every mantissa at three exponents."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from xreshard.quant.jax_ops import div_exact_bits
    fn = jax.jit(lambda a: div_exact_bits(jnp, jax.lax, a, divisor))
    mantissas = np.arange(1 << 23, dtype=np.uint32)
    for exponent in (40, 127, 200):
        a = mantissas | np.uint32(exponent << 23)
        want = (a.view(np.float32) / np.float32(divisor)).view(np.uint32)
        got = np.asarray(fn(a))
        assert np.array_equal(got, want), (exponent, int(np.sum(got != want)))
