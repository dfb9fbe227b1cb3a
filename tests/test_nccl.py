"""The nccl transport and backend selection, on machines without a GPU.

What runs here without CUDA: NCCL's library loads, unique ids cross a real TCPStore between
two real processes, the rendezvous names missing ranks, the transport refuses clearly, the
selection rules and the wait loop's timeout/abort logic on fake events
and communicators. The CUDA paths are in test_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from xreshard.errors import RefitError
from xreshard.transport.base import TransportError, TransportTimeout
from xreshard.transport.nccl import (
    NcclTransport, NoCudaDeviceError, Post, _order_posts, rendezvous,
    wait_or_abort,
)
from xreshard.transport.select import select_backend

REPO = Path(__file__).resolve().parents[1]


def _cupy_gpu_count() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _store():
    dist = pytest.importorskip("torch.distributed")
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


# ---------------------------------------------------------------------------- import / library

def test_import_does_not_import_cupy_or_torch():
    code = ("import sys, xreshard.transport.nccl, xreshard.transport.select; "
            "print(sorted(m for m in ('cupy', 'torch', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_nccl_library_loads():
    pytest.importorskip("cupy")
    from cupy.cuda import nccl
    assert nccl.available
    version = nccl.get_version()
    assert version >= 21800, version            # p2p groups + abort + async errors
    uid = nccl.get_unique_id()                  # NCCL's bootstrap, no GPU needed
    assert len(uid) == 128


def test_missing_cupy_raises_import_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError, match=r"the nccl transport needs CuPy: "
                                          r"pip install 'xreshard\[gpu-cu1[23]\]"):
        NcclTransport(object(), 1, {0: 0})


@pytest.mark.skipif(_cupy_gpu_count() > 0, reason="a CUDA device is visible here")
def test_refuses_without_gpu():
    pytest.importorskip("cupy")
    with pytest.raises(NoCudaDeviceError,
                       match=r"^the nccl transport needs a CUDA device, but no CUDA device is "
                             r"visible to this process \(.+\) - run it on a GPU host, or use "
                             r"the gloo transport for CPU ranks"):
        NcclTransport(object(), 1, {0: 0})
    assert issubclass(NoCudaDeviceError, RefitError)


# ---------------------------------------------------------------------------- rendezvous

_CHILD = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    from torch.distributed import TCPStore
    from xreshard.transport.nccl import rendezvous
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    uid = rendezvous(store, "test/nccl/0", 2, [rank], timeout=30)
    print(json.dumps({"rank": rank, "id": uid.hex()}))
""")


def test_unique_id_crosses_tcpstore_between_two_processes():
    pytest.importorskip("cupy")
    store = _store()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(store.port), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=REPO)
             for rank in (1, 0)]              # the receiver starts first and waits
    seen = {}
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            line = json.loads(out.strip().splitlines()[-1])
            seen[line["rank"]] = line["id"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert seen[0] == seen[1]
    assert len(bytes.fromhex(seen[0])) == 128
    record = json.loads(store.get("test/nccl/0/id"))      # JSON text in the store, not pickle
    assert record["nccl_unique_id"] == seen[0]
    assert record["world_size"] == 2
    assert record["nccl_version"] > 0


def test_rendezvous_names_ranks_that_never_arrive():
    store = _store()
    start = time.monotonic()
    with pytest.raises(TransportTimeout,
                       match=r"nccl rendezvous 'k' on rank\(s\) \[0, 2\] timed out after 0.5 s: "
                             r"rank\(s\) \[1, 3\] never arrived - start the processes hosting "
                             r"them"):
        rendezvous(store, "k", 4, [0, 2], timeout=0.5, make_id=lambda: os.urandom(128))
    assert time.monotonic() - start < 3.0


def test_rendezvous_without_rank0_names_the_missing_id():
    store = _store()
    with pytest.raises(TransportTimeout,
                       match=r"on rank\(s\) \[1\] timed out after 0.3 s: the process hosting "
                             r"rank 0 never published the NCCL unique id \(store key 'k/id'\)"):
        rendezvous(store, "k", 2, [1], timeout=0.3)


def test_rendezvous_refuses_another_world_size():
    store = _store()
    store.set("k/id", json.dumps({"nccl_unique_id": "00" * 128, "world_size": 4,
                                  "nccl_version": 0}))
    with pytest.raises(RefitError, match=r"rank 0 made the communicator for 4 ranks, but ranks "
                                         r"\[1\] expect 2"):
        rendezvous(store, "k", 2, [1], timeout=1)


def test_rendezvous_single_process_hosting_every_rank():
    store = _store()
    uid = rendezvous(store, "k", 2, [0, 1], timeout=2, make_id=lambda: bytes(range(128)))
    assert uid == bytes(range(128))


# ---------------------------------------------------------------------------- waiting, abort

class FakeEvent:
    def __init__(self, done_after: float | None):
        self.t_done = None if done_after is None else time.monotonic() + done_after

    @property
    def done(self) -> bool:
        return self.t_done is not None and time.monotonic() >= self.t_done


class FakeComm:
    def __init__(self, fail_after: float | None = None):
        self.t_fail = None if fail_after is None else time.monotonic() + fail_after
        self.aborted = False

    def check_async_error(self) -> None:
        if self.t_fail is not None and time.monotonic() >= self.t_fail:
            raise RuntimeError("NCCL_ERROR_REMOTE_ERROR: remote process exited")

    def abort(self) -> None:
        self.aborted = True


POSTS = [Post("send", 0, 1, 7, 4096), Post("recv", 2, 0, 8, 512)]


def _wait(events, comms, timeout):
    def abort():
        for c in comms:
            c.abort()
        return "The communicator was aborted."
    wait_or_abort(events, comms, POSTS, where="rank(s) [0] (CUDA device(s) [0])",
                  stage="the transfers ran on the GPU", timeout=timeout,
                  deadline=time.monotonic() + timeout, abort=abort)


def test_missing_peer_times_out_naming_peers_and_tags_and_aborts():
    comm = FakeComm()
    start = time.monotonic()
    with pytest.raises(TransportTimeout) as info:
        _wait([FakeEvent(None), FakeEvent(0.0)], [comm], timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 0.2 + 5      # bounded by the timeout (+ slack for a loaded box)
    assert comm.aborted
    msg = str(info.value)
    assert msg.startswith("nccl group on rank(s) [0] (CUDA device(s) [0]) timed out after 0.2 s "
                          "while the transfers ran on the GPU; still waiting for: send to rank 1 "
                          "tag 7 (4096 B), recv from rank 2 tag 8 (512 B). Peer rank(s) [1, 2] "
                          "did not post the matching sends/receives, or died. The communicator "
                          "was aborted.")
    assert isinstance(info.value, TimeoutError)


def test_async_error_aborts_and_raises_transport_error():
    comm = FakeComm(fail_after=0.05)
    with pytest.raises(TransportError, match=r"failed while the transfers ran on the GPU: NCCL "
                                             r"reported an asynchronous error \(NCCL_ERROR_REMOTE"):
        _wait([FakeEvent(None)], [comm], timeout=5.0)
    assert comm.aborted


def test_completed_group_returns_without_abort():
    comm = FakeComm()
    _wait([FakeEvent(0.05), FakeEvent(0.01)], [comm], timeout=5.0)
    assert not comm.aborted


def test_long_post_lists_are_shortened():
    posts = [Post("send", 0, 1, t, 1) for t in range(20)]
    with pytest.raises(TransportTimeout, match=r"tag 7 \(1 B\) and 12 more\. Peer rank\(s\) \[1\]"):
        wait_or_abort([FakeEvent(None)], [], posts, where="w", stage="s", timeout=0.0,
                      deadline=time.monotonic(), abort=lambda: "")


# ---------------------------------------------------------------------------- issue order

def test_posts_issue_in_peer_then_tag_order():
    posts = [Post("recv", 3, 0, 5, 1), Post("send", 0, 3, 9, 1), Post("send", 0, 1, 2, 1),
             Post("send", 0, 3, 1, 1), Post("recv", 1, 0, 0, 1)]
    order = _order_posts(posts, [0], 4)
    assert [(posts[i].peer, posts[i].tag) for i in order] == [(1, 0), (1, 2), (3, 1), (3, 5),
                                                              (3, 9)]


@pytest.mark.parametrize("post, match", [
    (Post("send", 1, 0, 0, 1), r"the sender rank 1 is not hosted by this transport"),
    (Post("recv", 0, 2, 0, 1), r"the receiver rank 2 is not hosted"),
    (Post("send", 0, 9, 0, 1), r"rank 9 is not in the communicator \(ranks 0..3\)"),
    (Post("send", 0, 1, -1, 1), r"tags are non-negative ints"),
])
def test_bad_posts_are_refused(post, match):
    with pytest.raises(RefitError, match=match):
        _order_posts([post], [0], 4)


def test_duplicate_posts_are_refused():
    with pytest.raises(RefitError, match=r"send to rank 1 tag 3 \(1 B\) is posted twice in one "
                                         r"group"):
        _order_posts([Post("send", 0, 1, 3, 1), Post("send", 0, 1, 3, 1)], [0], 2)


# ---------------------------------------------------------------------------- selection

@pytest.mark.parametrize("kinds, requested, expected", [
    (["cuda"] * 4, "auto", "nccl"),
    (["cuda"] * 4, "nccl", "nccl"),
    (["cpu"] * 3, "auto", "gloo"),
    (["cpu"], "gloo", "gloo"),
])
def test_select_backend(kinds, requested, expected):
    assert select_backend(kinds, requested) == expected


def test_mixed_world_is_refused_with_the_ranks_of_each_kind():
    kinds = ["cuda", "cuda", "cuda", "cpu", "cpu", "cuda", "cpu"]
    with pytest.raises(RefitError,
                       match=r"^mixed world: ranks 0-2, 5 are 'cuda'; ranks 3-4, 6 are 'cpu'\. "
                             r"One world moves bytes over one transport - put every rank on a "
                             r"GPU \(nccl\) or every rank on the CPU \(gloo\)"):
        select_backend(kinds)
    with pytest.raises(RefitError, match=r"^mixed world \('nccl' requested\): ranks 0 are "
                                         r"'cuda'; ranks 1 are 'cpu'"):
        select_backend(["cuda", "cpu"], "nccl")


def test_impossible_requests_are_refused():
    with pytest.raises(RefitError, match=r"^transport 'nccl' moves 'cuda' buffers, but ranks 0-1 "
                                         r"are 'cpu' - request 'gloo' or 'auto' for this world$"):
        select_backend(["cpu", "cpu"], "nccl")
    with pytest.raises(RefitError, match=r"^transport 'gloo' moves 'cpu' buffers, but ranks 0 "
                                         r"are 'cuda' - request 'nccl' or 'auto'"):
        select_backend(["cuda"], "gloo")


def test_unknown_kinds_requests_and_empty_worlds_are_refused():
    with pytest.raises(RefitError, match=r"unsupported device kind\(s\): ranks 1 are 'gpu' - "
                                         r".*JAX's platform 'gpu' is 'cuda' here"):
        select_backend(["cuda", "gpu"])
    with pytest.raises(RefitError, match=r"unknown transport backend 'mpi': expected 'auto', "
                                         r"'nccl', 'gloo'"):
        select_backend(["cuda"], "mpi")
    with pytest.raises(RefitError, match=r"without ranks"):
        select_backend([])
