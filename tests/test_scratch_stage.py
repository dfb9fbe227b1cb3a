"""The receivers' finishing of split FP8 blocks is a stage of the prepared call (issue 32
item 1): the formats phase marks its items, ``prepare`` adds it with the receivers'
scratch as its sources, and the executor runs its same-rank copies like any stage's
(no last step of its own). All ranks in one process, bit for bit against quantizing the
whole tensor (vLLM's formulas, ``xreshard.quant.host``)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from xreshard.planner import formats as F
from xreshard.planner.prepare import (BINDING_SOURCES, DESTINATIONS, SCRATCH, CallOptions,
                                      prepare)

from .test_fp8_refit import _case, _expected, _run


def test_split_blocks_are_a_scratch_stage_of_the_prepared_call():
    src, dst, quantized = _case()
    prepared = prepare(src, dst, None, CallOptions(), ranks=range(5), quantized=quantized)
    st = prepared.scratch_stage
    assert SCRATCH in BINDING_SOURCES
    assert st is not None and st.index == len(prepared.stages) == 1
    assert (st.src_from, st.dst_from) == (SCRATCH, DESTINATIONS)
    q = prepared.formats.quant
    split = sorted({name for (_, name), ss in q.scratch.items() if ss})
    assert split, "the case splits blocks across senders"
    for name in split:      # the formats phase marks them for the scratch stage
        assert prepared.formats.item(name, st.index) == F.Fp8(quantized[name].format,
                                                              "bfloat16", True)
    finishing = [c for c in prepared.schedule.local_copies if c.stage == st.index]
    want = sum(len(s.blocks) for ss in q.scratch.values() for s in ss)
    assert len(finishing) == want and all(c.quantized and c.nbytes == 0 for c in finishing)
    assert {c.rank for c in finishing} <= {0, 4}        # receivers only
    # a receiver-less process has no scratch stage
    sender = prepare(src, dst, None, CallOptions(), ranks=[1], quantized=quantized)
    assert sender.scratch_stage is None
    assert not [c for c in sender.schedule.local_copies if c.stage != 0]


def test_the_executor_has_no_finishing_step_of_its_own():
    from xreshard.runtime import execute
    assert "quantized.finish(" not in inspect.getsource(execute)


@pytest.mark.parametrize("pipeline", [True, False])
def test_the_scratch_stage_finishes_every_split_block(pipeline, monkeypatch):
    """Each group of split blocks is quantized once, by its stage's copy, into the bytes
    the whole tensor's quantization has there."""
    from xreshard.runtime import quantized as qmod
    ran = []
    real = qmod.finish_copy

    def counting(c, *a, **kw):
        ran.append((c.rank, c.name, c.region))
        return real(c, *a, **kw)
    monkeypatch.setattr(qmod, "finish_copy", counting)
    src, dst, quantized = _case()
    prepared, _, values, dst_b = _run(src, dst, quantized, pipeline=pipeline)
    st = prepared.scratch_stage
    want = [(c.rank, c.name, c.region) for c in prepared.schedule.local_copies
            if c.stage == st.index]
    assert sorted(ran, key=repr) == sorted(want, key=repr)
    expected = _expected(values, quantized)
    for (r, name), arr in dst_b.items():
        region = dst[name].regions(r)[0]
        assert np.array_equal(arr.view(np.uint8),
                              np.ascontiguousarray(expected[name][region.slices()])
                              .view(np.uint8)), (r, name)
