"""NCCL communicators across epochs, without a GPU: what the loaded NCCL can do (read from
the real library, which loads without a GPU), ``ncclCommShrink`` marshalled through ctypes
(a fake of the C functions), and the nccl transport shrunk and then moving bytes over the
shrunk communicator (the fake CuPy of tests/fake_cupy.py, a fake NCCL binding). The GPU
check (scripts/gpu_check.sh, part h_nccl_shrink) runs the real shrink."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from xreshard.runtime.comm_epochs import decide
from xreshard.transport import nccl as nccl_module
from xreshard.transport import nccl_epochs
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
    """The C functions ``Library`` and ``RawComm`` call, recording their arguments."""

    def __init__(self):
        self.calls = []
        self.async_status = 0

    def ncclGetVersion(self, out):
        out._obj.value = 23203
        return 0

    def ncclGetErrorString(self, status):
        return b"fake error text"

    def ncclCommShrink(self, comm, ranks, count, new, config, flags):
        self.calls.append(("shrink", comm.value, list(ranks[:count.value]), config,
                           flags.value))
        new._obj.value = 0x7000 + comm.value
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
    comm = library.shrink(0x11, [2, 0], abort=True)
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


def _fake_binding():
    calls = []
    return calls, types.SimpleNamespace(
        groupStart=lambda: calls.append("groupStart"),
        groupEnd=lambda: calls.append("groupEnd"), get_version=lambda: 23203)


def test_a_transport_shrunk_moves_bytes_over_the_new_communicator(monkeypatch):
    """Ranks 0 and 1 of this process (devices 0, 1) in a communicator of 3; rank 2's
    process died: both local ranks shrink in one NCCL group, and the shrunk transport
    (ranks 0..1) sends over the new communicator."""
    cupy = fake_cupy.module()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    calls, binding = _fake_binding()
    monkeypatch.setattr(nccl_module, "import_cupy", lambda: (cupy, binding))
    lib = FakeLib()
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
