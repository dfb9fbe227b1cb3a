"""Processes of tests/test_faults.py: one local fault on one process in the middle of a
refit (a transport post or an apply raising once), in an elastic or a fixed world; every
process reports what its calls raised and whether its destinations hold the exact bytes.

trainer[0] (2 ranks) sends rows, rollout[0] and rollout[1] receive columns (the layouts of
``elastic_cases``); small buckets and staging make several rounds, so the healthy
processes are still waiting on the faulty one's later posts when it fails.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from . import elastic_cases as cases

#: scenario -> (elastic, transport, delta, faulty process label, what raises once)
SCENARIOS = {
    "gloo-send": (True, "gloo", False, "trainer[0]", "send"),
    "gloo-recv": (True, "gloo", False, "rollout[1]", "recv"),
    "shm-send": (True, "shm", False, "trainer[0]", "send"),
    "shm-delta-apply": (True, "shm", True, "rollout[1]", "land"),
    "fixed-gloo-apply": (False, "gloo", False, "rollout[1]", "apply"),
    "fixed-shm-apply": (False, "shm", False, "rollout[1]", "apply"),
    "gloo-exit-unheard": (True, "gloo", False, "rollout[1]", "exit-unheard"),
    "fixed-gloo-exit": (False, "gloo", False, "rollout[1]", "exit"),
}
#: the refit timeout of a scenario whose peers wait it out in their transport
UNHEARD_TIMEOUT = 20
#: seconds the trainer, healthy but slow, takes before its second round (in the call
#: where rollout[1] fails unheard): it begins its wait on rollout[1]'s posts after
#: rollout[1] failed, and ends it at its transport timeout, after rollout[1]'s
SLOW_ROUND = 2.0

INJECTED = "injected fault"


@contextlib.contextmanager
def _fault_once(transport: str, what: str) -> Iterator[None]:
    """``what`` raises once in this process: a transport's send or recv (a RuntimeError,
    not xreshard's), the executor placing its second round's receives (after the first
    round landed: the peers wait for its later posts) or the delta executor landing a
    bucket (a RefitError: a bad apply)."""
    from xreshard.errors import RefitError
    skip = 0        # calls that go through before the one that raises
    if what.startswith("exit"):
        with _fault_at_group_exit(unheard=what == "exit-unheard"):
            yield
        return
    if what in ("send", "recv"):
        if transport == "gloo":
            from xreshard.transport.gloo import GlooTransport as cls
        else:
            from xreshard.transport.shm import ShmTransport as cls
        error: Exception = RuntimeError(f"{INJECTED} in {transport} {what}")
    elif what == "apply":
        from xreshard.runtime.execute import Executor as cls
        what, error = "_recv_buffers", RefitError(f"{INJECTED}: a bad apply")
        skip = 1
    else:
        from xreshard.runtime.codecs.delta import DeltaCodec as cls
        what, error = "_land", RefitError(f"{INJECTED}: a bad delta apply")
    original = getattr(cls, what)
    calls = []

    def once(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == skip + 1:
            raise error
        return original(self, *args, **kwargs)

    setattr(cls, what, once)
    try:
        yield
    finally:
        setattr(cls, what, original)


@contextlib.contextmanager
def _fault_at_group_exit(unheard: bool) -> Iterator[None]:
    """A ``RefitError`` once, as a gloo group's context exits (its posts completed; the
    later rounds' are never made), as tests/compose_matrix_cases.py's ``fault_mid_move``
    patches ``GlooTransport.group``. ``unheard``: this process's gloo aborts reach nobody,
    so its peers wait out their transport timeout and reach the outcome after it did (as
    when an abort does not wake a peer's wait)."""
    from xreshard.errors import RefitError
    from xreshard.transport.gloo import GlooTransport

    group, abort = GlooTransport.group, GlooTransport.abort
    raised: list[int] = []

    @contextlib.contextmanager
    def failing(self: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        with group(self, *args, **kwargs):
            yield
        if not raised:
            raised.append(1)
            raise RefitError(f"{INJECTED}: a group's exit")

    GlooTransport.group = failing 
    if unheard:
        GlooTransport.abort = lambda self, why: None
    try:
        yield
    finally:
        GlooTransport.group, GlooTransport.abort = group, abort


@contextlib.contextmanager
def _slow_second_round() -> Iterator[None]:
    """This process (healthy) pauses :data:`SLOW_ROUND` seconds once, as it enters its
    first gloo group after one exited (its second round), as a loaded process packing a
    round may."""
    from xreshard.transport.gloo import GlooTransport

    group = GlooTransport.group
    exited: list[int] = []
    slept: list[int] = []

    @contextlib.contextmanager
    def slow(self: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        if exited and not slept:
            slept.append(1)
            time.sleep(SLOW_ROUND)
        with group(self, *args, **kwargs):
            yield
        exited.append(1)

    GlooTransport.group = slow
    try:
        yield
    finally:
        GlooTransport.group = group


def members(ctx: Any, scenarios: list[str]) -> dict:
    """:func:`member` for each of ``scenarios`` in turn, each in a world of its own, by the
    same processes (one launch for the file): scenario -> what it returned."""
    return {s: member(ctx, s, world_id=f"{ctx.world_id}-{s}") for s in scenarios}


def member(ctx: Any, scenario: str, world_id: str | None = None) -> dict:
    """Calls 1 and 3 healthy; in call 2 the scenario's process faults once."""
    import xreshard as xr

    elastic, transport, delta, faulty, what = SCENARIOS[scenario]
    label = f"{ctx.role.group}[{ctx.role.index}]"
    world = ctx.join(elastic=elastic, groups=["trainer", "rollout"], timeout=90,
                     world_id=world_id or ctx.world_id)
    trainer = ctx.role.group == "trainer"
    side = cases.Sender() if trainer else cases.Receiver()
    timeout = UNHEARD_TIMEOUT if what == "exit-unheard" else 40 if elastic else 30
    config = xr.RefitConfig(timeout=timeout, transport=transport, delta=delta,
                            bucket_bytes=1024, staging_bytes=2048)
    refit = xr.Refit(world, config=config, **{
        ("send" if trainer else "receive"): xr.Rebuilt(side.build)})
    calls: list[dict] = []
    for version in (1, 2, 3):
        if trainer:
            side.version = version + 10 * (version == 3)     # call 2 failed: v3 differs
        fault = _fault_once(transport, what) if version == 2 and label == faulty \
            else _slow_second_round() if version == 2 and what == "exit-unheard" \
            and label == "trainer[0]" else contextlib.nullcontext()
        row: dict[str, Any] = {"epoch_before": world.epoch}
        t0 = time.monotonic()
        try:
            with fault:
                refit()
            row["exact"] = trainer or side.exact(side_version(version))
        except Exception as e:      # noqa: BLE001 - reported to the test
            row["error"] = [type(e).__name__, str(e)]
        row.update(epoch_after=world.epoch, broken=world.broken is not None,
                   members=list(world.members), seconds=time.monotonic() - t0)
        calls.append(row)
    world.close()
    return {"label": label, "calls": calls}


def side_version(call: int) -> int:
    """The version the trainer sends at ``call`` (see ``member``)."""
    return call + 10 * (call == 3)


class _SlowImport:
    """A meta path finder that makes importing ``torch.distributed.tensor`` take
    ``seconds`` longer (as it does on a loaded machine: 5-7 s), then lets the usual finders
    import it."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch.distributed.tensor":
            import time
            time.sleep(self.seconds)
        return None


def first_call(ctx: Any) -> dict:
    """Item 6: trainer[0] sends, rollout[0] receives into a plain torch state dict, with a
    4 s refit timeout; in rollout[0] importing ``torch.distributed.tensor`` (which binding
    torch tensors needs) takes 8 s more. Both make one call."""
    import sys
    import xreshard as xr

    trainer = ctx.role.group == "trainer"
    if not trainer:
        sys.meta_path.insert(0, _SlowImport(8.0))
        import torch
        assert "torch.distributed.tensor" not in sys.modules
    world = ctx.join(groups=["trainer", "rollout"], timeout=120)
    config = xr.RefitConfig(timeout=4)
    if trainer:
        refit = xr.Refit(world, send=xr.Rebuilt(cases.Sender().build), config=config)
    else:
        state = {n: torch.zeros(cases.SHAPE) for n in cases.NAMES}
        refit = xr.Refit(world, receive=state, config=config)
    try:
        refit()
    except Exception as e:      # noqa: BLE001 - reported to the test
        world.close()
        return {"error": [type(e).__name__, str(e)]}
    full = cases.value(1).tobytes()
    exact = trainer or all(state[n].numpy().tobytes() == full for n in cases.NAMES)
    world.close()
    return {"exact": exact}
