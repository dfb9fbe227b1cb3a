"""Quantizing on the way in real processes: a JAX trainer (NamedSharding over 4 CPU
devices) refits torch receivers (DTensors over gloo) that store tensors block-FP8 and
MXFP8; each receiver's codes and scales equal, byte for byte, vLLM's own quantizer
(``per_block_cast_to_fp8``, ``_mxfp8_e4m3_quantize_torch``) run on the whole bf16 tensor.
Bad offers fail with the same typed error in every process, nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

pytestmark = pytest.mark.slow

#: name -> (shape, format, the trainer's PartitionSpec over mesh ("a", "b") = (2, 2))
TENSORS = {
    "w": ((512, 300), "block", ("a", "b")),         # columns cut at 150: split blocks
    "o": ((1024, 512), "block", (("a", "b"), None)),  # rows on the grid: all FP8 on the wire
    "mx": ((256, 320), "mx", (None, ("a", "b"))),   # groups of 32 cut at 80
    "e": ((4, 256, 256), "block", (None, "a", "b")),  # experts
}
ROLLOUT = 2


def _values(version: int) -> dict[str, np.ndarray]:
    import ml_dtypes
    out = {}
    for i, (name, (shape, _, _)) in enumerate(sorted(TENSORS.items())):
        rng = np.random.default_rng(100 * version + i)
        x = rng.standard_normal(shape).astype(np.float32) * 0.02
        x *= np.exp2(rng.integers(-6, 7, shape[:-1] + (1,))).astype(np.float32)
        out[name] = x.astype(ml_dtypes.bfloat16)
    return out


def _config(bad: str | None):
    import xreshard as xr
    return xr.RefitConfig(timeout=60, bucket_bytes=1 << 15, verify=bad == "corrupt")


def _corrupt_first_run(name: str) -> None:
    """Flip one code byte of ``name`` after this process's first executor run (a wire or
    unpack fault the checksums must catch), then behave."""
    from xreshard.runtime import execute

    run, calls = execute.Executor.run, []

    def corrupting_run(self):
        stats = run(self)
        calls.append(1)
        if len(calls) == 1:
            key = next(k for k in sorted(self.dst_bindings) if k[1] == name)
            self.dst_bindings[key].view(np.uint8).reshape(-1)[7] ^= 1
        return stats

    execute.Executor.run = corrupting_run


def trainer(ctx, bad: str | None) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.local_devices())

    def params(v):
        out = {}
        for name, a in _values(v).items():
            x = jnp.asarray(a)
            if bad == "int8" and name == "w":
                x = x.astype(jnp.int8)
            out[name] = jax.device_put(x, NamedSharding(mesh, P(*TENSORS[name][2])))
        return out

    refit = xr.Refit(world, send=params(1), config=_config(bad))
    out: dict = {"reports": []}
    for v in (1, 2):
        try:
            with xr.count_comm() as counts:
                r = refit(send=params(v))
        except Exception as e:      # noqa: BLE001 - the test compares what was raised
            out["error"] = [type(e).__name__, str(e)]
            if bad != "corrupt":
                break
            continue
        out["reports"].append(dict(r.quantized, sent=r.bytes_sent, verified=r.verified))
        out.setdefault("counts", []).append(counts.as_json())
    world.close()
    return out


def rollout(ctx, bad: str | None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import xreshard as xr
    from xreshard.adapters.torch import Quantized
    from xreshard.ir.formats import BlockFP8, MXFP8
    from xreshard.runtime.world import parse_address

    host, port = parse_address(ctx.address)
    store = dist.TCPStore(host, port, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("rollout/", store),
                            rank=ctx.role.index, world_size=ROLLOUT)
    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    mesh = init_device_mesh("cpu", (ROLLOUT,))
    me = ctx.role.index
    state, locals_ = {}, {}
    for name, (shape, kind, _) in TENSORS.items():
        fmt = BlockFP8() if kind == "block" else MXFP8()
        scale_shape = fmt.scale_shape(shape)
        if bad == "scale" and name == "w":
            scale_shape = (scale_shape[0], scale_shape[1] + 1)
        dim = len(shape) - 2                       # rows of each matrix, TP-style
        pieces = []
        for full, dtype in ((shape, torch.float8_e4m3fn),
                            (scale_shape, getattr(torch, fmt.scale_dtype))):
            local_shape = list(full)
            local_shape[dim] //= ROLLOUT
            nbytes = int(np.prod(local_shape)) * torch.empty(0, dtype=dtype).element_size()
            local = torch.full((nbytes,), 0x55, dtype=torch.uint8).view(dtype).view(local_shape)
            pieces.append(DTensor.from_local(local, mesh, [Shard(dim)], shape=torch.Size(full),
                                             stride=torch.empty(full).stride(),
                                             run_check=False))
            locals_.setdefault(name, []).append(local)
        state[name] = Quantized(*pieces, fmt)
    if bad == "corrupt" and me == 1:
        _corrupt_first_run("o")
    refit = xr.Refit(world, receive=state, config=_config(bad))
    out: dict = {"got": []}
    for v in (1, 2):
        try:
            with xr.count_comm() as counts:
                r = refit()
        except Exception as e:      # noqa: BLE001 - the test compares what was raised
            out["error"] = [type(e).__name__, str(e)]
            out["untouched"] = all((t.view(torch.uint8) == 0x55).all().item()
                                   for ts in locals_.values() for t in ts)
            if bad != "corrupt":
                break
            continue
        out["got"].append({n: [t.view(torch.uint8).numpy().tobytes().hex() for t in ts]
                           for n, ts in locals_.items()})
        out.setdefault("reports", []).append(dict(r.quantized))
        out.setdefault("counts", []).append(counts.as_json())
    world.close()
    dist.destroy_process_group()
    return out


def _vllm_bytes(version: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """vLLM's own quantizers on each whole bf16 tensor: (codes bytes, scales bytes)."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from .relay_compose_cases import vllm_quantize

    return {name: vllm_quantize(a, TENSORS[name][1]) for name, a in _values(version).items()}


def test_jax_trainer_to_torch_fp8_receivers_equals_vllms_quantizer():
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(ROLLOUT)]
    results = launch([trainer, rollout, rollout], roles, args=(None,), timeout=300)
    t = results[0].value
    assert "error" not in t, t
    for v in (1, 2):
        want = _vllm_bytes(v)
        for res in results[1:]:
            me = res.value
            got = me["got"][v - 1]
            index = roles.index(res.role) - 1
            for name, (shape, _, _) in TENSORS.items():
                codes, scales = want[name]
                dim = len(shape) - 2
                rows = slice(index * shape[dim] // ROLLOUT, (index + 1) * shape[dim] // ROLLOUT)
                srows = slice(index * scales.shape[dim] // ROLLOUT,
                              (index + 1) * scales.shape[dim] // ROLLOUT)
                sl = (slice(None),) * dim
                assert got[name][0] == codes[sl + (rows,)].tobytes().hex(), (v, name, index)
                assert got[name][1] == scales[sl + (srows,)].tobytes().hex(), (v, name, index)
    # what crossed the transports (count_comm) is the geometry's: whole blocks as codes +
    # scales, split blocks (w's columns 128:256, mx's groups cut at 80) in bf16. By hand:
    # o 1024x512 + 32 scales; w 2 x (256 x 172 + 4 scales) codes, 2 x 256 x 128 bf16;
    # mx 2 x 128 x (256 + 8); e 4 x 256 x 256 + 16 scales: every block whole
    fp8 = (1024 * 512 + 32 * 4) + 2 * (256 * 172 + 4 * 4) + 2 * 128 * 264 + (4 * 256 * 256
                                                                            + 16 * 4)
    bf16 = 2 * 256 * 128 * 2 + 2 * 128 * 64 * 2
    for report, counts in zip(t["reports"], t["counts"]):
        assert (report["fp8_world"], report["bf16_world"]) == (fp8, bf16)
        assert report["fp8_sent"] == fp8 and report["bf16_sent"] == bf16
        assert sum(counts["bytes_sent"].values()) == report["sent"] == fp8 + bf16
        assert report["unquantized_world"] == 2 * sum(int(np.prod(s))
                                                      for s, _, _ in TENSORS.values())
    for res in results[1:]:
        for report, counts in zip(res.value["reports"], res.value["counts"]):
            assert sum(counts["bytes_received"].values()) == \
                report["fp8_received"] + report["bf16_received"]
    # o alone (every block whole in one sender): 0.5001 x its bf16 bytes
    assert 1024 * 512 + 32 * 4 <= 0.52 * 1024 * 512 * 2


@pytest.mark.parametrize("bad, error, words", [
    ("int8", "FormatError", "can be filled from bfloat16, float16, float32 values"),
    ("scale", "RefitError", "has layout (4, 4) float32; expected (4, 3) float32"),
])
def test_bad_offers_fail_the_same_everywhere_before_any_byte_moves(bad, error, words):
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(ROLLOUT)]
    results = launch([trainer, rollout, rollout], roles, args=(bad,), timeout=300)
    errors = [r.value["error"] for r in results]
    assert all(e == errors[0] for e in errors), errors
    assert errors[0][0] == error and words in errors[0][1], errors[0]
    assert all(r.value["untouched"] for r in results[1:])


def test_verify_checks_quantized_bytes_and_a_flipped_code_fails_everywhere():
    """verify=True with FP8 destinations: rollout[1] flips one received code byte in the
    first refit; every process raises the same VerificationError naming the tensor and
    the receiver; the next refit verifies and holds vLLM's bytes."""
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(ROLLOUT)]
    results = launch([trainer, rollout, rollout], roles, args=("corrupt",), timeout=300)
    errors = [r.value["error"] for r in results]
    assert all(e == errors[0] for e in errors), errors
    assert errors[0][0] == "VerificationError" and "tensor 'o'" in errors[0][1], errors[0]
    assert "rollout[1]" in errors[0][1], errors[0]
    report = results[0].value["reports"]
    assert len(report) == 1 and report[0]["verified"], report
    want = _vllm_bytes(2)
    for res in results[1:]:
        index = roles.index(res.role) - 1
        codes, scales = want["o"]
        rows = slice(index * 512, (index + 1) * 512)
        got = res.value["got"][-1]["o"]
        assert got[0] == codes[rows].tobytes().hex() and \
            got[1] == scales[index * 4:(index + 1) * 4].tobytes().hex()
