"""Quantizing on the way (issue 20 phase 2), all ranks in one process: the planner's per
block decision, the executor's FP8 items, the receivers' split blocks, bit for bit
against quantizing the whole tensor at once."""

from __future__ import annotations

import numpy as np
import pytest

import xreshard as xr
from xreshard.dtypes import numpy_dtype
from xreshard.ir.formats import BlockFP8, FormatError, MXFP8, QuantizedTensor
from xreshard.ir.geometry import Region
from xreshard.planner.prepare import CallOptions, prepare
from xreshard.planner.quantize import rest_boxes, split_quantized
from xreshard.planner.schedule import split_region
from xreshard.quant import host
from xreshard.tools.testing import local_arrays_from_global

BF16 = numpy_dtype("bfloat16")


def _values(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 0.02
    x *= np.exp2(rng.integers(-6, 7, shape[:-1] + (1,))).astype(np.float32)
    return x.astype(BF16)


def _sharded(shape, dtype, ranks, mesh_shape, dims):
    """A product layout over ``ranks``: mesh axis i splits tensor dim ``dims[i]``."""
    mesh = xr.Mesh(mesh_shape, tuple(ranks))
    return xr.Layout.product(shape, dtype, mesh, [(d, i) for i, d in enumerate(dims)])


def _garbage(shape, dtype):
    """Receive memory filled with 0x55 bytes (so a byte never written shows)."""
    dt = numpy_dtype(dtype)
    return np.full((int(np.prod(shape)) * dt.itemsize,), 0x55, np.uint8).view(dt).reshape(shape)


def _case():
    """(src layouts, dst layouts, quantized, formats): blocks whole in one sender, blocks
    split across senders (columns cut at 150 of a 128 grid), a ragged tail, MXFP8 groups
    cut at 80, experts whose blocks every sender splits, and a colocated receiver (rank 0
    sends and receives: same-rank copies)."""
    fp8 = "float8_e4m3fn"
    shapes = {"w": (512, 300), "mx": (256, 320), "experts": (4, 256, 256)}
    fmts = {"w": BlockFP8(), "mx": MXFP8(), "experts": BlockFP8()}
    src = {"w": _sharded(shapes["w"], "bfloat16", range(4), (2, 2), (0, 1)),
           "mx": _sharded(shapes["mx"], "bfloat16", range(4), (4,), (1,)),
           "experts": _sharded(shapes["experts"], "bfloat16", range(4), (4,), (1,))}
    dst, quantized = {}, {}
    for name, shape in shapes.items():
        fmt = fmts[name]
        qt = QuantizedTensor(name, name + "_scale", fmt, shape)
        lead = len(shape) - 2
        dst[name] = _sharded(shape, fp8, (0, 4), (2,), (lead,))
        dst[qt.scale] = _sharded(qt.scale_shape, fmt.scale_dtype, (0, 4), (2,), (lead,))
        quantized[name] = qt
    return src, dst, quantized


def _run(src, dst, quantized, *, pipeline, bucket_bytes=4096, wire_dtype=None, values=None,
         programs=None):
    from xreshard.config import Tuning
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.transport.local import LocalTransport

    values = values or {n: _values(lay.shape, i) for i, (n, lay) in enumerate(src.items())}
    src_b = {(r, n): local_arrays_from_global(lay, r, values[n]) for n, lay in src.items()
             for r in lay.ranks}
    dst_b = {(r, n): _garbage(lay.local_shape(r), lay.dtype)
             for n, lay in dst.items() for r in lay.ranks}
    options = CallOptions(bucket_bytes=bucket_bytes, staging_bytes=1 << 16, halved=pipeline,
                          wire_dtype=wire_dtype)
    prepared = prepare(src, dst, None, options, ranks=range(5), quantized=quantized)
    stats, _ = run(prepared, stage_bindings(prepared, src_b, dst_b), LocalTransport(),
                   timeout=30, programs={} if programs is None else programs,
                   tuning=Tuning(executor="pipelined" if pipeline else "rounds"))
    return prepared, stats, values, dst_b


def _expected(values, quantized, wire=None):
    out = {}
    for name, qt in quantized.items():
        x = values[name] if wire is None else values[name].astype(numpy_dtype(wire))
        fn = host.quantize_mxfp8 if isinstance(qt.format, MXFP8) else host.quantize_block_fp8
        out[name], out[qt.scale] = fn(x, qt.format)
    return out


@pytest.mark.parametrize("pipeline", [True, False])
def test_every_receiver_holds_the_whole_tensors_quantization(pipeline):
    src, dst, quantized = _case()
    prepared, stats, values, dst_b = _run(src, dst, quantized, pipeline=pipeline)
    want = _expected(values, quantized)
    for (r, name), arr in dst_b.items():
        region = dst[name].regions(r)[0]
        assert arr.view(np.uint8).tobytes() == \
            want[name][region.slices()].view(np.uint8).tobytes(), (r, name)
    q = prepared.formats.quant
    assert sorted(q.tensors) == ["experts", "mx", "w"]
    # w: block column 1 (128:256) is cut at 150 by the senders: split, quantized at rank 4
    assert {s.region for s in q.scratch[(4, "w")]} == {Region((256, 128), (512, 256))}
    # experts: every block is split (senders hold 64 of its 128 rows): all bf16
    items = [it for rnd in prepared.schedule.rounds for b in rnd for it in b.items]
    assert not any(it.quantized for it in items if it.name == "experts")
    assert any(it.quantized for it in items if it.name == "w")
    assert stats.quantized["fp8_received"] > 0 and stats.quantized["bf16_received"] > 0
    assert stats.quantized["fp8_sent"] == stats.quantized["fp8_received"]
    # same-rank copies: rank 0 holds rows 0:256 of w's columns 0:150 itself
    assert any(c.quantized and c.name == "w" for c in prepared.schedule.local_copies)


def test_a_wire_dtype_cast_comes_before_quantizing():
    """An fp32 trainer with wire_dtype bf16: the codes are those of the bf16 values (what
    the engine would load), not of the fp32 master."""
    src, dst, quantized = _case()
    src = {n: lay.with_dtype("float32") for n, lay in src.items()}
    values = {n: _values(lay.shape, i).astype(np.float32) + np.float32(1e-5)
              for i, (n, lay) in enumerate(src.items())}
    prepared, stats, values, dst_b = _run(src, dst, quantized, pipeline=True,
                                          wire_dtype="bfloat16", values=values)
    want = _expected(values, quantized, wire="bfloat16")
    master = _expected(values, quantized)
    differs = False
    for (r, name), arr in dst_b.items():
        region = dst[name].regions(r)[0]
        assert arr.view(np.uint8).tobytes() == \
            want[name][region.slices()].view(np.uint8).tobytes(), (r, name)
        differs |= arr.view(np.uint8).tobytes() != \
            master[name][region.slices()].view(np.uint8).tobytes()
    assert differs      # the check can tell the two apart


def test_fp8_bytes_on_the_wire_are_about_half():
    """Blocks held whole by one sender (rows split on the 128 grid): every byte of the
    tensor travels quantized, codes plus scales <= 0.52 x bf16."""
    shape = (1024, 512)
    src = {"w": _sharded(shape, "bfloat16", range(4), (4,), (0,))}
    qt = QuantizedTensor("w", "w_scale_inv", BlockFP8(), shape)
    dst = {"w": _sharded(shape, "float8_e4m3fn", (4, 5), (2,), (1,)),
           "w_scale_inv": _sharded(qt.scale_shape, "float32", (4, 5), (2,), (1,))}
    from xreshard.config import Tuning
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.transport.base import RecordingTransport
    from xreshard.transport.local import LocalTransport

    values = {"w": _values(shape, 3)}
    src_b = {(r, "w"): local_arrays_from_global(src["w"], r, values["w"]) for r in range(4)}
    dst_b = {(r, n): np.zeros(lay.local_shape(r), numpy_dtype(lay.dtype))
             for n, lay in dst.items() for r in (4, 5)}
    prepared = prepare(src, dst, None, CallOptions(), ranks=range(6), quantized={"w": qt})
    transport = RecordingTransport(LocalTransport())
    stats, _ = run(prepared, stage_bindings(prepared, src_b, dst_b), transport, timeout=30,
                   tuning=Tuning())
    bf16 = 1024 * 512 * 2
    assert transport.bytes_sent == stats.quantized["fp8_sent"] == 1024 * 512 + 8 * 4 * 4
    assert transport.bytes_sent <= 0.52 * bf16 and stats.quantized["bf16_sent"] == 0
    want = _expected(values, {"w": qt})
    for r, cols in ((4, slice(0, 256)), (5, slice(256, 512))):
        assert dst_b[(r, "w")].tobytes() == want["w"][:, cols].tobytes()


def test_split_items_cover_the_region_once():
    qt = QuantizedTensor("w", "s", BlockFP8(), (300, 500))
    region = Region((100, 20), (300, 433))
    items = split_quantized(qt, region, 2, 4096, split_region)
    cover = np.zeros((300, 500), np.int32)
    for r, n, q in items:
        cover[r.slices()] += 1
        if q:
            assert BlockFP8().is_aligned(r, qt.shape) and n == r.size + 4 * BlockFP8().blocks(
                r, qt.shape).size
        else:
            assert n == 2 * r.size
    assert cover[region.slices()].min() == 1 and cover.sum() == region.size
    assert rest_boxes(region, None) == [region]


def test_bad_offers_are_refused_before_planning():
    src, dst, quantized = _case()
    bad = dict(src, w=src["w"].with_dtype("int8"))
    with pytest.raises(FormatError, match="can be filled from bfloat16, float16, float32"):
        prepare(bad, dst, None, CallOptions(), ranks=range(5), quantized=quantized)
    wrong = dict(dst, w_scale=_sharded((4, 2), "float32", (0, 4), (2,), (0,)))
    with pytest.raises(FormatError, match="'w_scale' .* has layout \\(4, 2\\)"):
        prepare(src, wrong, None, CallOptions(), ranks=range(5), quantized=quantized)
    with pytest.raises(FormatError, match="wire_dtype int8 cannot be quantized"):
        prepare(src, dst, None, CallOptions(wire_dtype={"w": "int8"}), ranks=range(5),
                quantized=quantized)


def test_relay_with_nothing_to_forward_is_the_direct_call():
    """relay='on' / 'auto' with tensors quantized on the way where no domain forwards
    (no topology): the direct quantized call (relaying them: tests/test_relay_compose.py)."""
    src, dst, quantized = _case()
    direct = prepare(src, dst, None, CallOptions(), ranks=range(5), quantized=quantized)
    for relay in ("on", "auto"):
        prepared = prepare(src, dst, None, CallOptions(relay=relay), ranks=range(5),
                           quantized=quantized)
        assert [s.index for s in prepared.stages] == [0] and prepared.relay is None
        assert prepared.schedule == direct.schedule


def _digests(prepared, programs, src, values, dst_b):
    """verify's summaries of the trainer (ranks 0-3) and the receiver (rank 4) processes
    after ``_run`` (rank 0 receives too: its same-rank copies are hashed on both sides)."""
    import json

    from xreshard.runtime import verify
    from xreshard.runtime.quantized import scratch_bindings

    src_b = {(r, n): local_arrays_from_global(lay, r, values[n]) for n, lay in src.items()
             for r in lay.ranks}
    dst_all = {**dst_b, **scratch_bindings(prepared.formats.quant, programs)}
    out = []
    for ranks in ((0, 1, 2, 3), (4,)):
        mine = verify.digest_bindings(
            prepared.plan, ranks, {k: v for k, v in src_b.items() if k[0] in ranks},
            {k: v for k, v in dst_all.items() if k[0] in ranks}, quant=prepared.formats.quant)
        out.append(json.loads(json.dumps(mine.summary)))
    return out


@pytest.mark.parametrize("where", ["code", "scale", "split piece", "fp8 item scale"])
def test_verify_hashes_codes_scales_and_split_pieces_and_catches_a_flip(where):
    """verify=True with quantized destinations: the sender hashes the codes and scales it
    quantizes (and the bf16 pieces of split blocks), the receiver what landed; equal after
    a clean move, and one flipped byte of a code, a scale or a split block's piece (in the
    receiver's scratch) is a mismatch naming the tensor and the receiver."""
    from xreshard.runtime import verify
    from xreshard.runtime.quantized import FINISHED, scratch_bindings

    src, dst, quantized = _case()
    programs: dict = {}
    prepared, _, values, dst_b = _run(src, dst, quantized, pipeline=True, programs=programs)
    assert verify.mismatches(_digests(prepared, programs, src, values, dst_b)) == []
    if where == "code":
        name = "w"
        dst_b[(4, name)].view(np.uint8)[3, 5] ^= 1
    elif where == "scale":              # every experts block is split: rank 4 quantized it
        name = "experts" + FINISHED
        dst_b[(4, "experts_scale")].view(np.uint8).reshape(-1)[1] ^= 0x40
    elif where == "fp8 item scale":     # o: rows on the grid, every block sent quantized
        name = "w"
        dst_b[(4, "w_scale")].view(np.uint8).reshape(-1)[0] ^= 0x40
    else:
        name = "w"
        scratch = scratch_bindings(prepared.formats.quant, programs)
        key = next(k for k in sorted(scratch) if k[0] == 4 and k[1].startswith("w\0"))
        scratch[key].view(np.uint8).reshape(-1)[-1] ^= 1
    bad = verify.mismatches(_digests(prepared, programs, src, values, dst_b))
    # a piece flipped after the finish also no longer quantizes to what rank 4 holds
    extra = {name + FINISHED} if where == "split piece" else set()
    assert bad and {name} <= {m.name for m in bad} <= {name} | extra, bad
    assert {m.dst for m in bad} == {4}, bad


def test_codes_and_scales_offered_by_the_sender_move_as_they_are():
    """A sender that quantized itself (codes under the name, scales under the scales'):
    a plain move, nothing quantized on the way."""
    src, dst, quantized = _case()
    pre = {n: dst[n].with_dtype(dst[n].dtype) for n in dst}
    src_q = {}
    for name, lay in src.items():
        qt = quantized[name]
        src_q[name] = lay.with_dtype(qt.format.dtype)
        src_q[qt.scale] = _sharded(qt.scale_shape, qt.format.scale_dtype, (0,), (1,), (0,))
    prepared = prepare(src_q, pre, None, CallOptions(), ranks=range(5), quantized=quantized)
    assert prepared.formats.quant is None
    with pytest.raises(FormatError, match="offers its scales 'w_scale' but bfloat16 values"):
        prepare(dict(src_q, w=src["w"]), pre, None, CallOptions(), ranks=range(5),
                quantized=quantized)

