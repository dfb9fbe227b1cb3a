"""NCCL communicators across epochs, without a GPU: what the loaded NCCL can do (read from
the real library, which loads without a GPU), ``ncclCommShrink`` marshalled through ctypes
(a fake of the C functions), and the nccl transport shrunk and then moving bytes over the
shrunk communicator (the fake CuPy of tests/fake_cupy.py, a fake NCCL binding that, as
NCCL, fills a shrunk communicator only at the outer group end). The GPU check
(scripts/gpu_check.sh, part a1_shrink: three processes, tests/test_gpu_probes.py) runs the
real shrink."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from xreshard.runtime.comm_epochs import decide
from xreshard.transport import nccl as nccl_module
from xreshard.transport import nccl_epochs, nccl_setup
from xreshard.transport.base import TransportError
from xreshard.transport.nccl_epochs import Library, RawComm, nccl_abilities

from . import fake_cupy


@pytest.mark.parametrize("version, missing, expected", [
    (23203, (), (True, True, True)),
    (22900, (), (True, True, True)),
    (22800, (), (True, False, True)),          # grow from 2.29
    (22700, (), (True, False, True)),          # shrink from 2.27
    (22600, (), (False, False, True)),
    (21700, (), (False, False, False)),        # split from 2.18
    (23203, ("ncclCommShrink",), (False, True, True)),      # the symbol decides too
    (23203, ("ncclCommGetUniqueId",), (True, False, True)),
])
def test_abilities_by_version_and_symbol(version, missing, expected):
    got = nccl_abilities(version, lambda name: name not in missing)
    assert (got.shrink, got.grow, got.split) == expected


def test_the_loaded_nccl_is_read_not_guessed():
    pytest.importorskip("cupy")
    from cupy.cuda import nccl
    library = nccl_epochs.loaded_library()
    assert library is not None
    assert library.version() == nccl.get_version()
    got = library.abilities()
    assert got == nccl_abilities(nccl.get_version(), library.has)
    if nccl.get_version() >= 22900:             # the installed 2.32 has all three
        assert got.shrink and got.grow and got.split
    with pytest.raises(TransportError, match=r"x failed: NCCL error 5 \(invalid usage"):
        library._check(5, "x")


class FakeLib:
    """The C functions ``Library`` and ``RawComm`` call, recording their arguments. As
    NCCL (``src/init.cc`` ``ncclCommInitChildComm``, ``src/group.cc``), a shrink inside a
    group leaves ``*newcomm`` NULL and fills it at the outer ``ncclGroupEnd``."""

    def __init__(self):
        self.calls = []
        self.async_status = 0
        self.depth = 0
        self.deferred = []

    def ncclGroupStart(self):
        self.depth += 1
        return 0

    def ncclGroupEnd(self):
        self.depth -= 1
        if self.depth == 0:
            for fill in self.deferred:
                fill()
            self.deferred.clear()
        return 0

    def ncclGetVersion(self, out):
        out._obj.value = 23203
        return 0

    def ncclGetErrorString(self, status):
        return b"fake error text"

    def ncclCommShrink(self, comm, ranks, count, new, config, flags):
        self.calls.append(("shrink", comm.value, list(ranks[:count.value]), config,
                           flags.value))
        holder, value = new._obj, 0x7000 + comm.value
        holder.value = None                         # NCCL_COMM_NULL until the init ran
        self.deferred.append(lambda: setattr(holder, "value", value))
        self.ncclGroupStart()                       # its own group: 1 -> 2 -> 1 in a group
        return self.ncclGroupEnd()

    def ncclCommGetUniqueId(self, comm, out):
        self.calls.append(("uid", comm.value))
        out._obj.raw = bytes(range(128))
        return 0

    def ncclCommGrow(self, comm, size, uid, rank, new, config):
        ident = None if uid is None else bytes(uid._obj.raw)
        self.calls.append(("grow", comm.value, size.value, ident, rank.value, config))
        new._obj.value = 0x9000 + (comm.value or 0x100 + rank.value)
        return 0

    def ncclSend(self, ptr, count, dtype, peer, comm, stream):
        self.calls.append(("send", count.value, peer.value, comm.value))
        return 0

    def ncclRecv(self, ptr, count, dtype, peer, comm, stream):
        self.calls.append(("recv", count.value, peer.value, comm.value))
        return 0

    def ncclCommGetAsyncError(self, comm, out):
        out._obj.value = self.async_status
        return 0

    def ncclCommAbort(self, comm):
        self.calls.append(("abort", comm.value))

    def ncclCommDestroy(self, comm):
        self.calls.append(("destroy", comm.value))


def test_shrink_passes_the_excluded_ranks_and_the_abort_flag():
    lib = FakeLib()
    library = Library(lib)
    comm = library.shrink(0x11, [2, 0], abort=True).result()   # outside a group: at once
    assert lib.calls == [("shrink", 0x11, [2, 0], None, 1)]     # NCCL_SHRINK_ABORT
    assert isinstance(comm, RawComm) and comm.comm == 0x7011
    library.shrink(0x12, [1], abort=False)
    assert lib.calls[-1][-1] == 0                                # NCCL_SHRINK_DEFAULT
    comm.send(1000, 64, 1, 3, 99)
    assert lib.calls[-1] == ("send", 64, 3, 0x7011)
    lib.async_status = 6
    with pytest.raises(TransportError, match="NCCL error 6 \\(fake error text\\)"):
        comm.check_async_error()
    comm.abort()
    comm.abort()                                # once only
    assert [c for c in lib.calls if c[0] == "abort"] == [("abort", 0x7011)]
    with pytest.raises(TransportError, match="destroyed communicator"):
        comm.send(1000, 64, 1, 3, 99)


class FakeComm:
    """CuPy's ``NcclCommunicator`` as the transport uses it."""

    def __init__(self, handle):
        self.comm = handle
        self.destroyed = self.aborted = False

    def check_async_error(self):
        pass

    def destroy(self):
        self.destroyed = True

    def abort(self):
        self.aborted = True


class _OnCuda(fake_cupy.ndarray):
    """A fake CuPy array that says, as CuPy's do, that it lives on a CUDA device."""

    def __dlpack_device__(self):
        return (2, self.device_id)


def _fake_binding(lib=None):
    """CuPy's NCCL module as the transport uses it; its group calls reach ``lib``'s (CuPy
    calls the loaded library's ncclGroupStart/End), so a deferred shrink fills there."""
    calls = []

    def start():
        calls.append("groupStart")
        if lib is not None:
            lib.ncclGroupStart()

    def end():
        calls.append("groupEnd")
        if lib is not None:
            lib.ncclGroupEnd()
    return calls, types.SimpleNamespace(groupStart=start, groupEnd=end,
                                        get_version=lambda: 23203)


def test_a_transport_shrunk_moves_bytes_over_the_new_communicator(monkeypatch):
    """Ranks 0 and 1 of this process (devices 0, 1) in a communicator of 3; rank 2's
    process died: both local ranks shrink in one NCCL group, and the shrunk transport
    (ranks 0..1) sends over the new communicator."""
    cupy = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    lib = FakeLib()
    calls, binding = _fake_binding(lib)     # shrunk communicators filled at groupEnd
    monkeypatch.setattr(nccl_module, "import_cupy", lambda: (cupy, binding))
    monkeypatch.setattr(nccl_epochs, "loaded_library", lambda: Library(lib))
    old = {0: FakeComm(0x10), 1: FakeComm(0x11)}
    t = nccl_module.NcclTransport(object(), 3, {0: 0, 1: 1}, key="k/0", comms=old)
    step = decide("nccl", ("a/0", "a/1", "b/0"), ("a/0", "a/1"), ("a/0", "a/1"),
                  Library(lib).abilities())
    assert (step.action, step.excluded, step.abort) == ("shrink", (2,), True)
    shrunk = t.shrunk(step.excluded, step.abort, "k/1", timeout=10)
    assert calls == ["groupStart", "groupEnd"]
    assert [c for c in lib.calls if c[0] == "shrink"] == [
        ("shrink", 0x10, [2], None, 1), ("shrink", 0x11, [2], None, 1)]
    # a member died: the parent is aborted, not destroyed (that could wait for the dead)
    assert all(c.aborted and not c.destroyed for c in old.values()) and not t.usable
    assert shrunk.world_size == 2 and shrunk.usable
    buf = fake_cupy.on_device(np.arange(8, dtype=np.uint8), 0).view(_OnCuda)
    with shrunk.group(timeout=10):
        shrunk.send(buf, 0, 1, tag=0)
    assert ("send", 8, 1, 0x7010) in lib.calls
    shrunk.close()
    assert ("destroy", 0x7010) in lib.calls and ("destroy", 0x7011) in lib.calls


def test_shrink_refused_where_the_loaded_nccl_cannot(monkeypatch):
    cupy = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    _, binding = _fake_binding()
    monkeypatch.setattr(nccl_module, "import_cupy", lambda: (cupy, binding))
    old_lib = FakeLib()
    old_lib.ncclGetVersion = lambda out: (setattr(out._obj, "value", 22600), 0)[1]
    monkeypatch.setattr(nccl_epochs, "loaded_library", lambda: Library(old_lib))
    t = nccl_module.NcclTransport(object(), 2, {0: 0}, key="k/2", comms={0: FakeComm(1)})
    with pytest.raises(TransportError, match="ncclCommShrink is not in the loaded NCCL"):
        t.shrunk([1], True, "k/3", timeout=10)
    t.close()


def test_grow_marshals_the_id_and_the_two_sides():
    lib = FakeLib()
    library = Library(lib)
    uid = library.unique_id(0x10)
    assert uid == bytes(range(128)) and lib.calls == [("uid", 0x10)]
    root = library.grow(0x10, 3, uid, -1)               # the member that made the id
    other = library.grow(0x11, 3, None, -1)             # another existing member
    new = library.grow(None, 3, uid, 2)                 # a new member: rank 2
    assert lib.calls[1:] == [("grow", 0x10, 3, uid, -1, None), ("grow", 0x11, 3, None, -1, None),
                             ("grow", None, 3, uid, 2, None)]
    assert (root.comm, other.comm, new.comm) == (0x9010, 0x9011, 0x9102)
    with pytest.raises(TransportError, match="128 bytes"):
        library.grow(None, 3, b"short", 2)


class _Store:
    """A dict as the rendezvous store (``set``/``get``/``check``)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_a_transport_grown_and_a_new_member_joining_it(monkeypatch):
    """Ranks 0 and 1 (this process's old communicator) grow to 3; rank 2 (a new member)
    joins through the id rank 0 made, in a thread as another process would: the old ranks
    keep their numbers, the new rank's grow gets the id and its rank, and both sides end
    with a transport of 3 ranks over the grown communicators."""
    import threading
    cupy = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    calls, binding = _fake_binding()
    monkeypatch.setattr(nccl_module, "import_cupy", lambda: (cupy, binding))
    monkeypatch.setattr(nccl_setup, "import_cupy", lambda: (cupy, binding))
    lib = FakeLib()
    monkeypatch.setattr(nccl_epochs, "loaded_library", lambda: Library(lib))
    store = _Store()
    old = {0: FakeComm(0x10), 1: FakeComm(0x11)}
    t = nccl_module.NcclTransport(store, 2, {0: 0, 1: 1}, key="k/0", comms=old)
    joined = {}
    th = threading.Thread(target=lambda: joined.setdefault("t", nccl_module.NcclTransport
                          .joined_by_grow(store, 3, {2: 1}, "k/1", timeout=10)))
    th.start()
    grown = t.grown(3, "k/1", timeout=10)
    th.join(10)
    uid = bytes(range(128))
    grows = sorted((c for c in lib.calls if c[0] == "grow"), key=lambda c: c[1] or 0)
    assert grows == [("grow", None, 3, uid, 2, None), ("grow", 0x10, 3, uid, -1, None),
                     ("grow", 0x11, 3, None, -1, None)]
    assert [c for c in lib.calls if c[0] == "uid"] == [("uid", 0x10)]   # rank 0 made it
    assert grown.world_size == 3 and joined["t"].world_size == 3 and not t.usable
    buf = fake_cupy.on_device(np.arange(8, dtype=np.uint8), 0).view(_OnCuda)
    with grown.group(timeout=10):
        grown.send(buf, 0, 2, tag=0)
    assert ("send", 8, 2, 0x9010) in lib.calls
    grown.close()
    joined["t"].close()


def test_an_epoch_that_adds_and_removes_members_shrinks_then_grows(monkeypatch):
    """``world_links._resize``: an old member shrinks the dead away, then grows; a new
    member only joins the grow; with the same key both sides meet."""
    from xreshard.runtime import world_links
    seen = []

    class Old:
        def shrunk(self, excluded, abort, key, wait):
            seen.append(("shrunk", tuple(excluded), abort, key))
            return self

        def grown(self, size, key, wait):
            seen.append(("grown", size, key))
            return "grown"
    monkeypatch.setattr(nccl_module.NcclTransport, "joined_by_grow",
                        classmethod(lambda cls, store, size, local, key, wait:
                                    ("joined", size, dict(local), key)))
    step = decide("nccl", ("a", "b", "c"), ("a", "b", "d"), ("a", "b", "d"),
                  nccl_abilities(23203, lambda name: True))
    assert (step.action, step.members, step.excluded, step.added) == (
        "shrink+grow", ("a", "b", "d"), (2,), ("d",))
    assert world_links._resize(step, Old(), {0: 0}, None, "w/e2/nccl", 5) == "grown"
    assert seen == [("shrunk", (2,), True, "w/e2/nccl/shrunk"), ("grown", 3, "w/e2/nccl")]
    assert world_links._resize(step, None, {2: 0}, None, "w/e2/nccl", 5) == (
        "joined", 3, {2: 0}, "w/e2/nccl")


def test_ctypes_arrays_hold_what_nccl_reads():
    ranks = (ctypes.c_int * 2)(3, 1)
    assert list(ranks) == [3, 1]


def _why_no_gpu() -> str | None:
    try:
        import cupy
        from cupy.cuda import nccl
        if not nccl.available or cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device or cannot load NCCL"
    except Exception as e:      # noqa: BLE001 - ImportError, CUDARuntimeError
        return f"no CUDA device here ({type(e).__name__}: {e})"
    if int(nccl.get_version()) < 23000:
        return "three ranks on one GPU need NCCL >= 2.30"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_why_no_gpu() is not None, reason=str(_why_no_gpu()))
def test_gpu_shrink_with_abort_then_bytes_cross_the_shrunk_communicator(monkeypatch):
    """One process, three ranks of one communicator on GPU 0 (NCCL >= 2.30 with
    NCCL_MULTI_RANK_GPU_ENABLE=1); rank 2 is shrunk away with NCCL_SHRINK_ABORT; ranks 0
    and 1 then exchange bytes over the shrunk communicator, bit-exact. Never ran on a GPU
    when written (no GPU in the session): scripts/gpu_check.sh's pytest_gpu part runs it."""
    dist = pytest.importorskip("torch.distributed")
    import datetime

    import cupy
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    t = nccl_module.NcclTransport(store, 3, {0: 0, 1: 0, 2: 0}, key="shrink/0", timeout=60)
    assert nccl_epochs.loaded_library().abilities().shrink
    step = decide("nccl", ("a", "b", "c"), ("a", "b"), ("a", "b"),
                  nccl_epochs.loaded_library().abilities())
    shrunk = t.shrunk(step.excluded, step.abort, "shrink/1", timeout=60)
    assert shrunk.world_size == 2 and not t.usable
    sent = cupy.arange(1 << 20, dtype=cupy.uint8) * 7
    got = cupy.zeros(1 << 20, dtype=cupy.uint8)
    with shrunk.group(timeout=60):
        shrunk.send(sent, 0, 1, tag=0)
        shrunk.recv(got, 0, 1, tag=0)
    assert bytes(got.get()) == bytes(sent.get())
    shrunk.close()


@pytest.mark.gpu
@pytest.mark.skipif(_why_no_gpu() is not None, reason=str(_why_no_gpu()))
def test_gpu_grow_then_bytes_reach_the_new_rank(monkeypatch):
    """One process, GPU 0: a communicator of ranks 0 and 1 grows to 3 (``ncclCommGrow``);
    rank 2 joins it from another thread, as a new member's process would; rank 0 then
    sends to rank 2 over the grown communicator, bit-exact. Never ran on a GPU when
    written (no GPU in the session): scripts/gpu_check.sh's pytest_gpu part runs it."""
    dist = pytest.importorskip("torch.distributed")
    import datetime
    import threading

    import cupy
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    if not nccl_epochs.loaded_library().abilities().grow:
        pytest.skip("the loaded NCCL has no ncclCommGrow (needs 2.29+)")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    t = nccl_module.NcclTransport(store, 2, {0: 0, 1: 0}, key="grow/0", timeout=60)
    joined, failed = {}, []

    def join():
        try:
            joined["t"] = nccl_module.NcclTransport.joined_by_grow(store, 3, {2: 0}, "grow/1",
                                                                   timeout=60)
        except Exception as e:      # noqa: BLE001 - reported by the assertion below
            failed.append(e)
    th = threading.Thread(target=join)
    th.start()
    grown = t.grown(3, "grow/1", timeout=60)
    th.join(60)
    assert not failed and "t" in joined, failed
    new = joined["t"]
    assert grown.world_size == new.world_size == 3 and not t.usable
    sent = cupy.arange(1 << 20, dtype=cupy.uint8) * 5
    got = cupy.zeros(1 << 20, dtype=cupy.uint8)
    done = threading.Thread(target=lambda: _recv_into(new, got))
    done.start()
    with grown.group(timeout=60):
        grown.send(sent, 0, 2, tag=0)
    done.join(60)
    assert bytes(got.get()) == bytes(sent.get())
    grown.close()
    new.close()


def _recv_into(transport, buf):
    with transport.group(timeout=60):
        transport.recv(buf, 0, 2, tag=0)
