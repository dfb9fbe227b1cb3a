"""Scenarios that need the host's isolation features: another user's names in
``/dev/shm``, a pid namespace, a process others may not read. Used by test_shm_trust.py.

``run_isolated`` runs a scenario of this module in a fresh mount namespace with a private
``/dev/shm`` (a tmpfs owned by ``nobody``, mode 1777, like the host's) and the chosen
capabilities dropped from the process (``setpriv``): without ``CAP_FOWNER`` and
``CAP_DAC_OVERRIDE``, root meets another user's names exactly as an ordinary user does
(``EEXIST`` creating, ``EACCES`` opening, ``EPERM`` unlinking). The other user is real: a
child forked as ``nobody``. A scenario prints one JSON line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOBODY = 65534
SHAPE = (256, 128)


def run_isolated(scenario: str, *args: Any, drop: str = "fowner,dac_override",
                 timeout: float = 300) -> dict:
    """Run ``scenario(*args)`` of this module isolated (see the module); its JSON result.
    Skips the calling test, with the reason, where the host cannot isolate."""
    import pytest
    if os.geteuid() != 0:
        pytest.skip("needs root: a private /dev/shm (unshare --mount) and a second uid")
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs util-linux's {tool}")
    caps = ",".join(f"-{c}" for c in drop.split(","))
    inner = (f"mount -t tmpfs -o mode=1777,uid={NOBODY},gid={NOBODY} xrtest /dev/shm && "
             f"exec setpriv --bounding-set={caps} {sys.executable} -m tests.isolated "
             f"{scenario} '{json.dumps(list(args))}'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", inner], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 and not lines:
        if "unshare failed" in proc.stderr or "mount:" in proc.stderr:
            pytest.skip(f"cannot isolate here: {proc.stderr.strip()[-300:]}")
        raise AssertionError(f"scenario {scenario} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------- another user

@contextlib.contextmanager
def as_nobody(fn: Any, *args: Any) -> Iterator[int]:
    """Run ``fn(*args)`` in a child forked as ``nobody`` (everything it uses is imported
    here first: nobody cannot read this interpreter's files); killed on exit."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn(*args)
        finally:
            os._exit(0)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _create(name: str) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))


def nobody_creates(names: list[str]) -> None:
    """``nobody`` creates ``names`` in /dev/shm; returns once they exist."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for name in names:
                _create(name)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def squatter(ready: int) -> None:
    """Watch /dev/shm (inotify) and, for every probe name a world shows there, create the
    segment names derived from it (``xr<token>_<process>_<kind><n>``) before the world
    does: what any local user could do to today's names."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    libc.inotify_add_watch(fd, b"/dev/shm", 0x100)      # IN_CREATE
    os.write(ready, b"1")
    while True:
        data = os.read(fd, 65536)
        off = 0
        while off < len(data):
            _, _, _, length = struct.unpack_from("iIII", data, off)
            name = data[off + 16:off + 16 + length].split(b"\0", 1)[0].decode()
            off += 16 + length
            if name.startswith("xrp"):
                token = name[3:]
                for p in range(4):
                    for kind in ("p", "s"):
                        for n in range(1, 25):
                            _create(f"xr{token}_{p}_{kind}{n}")


def names_by_owner() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"ours": [], "foreign": []}
    for name in os.listdir("/dev/shm"):
        with contextlib.suppress(OSError):
            owner = os.stat(f"/dev/shm/{name}").st_uid
            out["ours" if owner == os.geteuid() else "foreign"].append(name)
    return out


def _values(step: int) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + 1000 * step)


def refit_pair(ctx: Any, steps: int, transport: str, nondumpable: bool) -> dict:
    """trainer[0] sends ``w`` to rollout[0] ``steps`` times; the receiver checks each."""
    import xreshard as xr
    if nondumpable and ctx.role.group == "trainer":
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)          # PR_SET_DUMPABLE 0
    out: dict = {"exact": [], "error": None}
    config = xr.RefitConfig(timeout=30, transport=transport)
    with ctx.join(1, timeout=60) as world:
        rank = world.rank_ids[0]
        src = world.group_ranks("trainer")[0]
        if ctx.role.group == "trainer":
            lay = xr.Layout.replicated(SHAPE, "float32", xr.Mesh((1,), (rank,)))
            refit = xr.Refit(world, config=config)
            side = (lambda s: {"send": xr.Bound({"w": lay}, {(rank, "w"): _values(s)})})
        else:
            dest = np.zeros(SHAPE, np.float32)
            lay = xr.Layout.explicit_form(SHAPE, "float32",
                                          {rank: [[(0, SHAPE[0]), (0, SHAPE[1])]]})
            refit = xr.Refit(world, receive=xr.Bound({"w": lay}, {(rank, "w"): [dest]},
                                                     local_only={"w"}), config=config)
            side = (lambda s: {})
        try:
            for step in range(steps):
                refit(**side(step))
                if ctx.role.group != "trainer":
                    out["exact"].append(dest.tobytes() == _values(step).tobytes())
        except Exception as e:      # noqa: BLE001 - the test reads what was raised
            out["error"] = f"{type(e).__name__}: {e}"[:1500]
        t = world.transport(transport)
        shm = getattr(t, "parts", {}).get("shm", t if t.name == "shm" else None)
        out["pulled"] = getattr(shm, "bytes_pulled", None)
        out["copied_in"] = getattr(shm, "bytes_copied_in", None)
        out["route"] = world.route(src, world.group_ranks("rollout")[0])
    return out


def squat(steps: int) -> dict:
    """17.4: another user pre-creates every name derived from the probes it sees."""
    from xreshard.tools.launch import Role, launch
    r, w = os.pipe()
    with as_nobody(squatter, w):
        os.read(r, 1)
        roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0)]
        results = launch("tests.isolated:refit_pair", roles, args=(steps, "shm", False),
                         timeout=200, check=False, env={"XRESHARD_SHM_PULL": "0"})
        values = [res.value if res.ok else {"error": res.describe()[-1500:]}
                  for res in results]
    return {"values": values, "names": names_by_owner()}


def pull_refused(steps: int) -> dict:
    """17.6: the sender is not dumpable and nobody has CAP_SYS_PTRACE (what Yama's
    ptrace_scope=1 does to sibling processes): its memory cannot be read in place."""
    from xreshard.tools.launch import Role, launch
    roles = [Role("plain", "trainer", 0), Role("plain", "rollout", 0)]
    results = launch("tests.isolated:refit_pair", roles, args=(steps, "shm", True),
                     timeout=200, check=False)
    return {"values": [res.value if res.ok else {"error": res.describe()[-1500:]}
                       for res in results]}


def _pair_here(tag: str) -> tuple[Any, Any, Any]:
    """Two shm transports of "processes" 0 and 1 in this process over a real store."""
    import datetime
    from torch.distributed import TCPStore
    from xreshard.transport.shm import ShmTransport
    server = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                      wait_for_workers=False)

    def client():
        return TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10),
                        wait_for_workers=False)
    pids = {0: (os.getpid(), None), 1: (os.getpid(), None)}
    a = ShmTransport(client(), "t", tag, (0, 0, 1), 0, [1], pids=pids, connect=client)
    b = ShmTransport(client(), "t", tag, (0, 0, 1), 1, [0], pids=pids, connect=client)
    return a, b, server


def _together(*fns: Any) -> list[BaseException | None]:
    """Run ``fns`` at once (the two sides of an exchange); what each raised, or None."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.exception(timeout=60) for f in futures]


def foreign_names() -> dict:
    """17.4 and 17.12 in one process: another user owns (a) the exact name the sender
    draws first and (b) names under this world's prefix; then a receiver fails."""
    import xreshard.transport.shm as shm_mod
    tag = "f00d" * 4
    first = "ab" * 8
    nobody_creates([f"xr{tag}_0_p1_{first}", f"xr{tag}_1_zz", f"xr{tag}_0_zz"])
    draws = iter([first])
    real = getattr(shm_mod, "_random_part", None)
    if real is not None:        # the sender's first draw is the name nobody took
        shm_mod._random_part = lambda: next(draws, None) or real()
    a, b, server = _pair_here(tag)
    payload = np.arange(4096, dtype=np.uint8)
    got = np.zeros(4096, np.uint8)

    def send(n: int) -> None:
        with a.group(10):
            a.send(payload[:n], 0, 2, 0)

    def recv(n: int) -> None:
        with b.group(10):
            b.recv(got[:n], 0, 2, 0)
    ok = _together(lambda: send(4096), lambda: recv(4096))
    exact = got.tobytes() == payload.tobytes()
    bad = _together(lambda: send(100), lambda: recv(99))    # the receiver's real error
    for t in (a, b):
        with contextlib.suppress(Exception):
            t.close()
    del server
    return {"ok": [None if x is None else f"{type(x).__name__}: {x}" for x in ok],
            "exact": exact,
            "bad": [None if x is None else [type(x).__name__, str(x)] for x in bad],
            "names": names_by_owner()}


# ---------------------------------------------------------------------------- pid namespaces

def pidns_receiver(ctx: Any, steps: int, mount_proc: bool) -> dict:
    """rollout[0] runs in a new pid namespace (``unshare --pid --fork``), sharing this
    host's /dev/shm, network and (without ``--mount-proc``) its /proc."""
    cmd = ["unshare", "--pid", "--fork"] + (["--mount-proc"] if mount_proc else []) + [
        sys.executable, "-m", "tests.isolated", "pidns_inner",
        json.dumps([ctx.address, steps])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(lines[-1])


def pidns_inner(address: str, steps: int) -> dict:
    from xreshard.tools.launch import Context, Role
    role = Role("plain", "rollout", 0)
    ctx = Context(address=address, role=role, launch_index=1, num_processes=2,
                  roles=(Role("plain", "trainer", 0), role))
    out = refit_pair(ctx, steps, "auto", False)
    out["pid"] = os.getpid()
    return out


def slow_trainer(ctx: Any, steps: int, mount_proc: bool) -> dict:
    """trainer[0], sleeping before each call so the receiver's waits pass the watcher's
    quarter second."""
    import xreshard.runtime.refit as refit_mod
    real = refit_mod.Refit.__call__

    def late(self: Any, *a: Any, **kw: Any) -> Any:
        time.sleep(1.0)
        return real(self, *a, **kw)
    refit_mod.Refit.__call__ = late
    return refit_pair(ctx, steps, "auto", False)


def _main() -> None:
    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    result = globals()[scenario](*args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()
