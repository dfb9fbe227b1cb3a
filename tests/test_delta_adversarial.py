"""Adversarial sequences for the delta refit's dense promises, fences and baselines
(``RefitConfig(delta=True)``; docs/delta.md "A bucket that mostly changed goes dense",
"Baselines", "Fences"): steps that alternate fully changed and sparse, one tensor fully
changed beside a sparse one in the same bucket, a destination tensor written by four
senders some of which send dense (their baselines dropped) while the others send deltas,
tensors exactly at the sampling threshold (16 * 2,048 elements: never sampled) and one
element above it, destinations written outside xreshard after a fully changed call and
between sparse calls; with and without ``atomic``, sources read in place and sources the
sender must pack (fp32 cast to a bf16 wire: the encoder packs a bucket it finds mostly
changed into its baseline).

Real processes: a JAX trainer on four CPU devices and a torch receiver with plain tensors,
over gloo. After every call the receiver compares every byte it holds: a call that
succeeded left exactly the trainer's version, a call that failed failed the same way on
both processes and moved no byte (the destinations hold the last version plus the
outside writes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

from .delta_cases import attempt

#: name -> (shape, JAX partition spec over mesh axis "d" of 4 devices)
TENSORS = {
    "w": ((1024, 256), ("d",)),          # four senders into one destination tensor
    "c": ((256, 512), (None, "d")),      # column shards: strided in the destination
    "x": ((16 * 2048,), ()),             # at the sampling threshold: never sampled
    "y": ((16 * 2048 + 1,), ()),         # one element above: sampled
    "p": ((128, 512), ()),
    "q": ((128, 512), ()),
    # several tensors per bucket, a sample block across the boundary of two
    "m": ((400, 256), ("d",)),
    "n": ((384, 256), ("d",)),
    # a bucket of many small tensors per sender (norms, biases)
    **{f"s{i:02}": ((4000,), ("d",)) for i in range(40)},
}
#: a bucket of more elements than this is sampled (delta_encode.sample)
SAMPLED = 16 * 2048
F, S, Z = 1.0, 0.01, 0.0
ALL_F = {n: F for n in TENSORS}
ALL_S = {n: S for n in TENSORS}
#: per call: fraction of elements changed per tensor ("w": per row shard), and the
#: elements the receiver flips outside xreshard before the call
STEPS: list[tuple[dict, list[tuple[str, int]]]] = [
    (ALL_F, []),
    (ALL_F, []),
    (ALL_S, [("p", 5)]),                 # written after a fully changed call
    (ALL_S, []),
    ({"w": (F, S, S, F), "c": S, "x": F, "y": F, "p": F, "q": S, "m": S, "n": F}, []),
    (ALL_S, [("w", 3)]),                 # a dense sender's rows of a fenced tensor
    (ALL_S, []),
    (ALL_S, [("q", 7)]),                 # written between sparse calls
    (ALL_S, []),
    (ALL_F, [("x", 3)]),
    (ALL_S, [("y", 32768)]),             # its last element, after a fully changed call
    (ALL_F, []),
    (ALL_S, [("w", 1024 * 256 - 1), ("s39", 3999)]),
    (ALL_F, []),
    ({"w": (S, F, S, F), "c": F, "x": S, "y": S, "p": S, "q": F, "m": F, "n": S, "*": F},
     [("s03", 0)]),
    ({"w": (F, S, F, S), "c": S, "x": F, "y": F, "p": F, "q": S, "m": F, "n": F}, [("c", 1)]),
    (ALL_S, [("c", 256 * 512 - 1)]),
    (ALL_S, []),
    ({n: Z for n in TENSORS}, []),
    (ALL_F, []),
    ({**ALL_S, "m": F, "s07": F}, [("n", 9)]),   # one tensor of a bucket fully changed
    ({**ALL_S, "n": F}, []),
    (ALL_S, []),
]


#: calls whose receivers fail at their first landing bucket (a mix of two versions lands)
FAIL_AT = (13, 21)


def versions() -> list[dict[str, np.ndarray]]:
    """Each call's bf16 bits (uint16) of every tensor."""
    rng = np.random.default_rng(11)
    now = {n: rng.integers(0, 0x3F00, shape, dtype=np.uint16)
           for n, (shape, _) in TENSORS.items()}
    out = []
    for fractions, _ in STEPS:
        now = {n: v.copy() for n, v in now.items()}
        for n, v in now.items():
            f = fractions.get(n, fractions.get("*", S))     # "*": the small ones
            blocks = np.split(v.reshape(-1), len(f)) if isinstance(f, tuple) else [v.reshape(-1)]
            for block, frac in zip(blocks, f if isinstance(f, tuple) else (f,)):
                k = int(block.size * frac)
                if k:
                    block[rng.choice(block.size, k, replace=False)] ^= 1
        out.append(now)
    return out


def child(ctx: Any, cast: bool, atomic: bool, verify: bool) -> list:
    import xreshard as xr

    trainer = ctx.role.group == "trainer"
    world = ctx.join(groups=["trainer", "rollout"])
    # buckets of several small tensors (items under 64 KiB are packed together)
    config = xr.RefitConfig(delta=True, transport="gloo", timeout=60, atomic=atomic,
                            verify=verify, bucket_bytes=300_000,
                            wire_dtype="bfloat16" if cast else None)
    rows: list = []
    made = versions()
    if trainer:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = jax.make_mesh((4,), ("d",), devices=jax.local_devices())
        refit = xr.Refit(world, send=None, config=config)
        for v in made:
            send = {}
            for n, (_, spec) in TENSORS.items():
                bits = v[n]
                host = (bits.astype(np.uint32) << 16).view(np.float32) if cast \
                    else bits.view(jax.numpy.bfloat16)
                send[n] = jax.device_put(host, NamedSharding(mesh, P(*spec)))
            got = attempt(lambda: refit(send=send))
            rows.append(got if isinstance(got, str) else dict(got.delta, small=sum(
                b.nbytes <= 2 * SAMPLED for rnd in refit.prepared.schedule.rounds
                for b in rnd)))
    else:
        import torch

        dst = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, (shape, _) in TENSORS.items()}
        bits = {n: t.view(torch.uint16).numpy().reshape(-1) for n, t in dst.items()}
        held = {n: b.copy() for n, b in bits.items()}      # what dst should hold
        refit = xr.Refit(world, receive=dst, config=config)
        failing = _failing_land()
        for k, ((_, outside), v) in enumerate(zip(STEPS, made)):
            failing[0] = k in FAIL_AT
            for n, i in outside if ctx.role.index == 0 else ():   # the first receiver's
                bits[n][i] ^= 0x40
                held[n][i] ^= 0x40
            got = attempt(refit)
            if not isinstance(got, str):
                held = {n: a.reshape(-1).copy() for n, a in v.items()}
            elif failing[0]:        # a mix of two versions: the next call is dense
                held = {n: b.copy() for n, b in bits.items()}
            wrong = sorted(n for n in TENSORS if not np.array_equal(bits[n], held[n]))
            rows.append(got if isinstance(got, str) else {"wrong": wrong})
            if isinstance(got, str):
                rows[-1] = {"error": got, "wrong": wrong}
    world.close()
    return rows


def _failing_land() -> list[bool]:
    """Make this process's delta executor raise at its first landing bucket while the
    returned flag is set."""
    from xreshard.errors import RefitError
    from xreshard.runtime.codecs.delta import DeltaCodec

    flag, land = [False], DeltaCodec._land

    def failing(self: Any, b: Any, buf: Any, how: str) -> None:
        land(self, b, buf, how)
        if flag[0]:
            raise RefitError("injected failure while landing")

    DeltaCodec._land = failing       # type: ignore[method-assign]
    return flag


def _run(cast: bool, atomic: bool, verify: bool, receivers: int) -> None:
    results = launch(child, [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(receivers)], args=(cast, atomic, verify),
                     timeout=240)
    sent = results[0].value
    for got in (r.value for r in results[1:]):
        for k, (s, g) in enumerate(zip(sent, got)):
            assert g["wrong"] == [], (k, s, g)          # never a wrong byte, nor a moved one
            if isinstance(s, str):
                assert g.get("error") == s, (k, s, g)    # the same error on every process
                assert ("injected failure" if k in FAIL_AT else "written outside xreshard") \
                    in s, (k, s)
            else:
                assert "error" not in g, (k, s, g)
    # a tensor written between two sparse calls (its buckets go as deltas) is refused
    assert isinstance(sent[7], str)
    # sparse calls after a sparse one send deltas (the sequence is not all dense)
    assert sum(s["num_delta"] for s in sent if isinstance(s, dict)) > 0
    if not cast:        # read in place: every sampled bucket of a fully changed call is
        # said dense (no header), those of several tensors too; only the small ones are
        # diffed (a header each) and keep their baselines
        for k in (1, 11, 19):
            assert sent[k]["bytes_wire"] - sent[k]["bytes_dense"] == 32 * sent[k]["small"], k


@pytest.mark.slow
@pytest.mark.parametrize("cast,atomic,verify,receivers", [
    (False, False, False, 1), (True, False, True, 1), (False, True, True, 2),
    (True, True, False, 1)])
def test_alternating_mixed_and_written_destinations_never_hold_a_wrong_byte(
        cast, atomic, verify, receivers):
    """(two receivers: each holds every tensor; the first writes outside xreshard, and
    both, and the trainer, raise the same error)"""
    _run(cast, atomic, verify, receivers)


#: calls of the JAX receiver's test: fraction of elements changed per tensor
JAX_STEPS = [F, F, S, S, F, S, S, Z]


def jax_child(ctx: Any) -> list:
    """A JAX trainer and a JAX receiver (new arrays every call: its claim drops, every
    call is dense); ``verify=True``. The receiver also checks that the arrays an earlier
    call returned still hold that call's version (no delta applied under them)."""
    import jax
    import xreshard as xr
    from jax.sharding import SingleDeviceSharding

    world = ctx.join(groups=["trainer", "rollout"])
    config = xr.RefitConfig(delta=True, transport="gloo", timeout=60, verify=True,
                            bucket_bytes=300_000)
    rng = np.random.default_rng(5)
    shapes = {"a": (256, 256), "b": (200, 100), "c": (160, 100)}
    now = {n: rng.integers(0, 0x3F00, s, dtype=np.uint16) for n, s in shapes.items()}
    made = []
    for f in JAX_STEPS:
        now = {n: v.copy() for n, v in now.items()}
        for v in now.values():
            k = int(v.size * f)
            if k:
                v.reshape(-1)[rng.choice(v.size, k, replace=False)] ^= 1
        made.append(now)
    device = jax.local_devices()[0]
    rows: list = []
    if ctx.role.group == "trainer":
        refit = xr.Refit(world, send=None, config=config)
        for v in made:
            got = attempt(lambda: refit(send={n: jax.device_put(a.view(jax.numpy.bfloat16))
                                               for n, a in v.items()}))
            rows.append(got if isinstance(got, str) else dict(got.delta))
    else:
        like = {n: jax.ShapeDtypeStruct(s, jax.numpy.bfloat16,
                                        sharding=SingleDeviceSharding(device))
                for n, s in shapes.items()}
        refit = xr.Refit(world, receive=like, config=config)
        earlier: list = []
        for k, v in enumerate(made):
            got = attempt(refit)
            if isinstance(got, str):
                rows.append({"error": got})
                continue
            earlier.append((k, dict(refit.received)))
            wrong = [(j, n) for j, arrays in earlier for n, a in arrays.items()
                     if not np.array_equal(np.asarray(a).view(np.uint16), made[j][n])]
            rows.append({"wrong": wrong})
    world.close()
    return rows


@pytest.mark.slow
def test_jax_receiver_with_verify_holds_every_version_it_returned():
    results = launch(jax_child, [Role("jax", "trainer", 0, num_devices=1),
                                 Role("jax", "rollout", 0, num_devices=1)], timeout=200)
    sent, got = results[0].value, results[1].value
    assert all(isinstance(s, dict) and s["pairs"] == 0 for s in sent), sent   # dense
    assert got == [{"wrong": []}] * len(JAX_STEPS), got


#: tensors sent per call of the re-plan test: a set that shrinks, then grows again
REPLAN = [("a", "b"), ("a", "b"), ("a",), ("a",), ("a", "b"), ("a", "b")]


def replan_child(ctx: Any) -> list:
    """Both sides stop refitting a tensor, then resume it (a re-plan each time) while
    baselines are held: the encoder started ahead with the last call's schedule must not
    trip over a binding that is gone."""
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"])
    config = xr.RefitConfig(delta=True, transport="gloo", timeout=20)
    rng = np.random.default_rng(3)
    now = {n: rng.integers(0, 0x3F00, (256, 256), dtype=np.uint16) for n in "ab"}
    made = []
    for _ in REPLAN:
        now = {n: v.copy() for n, v in now.items()}
        for v in now.values():
            v.reshape(-1)[rng.choice(v.size, v.size // 100, replace=False)] ^= 1
        made.append(now)
    rows: list = []
    if ctx.role.group == "trainer":
        import jax
        refit = xr.Refit(world, send=None, config=config)
        for names, v in zip(REPLAN, made):
            got = attempt(lambda: refit(send={n: jax.device_put(v[n].view(jax.numpy.bfloat16))
                                               for n in names}))
            rows.append(got if isinstance(got, str) else got.delta["num_delta"])
    else:
        import torch
        dst = {n: torch.zeros((256, 256), dtype=torch.bfloat16) for n in "ab"}
        refit = xr.Refit(world, receive=dst, config=config)
        for names, v in zip(REPLAN, made):
            got = attempt(lambda: refit(receive={n: dst[n] for n in names}))
            rows.append(got if isinstance(got, str) else all(
                np.array_equal(dst[n].view(torch.uint16).numpy(), v[n]) for n in names))
    world.close()
    return rows


@pytest.mark.slow
def test_a_replan_that_drops_a_tensor_while_baselines_are_held():
    results = launch(replan_child, [Role("jax", "trainer", 0, num_devices=1),
                                    Role("torch", "rollout", 0)], timeout=120, check=False)
    sent, got = results[0].value, results[1].value
    assert got == [True] * len(REPLAN), (sent, got)
    assert sent[1] == 2 and sent[3] == 1, sent      # deltas between the re-plans


def test_a_bucket_of_small_tensors_that_changed_whole_is_mostly_changed():
    """A bucket of many small items (norms, biases): its sample's blocks are clipped at
    each item's end, so the sample is far smaller than 16 * 2,048 elements; every element
    changed is still "mostly changed" (90% of the sample), and 1% is not."""
    from xreshard.runtime.delta_encode import mostly_changed, sample

    old = np.zeros(40 * 1000, np.uint16)
    new = old + 1
    assert sample(np.split(new, 40)).size < SAMPLED // 2
    assert mostly_changed(old, np.split(new, 40))
    some = old.copy()
    some[::100] = 1
    assert not mostly_changed(old, np.split(some, 40))
