"""Run a function in several fresh processes that form a refit world: multi-process tests.

``launch`` starts a rendezvous store in the calling process (a free port), then one child
process per ``Role`` running this module's child side (``spec.json`` names the rest). Each
child imports xreshard from where the calling process imported it, whatever its working
directory (not ``python -m``, which puts the working directory first on ``sys.path``: run
from a clone's parent folder, the clone's ``xreshard/`` folder would shadow the installed
package). Each child imports
the function by ``"module:qualname"`` (nothing is pickled), calls ``fn(ctx, *args)`` and
writes its JSON return value, or its traceback as text, to a file the parent reads::

    def check_refit(ctx, n):                       # module level, importable
        world = ctx.join()                         # World.join with the role's group/index
        ...
        return {"rank_ids": list(world.rank_ids)}  # JSON-serializable

    results = launch(check_refit, [Role("jax", "trainer", 0, num_devices=4),
                                   Role("plain", "rollout", 0)], args=(3,), timeout=60)

Each child runs in its own session, so on timeout (or ``fail_fast``) the parent kills its
whole process group. JAX roles get ``JAX_PLATFORMS=cpu`` and ``JAX_NUM_CPU_DEVICES`` set
before the child starts (so before jax is imported); a role with ``gpus`` gets
``CUDA_VISIBLE_DEVICES`` instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Role", "Context", "Result", "LaunchError", "LaunchTimeout", "launch"]

_KINDS = ("jax", "torch", "plain")
_OUTPUT_TAIL = 4000

# The child's command line: ``python -c CHILD ROOT SPEC``. ``-c`` puts the working directory
# ("") first on sys.path; CHILD replaces it with ROOT, the folder holding the package the
# parent imported, before importing anything of xreshard.
_CHILD = ("import sys; sys.path[0] = sys.argv.pop(1); "
          "import xreshard.tools.launch as launch; launch.run_child(sys.argv[1])")


def _package_root() -> str:
    """The folder ``xreshard`` was imported from (a site-packages, or an editable clone)."""
    import xreshard
    return os.path.dirname(os.path.dirname(os.path.abspath(xreshard.__file__)))


@dataclass(frozen=True)
class Role:
    """One child process of a launch.

    Attributes:
        kind: "jax" (JAX on ``num_devices`` CPU devices, or on ``gpus``), "torch", or
            "plain" (no framework set up; ``num_devices`` CPU ranks).
        group: the world group the child joins, e.g. "trainer".
        index: the child's index within its group.
        num_devices: local devices, one world rank each (JAX CPU devices for "jax").
        gpus: GPUs to pin with ``CUDA_VISIBLE_DEVICES`` (then ``num_devices`` is ignored
            and the child sees ``len(gpus)`` devices).
        env: extra environment variables for this child.
    """

    kind: str = "plain"
    group: str = "default"
    index: int = 0
    num_devices: int = 1
    gpus: tuple[int, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Role kind {self.kind!r} is not one of {_KINDS}")
        if self.num_devices < 0:
            raise ValueError(f"Role num_devices must be >= 0, got {self.num_devices}")
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(int(g) for g in self.gpus))
        if isinstance(self.env, Mapping):
            object.__setattr__(self, "env", tuple(sorted(self.env.items())))

    @property
    def label(self) -> str:
        return f"{self.group}[{self.index}] ({self.kind})"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["env"] = dict(self.env)
        d["gpus"] = None if self.gpus is None else list(self.gpus)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Role:
        return cls(d["kind"], d["group"], d["index"], d["num_devices"],
                   None if d["gpus"] is None else tuple(d["gpus"]),
                   tuple(sorted(d["env"].items())))


@dataclass(frozen=True)
class Context:
    """What a launched function gets as its first argument.

    Attributes:
        address: the rendezvous store, for ``World.join``.
        role: this child's role.
        launch_index: this child's position in the ``roles`` list (not the world's process
            order, which ``World.join`` derives from group and index).
        num_processes: how many children the launch started.
        roles: every child's role, in launch order.
        world_id: the world id ``join`` uses by default.
    """

    address: str
    role: Role
    launch_index: int
    num_processes: int
    roles: tuple[Role, ...]
    world_id: str = "default"

    def devices(self) -> Any:
        """This role's local devices: ``jax.local_devices()`` for "jax"; CUDA torch devices
        for roles with ``gpus``; else an int count of CPU ranks."""
        if self.role.kind == "jax":
            import jax
            return jax.local_devices()
        if self.role.gpus is not None:
            return [f"cuda:{i}" for i in range(len(self.role.gpus))]
        return self.role.num_devices

    def join(self, devices: Any = None, **kwargs: Any) -> Any:
        """``World.join`` as this role; ``kwargs`` go to ``World.join`` (timeout, groups, ...)."""
        from ..runtime.world import World

        kwargs.setdefault("world_id", self.world_id)
        kwargs.setdefault("num_processes", self.num_processes)
        kwargs.setdefault("index", self.role.index)
        return World.join(self.address, self.role.group,
                          self.devices() if devices is None else devices, **kwargs)


@dataclass
class Result:
    """What one child did.

    Attributes:
        role: its role.
        launch_index: its position in the ``roles`` list.
        ok: it returned normally and its value was JSON-serializable.
        value: its return value (JSON round-tripped), or None.
        traceback: the text of its exception's traceback, when it raised.
        returncode: its exit code (negative: killed by that signal), None if never reaped.
        timed_out: still running at the launch timeout, so killed.
        killed: killed by the launcher (timeout, or ``fail_fast`` after another failed).
        output: the tail of its stdout and stderr.
        pid: its process id.
    """

    role: Role
    launch_index: int
    ok: bool = False
    value: Any = None
    traceback: str | None = None
    returncode: int | None = None
    timed_out: bool = False
    killed: bool = False
    output: str = ""
    pid: int = 0

    def describe(self) -> str:
        head = f"child {self.launch_index} {self.role.label} (pid {self.pid})"
        if self.timed_out:
            why = "still running at the timeout: killed"
        elif self.killed:
            why = "killed after another child failed"
        elif self.traceback:
            why = f"raised:\n{self.traceback.rstrip()}"
        else:
            why = f"exited with code {self.returncode} without a result"
        tail = self.output.strip()[-1500:]
        shown = f"\n  output tail:\n{tail}" if tail and not self.traceback else ""
        return f"{head}: {why}{shown}"


class LaunchError(RuntimeError):
    """Some children failed; ``.results`` has every child's ``Result``."""

    def __init__(self, message: str, results: list[Result]):
        super().__init__(message)
        self.results = results


class LaunchTimeout(LaunchError, TimeoutError):
    """Some children were still running at the timeout and were killed."""


def _fn_ref(fn: Callable[..., Any] | str) -> dict[str, Any]:
    if isinstance(fn, str):
        module, sep, qualname = fn.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"fn {fn!r} must be 'module:qualname'")
        return {"module": module, "qualname": qualname, "file": None}
    name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not name or name == "__main__" or "<" in qualname:
        raise ValueError(f"launch needs a module-level function children can import by "
                         f"'module:qualname'; got {fn!r} (module {name!r}). Move it to a "
                         f"module, or pass 'module:qualname'")
    file = getattr(sys.modules.get(name), "__file__", None)
    return {"module": name, "qualname": qualname, "file": file}


def _child_env(role: Role, env: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(os.environ)
    out.update(env or {})
    if role.kind == "jax":
        if role.gpus is None:
            out["JAX_PLATFORMS"] = "cpu"
            out["JAX_NUM_CPU_DEVICES"] = str(role.num_devices)
        else:
            out.pop("JAX_PLATFORMS", None)
    if role.gpus is not None:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, role.gpus))
    out.update(dict(role.env))
    out["PYTHONUNBUFFERED"] = "1"
    return out


def _kill(proc: subprocess.Popen) -> None:
    """Kill the child and everything it started (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - _OUTPUT_TAIL, 0))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def launch(fn: Callable[..., Any] | str | Sequence[Callable[..., Any] | str],
           roles: Sequence[Role], *, timeout: float = 120.0,
           args: Sequence[Any] = (), env: Mapping[str, str] | None = None,
           world_id: str = "default", fail_fast: bool = True, grace: float = 2.0,
           check: bool = True, host: str = "127.0.0.1") -> list[Result]:
    """Run ``fn(ctx, *args)`` in one fresh process per role and collect the results.

    Args:
        fn: a module-level function, or ``"module:qualname"``; or a sequence of them, one
            per role (``launch([trainer, rollout, rollout], roles)``), so each role runs
            its own function.
        roles: one ``Role`` per child.
        timeout: seconds for all children together; then every child still running is
            killed (with its own children) and ``LaunchTimeout`` is raised.
        args: JSON-serializable extra arguments, the same for every child.
        env: extra environment variables for every child.
        world_id: the default world id of ``ctx.join()``.
        fail_fast: when a child fails, kill the others still running ``grace`` s later
            (they are usually blocked waiting on the failed one).
        grace: see ``fail_fast``.
        check: raise ``LaunchError`` when a child failed; else just return the results.
        host: the interface the rendezvous store listens on.

    Returns:
        One ``Result`` per role, in ``roles`` order.

    Raises:
        LaunchTimeout: children were still running at ``timeout`` (always raised).
        LaunchError: some children raised or crashed (when ``check``); the message lists
            them with their tracebacks.
    """
    from ..runtime.world import serve

    roles = list(roles)
    if isinstance(fn, (str, bytes)) or callable(fn):
        refs = [_fn_ref(fn)] * len(roles)
    else:
        refs = [_fn_ref(f) for f in fn]
        if len(refs) != len(roles):
            raise ValueError(f"launch got {len(refs)} functions for {len(roles)} roles: pass "
                             f"one function, or one per role")
    json_args = json.loads(json.dumps(list(args)))
    root = _package_root()
    results = [Result(role=r, launch_index=i) for i, r in enumerate(roles)]
    procs: list[subprocess.Popen] = []         # the children started so far, in role order
    with tempfile.TemporaryDirectory(prefix="xreshard-launch-") as tmp, serve(host) as server:
        try:
            for i, role in enumerate(roles):
                spec = {"fn": refs[i], "args": json_args, "address": server.address,
                        "role": role.to_json(), "launch_index": i,
                        "roles": [r.to_json() for r in roles], "world_id": world_id,
                        "result": os.path.join(tmp, f"result{i}.json"), "sys_path": sys.path}
                spec_path = os.path.join(tmp, f"spec{i}.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                with open(os.path.join(tmp, f"out{i}.txt"), "wb") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", _CHILD, root, spec_path],
                        env=_child_env(role, env), stdout=out, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True)
                procs.append(proc)
                results[i].pid = proc.pid
            _supervise(procs, results, timeout, fail_fast, grace)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    _kill(proc)
        for i, (proc, res) in enumerate(zip(procs, results)):
            res.returncode = proc.returncode
            res.output = _tail(os.path.join(tmp, f"out{i}.txt"))
            try:
                with open(os.path.join(tmp, f"result{i}.json")) as f:
                    got = json.load(f)
            except (OSError, ValueError):
                continue
            res.ok = bool(got["ok"]) and proc.returncode == 0
            res.value = got.get("value")
            res.traceback = got.get("traceback")

    timed_out = [r for r in results if r.timed_out]
    failed = [r for r in results if not r.ok and not r.timed_out]
    what = ", ".join(dict.fromkeys(_fn_name(ref) for ref in refs))
    if timed_out:
        raise LaunchTimeout(
            f"launch of {what}: {len(timed_out)} of {len(results)} children still "
            f"running after {timeout} s, killed:\n"
            + "\n".join(r.describe() for r in timed_out + failed), results)
    if failed and check:
        raise LaunchError(f"launch of {what}: {len(failed)} of {len(results)} "
                          f"children failed:\n" + "\n".join(r.describe() for r in failed),
                          results)
    return results


def _fn_name(ref: Mapping[str, Any]) -> str:
    return f"{ref['module']}:{ref['qualname']}"


def _supervise(procs: Sequence[subprocess.Popen], results: list[Result], timeout: float,
               fail_fast: bool, grace: float) -> None:
    deadline = time.monotonic() + timeout
    kill_at: float | None = None
    running = set(range(len(procs)))
    while running:
        for i in list(running):
            code = procs[i].poll()
            if code is not None:
                running.discard(i)
                if code != 0 and fail_fast and kill_at is None:
                    kill_at = time.monotonic() + grace
        now = time.monotonic()
        if running and now >= deadline:
            for i in running:
                results[i].timed_out = results[i].killed = True
                _kill(procs[i])
            return
        if running and kill_at is not None and now >= kill_at:
            for i in running:
                results[i].killed = True
                _kill(procs[i])
            return
        time.sleep(0.02)


# ---------------------------------------------------------------------- child side


def _load(ref: Mapping[str, Any]) -> Callable[..., Any]:
    try:
        module = importlib.import_module(ref["module"])
    except ImportError as e:
        if not ref.get("file"):
            raise
        spec = importlib.util.spec_from_file_location(ref["module"], ref["file"])
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load module {ref['module']!r} from {ref['file']!r}") from e
        module = importlib.util.module_from_spec(spec)
        sys.modules[ref["module"]] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def child_main(spec_path: str) -> int:
    """The child side of :func:`launch`: run the spec's function, write its JSON result."""
    with open(spec_path) as f:
        spec = json.load(f)
    sys.path[:] = list(spec["sys_path"]) + [p for p in sys.path if p not in spec["sys_path"]]
    try:
        fn = _load(spec["fn"])
        ctx = Context(address=spec["address"], role=Role.from_json(spec["role"]),
                      launch_index=spec["launch_index"], num_processes=len(spec["roles"]),
                      roles=tuple(Role.from_json(r) for r in spec["roles"]),
                      world_id=spec["world_id"])
        value = fn(ctx, *spec["args"])
        try:
            payload = json.dumps({"ok": True, "value": value})
        except (TypeError, ValueError) as e:
            raise TypeError(f"the launched function returned {type(value).__name__}, which is "
                            f"not JSON-serializable: {e}") from e
        code = 0
    except BaseException:  # noqa: BLE001 - report everything, even SystemExit, to the parent
        payload = json.dumps({"ok": False, "traceback": traceback.format_exc()})
        code = 1
    tmp = spec["result"] + ".tmp"
    with open(tmp, "w") as f:
        f.write(payload)
    os.replace(tmp, spec["result"])
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def run_child(spec_path: str) -> None:
    """A launched child's entry point: :func:`child_main`, then exit at once (a finished
    child must not hang in interpreter teardown on gloo threads)."""
    os._exit(child_main(spec_path))


if __name__ == "__main__":
    # Run through the canonical module so Role/Context are the classes users import.
    import xreshard.tools.launch as canonical

    canonical.run_child(sys.argv[1])
