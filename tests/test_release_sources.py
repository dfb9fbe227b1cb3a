"""A refit lets go of its views of the sources as soon as it has moved them: the call no
longer holds them during the outcome exchange (a thread frees the trainer's thousands of
numpy views of JAX buffers meanwhile, not after the call: issue 35, the trainer's warm
call), none is left when the call returns, and the received arrays are as before.

One JAX process (4 CPU devices) refits a tree to itself in another sharding, twice.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest

from xreshard.tools.launch import Role, launch

pytest.importorskip("jax")
pytest.importorskip("torch")      # the world's store is torch's TCPStore


def one_process(ctx: Any) -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xreshard as xr
    from xreshard.runtime.refit import Refit

    world = ctx.join()
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.local_devices())
    rows = NamedSharding(mesh, P("tp", None))
    cols = NamedSharding(mesh, P(None, "tp"))
    values = {f"w{i}": np.arange(64 * 8, dtype=np.float32).reshape(64, 8) * (i + 1)
              for i in range(6)}
    send = {k: jax.device_put(v, rows) for k, v in values.items()}
    receive = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=cols)
               for k, v in values.items()}
    seen: dict[str, list] = {"held_at_outcome": [], "alive_after": []}
    bound: list[Any] = []
    bind_sides, commit = Refit._bind_sides, Refit._commit

    def spy_bind(self: Any, call: Any, *a: Any) -> None:
        bind_sides(self, call, *a)
        view = next(iter(call.src.bindings.values()))
        bound[:] = [weakref.ref(call.src), weakref.ref(view)]

    def spy_commit(self: Any, call: Any, error: Any) -> Any:
        seen["held_at_outcome"].append(call.src is not None or call.bindings is not None)
        return commit(self, call, error)

    Refit._bind_sides, Refit._commit = spy_bind, spy_commit      # this process only
    refit = xr.Refit(world, receive=receive, config=xr.RefitConfig(timeout=120))
    exact = []
    for _ in range(2):
        report = refit(send=send)
        seen["alive_after"].append([r() is not None for r in bound])
        exact.append(all(np.asarray(refit.received[k]).tobytes() == v.tobytes()
                         for k, v in values.items()) and report.bytes_local > 0)
    world.close()
    return {**seen, "exact": exact}


def test_the_sources_views_are_freed_before_the_outcome_exchange():
    [res] = launch([one_process], [Role("jax", "trainer", 0, num_devices=4)], timeout=120)
    got = res.value
    assert got["exact"] == [True, True]
    assert got["held_at_outcome"] == [False, False]
    assert got["alive_after"] == [[False, False], [False, False]]
