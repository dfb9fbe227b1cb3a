"""A torch receiver declares a quantized destination with plain tensors (the whole codes
and scales in one process, as ``Quantized`` documents), a torch sender offers bf16
values: the codes and scales land byte for byte as ``xreshard.quant`` (vLLM's
``per_block_cast_to_fp8``) computes them. Plain tensors bind as one-region lists, which
the scales' binding must follow like any destination's (it once did not: TypeError while
unpacking)."""

from __future__ import annotations

import pytest

from xreshard.tools.launch import Role, launch

pytestmark = pytest.mark.slow


def _values(seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(256, 384, generator=g) * 0.02).to(torch.bfloat16)


def trainer(ctx) -> list:
    import xreshard as xr
    with ctx.join(groups=["trainer", "rollout"], timeout=120) as world:
        refit = xr.Refit(world, config=xr.RefitConfig(timeout=60))
        return [refit(send={"w": _values(seed)}).bytes_sent for seed in (1, 2)]


def rollout(ctx) -> list:
    import torch
    import xreshard as xr
    from xreshard.adapters.torch import Quantized
    from xreshard.ir.formats import BlockFP8
    from xreshard.quant import quantize

    codes = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    scales = torch.full((2, 3), -1.0)
    out = []
    with ctx.join(groups=["trainer", "rollout"], timeout=120) as world:
        refit = xr.Refit(world, config=xr.RefitConfig(timeout=60))
        for seed in (1, 2):
            refit(receive={"w": Quantized(codes, scales, BlockFP8())})
            want_codes, want_scales = quantize(_values(seed), BlockFP8())
            out.append(bool(torch.equal(codes.view(torch.uint8),
                                        want_codes.view(torch.uint8)))
                       and bool(torch.equal(scales, want_scales)))
    return out


def test_plain_tensor_codes_and_scales_receive_the_quantization():
    results = launch([trainer, rollout], [Role("torch", "trainer", 0),
                                          Role("torch", "rollout", 0)], timeout=300)
    sent, equal = results[0].value, results[1].value
    assert equal == [True, True]
    # whole 128 x 128 blocks in the one sender: e4m3 codes + float32 scales on the wire
    assert all(s == 256 * 384 + 2 * 3 * 4 for s in sent), sent
