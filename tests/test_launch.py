"""The multi-process launcher: results, failures with tracebacks, hangs killed at the timeout."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

# launch serves the rendezvous store, torch's TCPStore. find_spec, not importorskip: the
# children import this module, and importing torch would slow every one of them down
if importlib.util.find_spec("torch") is None:
    pytest.skip("launch needs torch (its rendezvous store)", allow_module_level=True)

from xreshard.tools.launch import Context, LaunchError, LaunchTimeout, Role, launch


def report(ctx: Context, factor: int) -> dict:
    return {"launch_index": ctx.launch_index, "group": ctx.role.group, "index": ctx.role.index,
            "num_processes": ctx.num_processes, "times": ctx.launch_index * factor,
            "address": ctx.address, "pid": os.getpid(),
            "jax_env": [os.environ.get("JAX_PLATFORMS"), os.environ.get("JAX_NUM_CPU_DEVICES")],
            "extra": os.environ.get("XRESHARD_TEST_EXTRA"), "role_env": os.environ.get("ROLE_ENV")}


def fail_on_one(ctx: Context) -> str:
    if ctx.launch_index == 1:
        raise ValueError("child one refuses")
    return "fine"


def hang_on_two(ctx: Context) -> str:
    if ctx.launch_index == 2:
        time.sleep(600)
    return "done"


def not_json(ctx: Context) -> object:
    return object()


def jax_devices(ctx: Context) -> list:
    import jax
    return [d.platform for d in jax.devices()]


def test_results_are_collected_in_role_order():
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0, env={"ROLE_ENV": "r0"}),
             Role("jax", "rollout", 1, num_devices=3)]
    results = launch(report, roles, args=(10,), env={"XRESHARD_TEST_EXTRA": "yes"}, timeout=60)
    assert [r.ok for r in results] == [True] * 3
    values = [r.value for r in results]
    assert [v["launch_index"] for v in values] == [0, 1, 2]
    assert [v["times"] for v in values] == [0, 10, 20]
    assert [(v["group"], v["index"]) for v in values] == [("trainer", 0), ("rollout", 0),
                                                          ("rollout", 1)]
    assert {v["num_processes"] for v in values} == {3}
    assert len({v["address"] for v in values}) == 1 and values[0]["address"].startswith("tcp://")
    assert values[2]["jax_env"] == ["cpu", "3"]
    assert {v["extra"] for v in values} == {"yes"}
    assert [v["role_env"] for v in values] == [None, "r0", None]
    assert [v["pid"] for v in values] == [r.pid for r in results]
    assert all(r.returncode == 0 for r in results)


def test_jax_role_gets_its_cpu_devices():
    (res,) = launch(jax_devices, [Role("jax", num_devices=4)], timeout=60)
    assert res.value == ["cpu"] * 4


def test_fn_by_string_reference():
    (res,) = launch("tests.test_launch:report", [Role()], args=(1,), timeout=60)
    assert res.ok and res.value["times"] == 0


def test_a_raising_child_is_reported_with_its_traceback():
    roles = [Role(index=i) for i in range(3)]
    with pytest.raises(LaunchError, match="1 of 3 children failed") as info:
        launch(fail_on_one, roles, timeout=60)
    msg = str(info.value)
    assert "child 1 default[1]" in msg and "ValueError: child one refuses" in msg
    assert "in fail_on_one" in msg
    res = info.value.results
    assert [r.ok for r in res] == [True, False, True]
    assert res[1].returncode == 1 and "child one refuses" in res[1].traceback
    assert [res[0].value, res[2].value] == ["fine", "fine"]


def test_check_false_returns_failures():
    res = launch(fail_on_one, [Role(index=i) for i in range(2)], timeout=60, check=False)
    assert [r.ok for r in res] == [True, False]


def test_a_hanging_child_is_killed_at_the_timeout():
    # 10 s, not less: the two children that return must start and import xreshard first,
    # which took over 4 s on a 2-core box at load 30
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"1 of 3 children still running after 10(\.0)? s") as info:
        launch(hang_on_two, [Role(index=i) for i in range(3)], timeout=10)
    elapsed = time.monotonic() - t0
    assert 10 <= elapsed < 10 + 10      # killed at the timeout (+ slack for a loaded box)
    assert "child 2 default[2]" in str(info.value)
    res = info.value.results
    assert [r.ok for r in res] == [True, True, False]
    assert res[2].timed_out and res[2].killed and res[2].returncode == -9
    with pytest.raises(ProcessLookupError):
        os.kill(res[2].pid, 0)


def test_non_json_return_value_is_a_failure():
    with pytest.raises(LaunchError, match="not JSON-serializable"):
        launch(not_json, [Role()], timeout=60)


def test_functions_children_cannot_import_are_refused():
    with pytest.raises(ValueError, match="module-level function"):
        launch(lambda ctx: None, [Role()])
    with pytest.raises(ValueError, match="module:qualname"):
        launch("no_colon", [Role()])
    with pytest.raises(ValueError, match="kind"):
        Role("tensorflow")


def package_seen(ctx: Context) -> dict:
    import xreshard
    return {"file": xreshard.__file__, "has_refit": hasattr(xreshard, "Refit")}


def test_children_import_the_parents_package_from_any_working_directory(tmp_path, monkeypatch):
    """A launch started next to a folder named ``xreshard`` (a clone's parent directory):
    ``python -m`` would put that folder first and shadow the package; the children must
    import the package the parent imported."""
    import xreshard

    (tmp_path / "xreshard" / "xreshard").mkdir(parents=True)      # a clone, seen from above
    (tmp_path / "xreshard" / "README.md").write_text("a clone\n")
    monkeypatch.chdir(tmp_path)
    results = launch(package_seen, [Role("plain", "trainer", 0), Role("jax", "rollout", 0)],
                     timeout=60)
    assert [r.value for r in results] == [{"file": xreshard.__file__, "has_refit": True}] * 2
