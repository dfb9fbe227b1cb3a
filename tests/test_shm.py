"""The shm transport: byte-exact moves through POSIX shared memory, segment reuse and
cleanup, refusals, per-pair "auto" routing, and refits between real processes (JAX <-> torch
over shm, a peer killed mid-refit leaving nothing in /dev/shm)."""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import signal
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from xreshard.errors import RefitError
from xreshard.tools.launch import Context, Role, launch
from xreshard.transport.base import TransportError, TransportTimeout
from xreshard.transport.select import choose_routes
from xreshard.transport.shm import ShmTransport, shm_names

from . import refit_cases as cases

torch = pytest.importorskip("torch")

# ---------------------------------------------------------------------- in one process


def _store() -> Any:
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                    wait_for_workers=False)


def _pair(rank_process=(0, 0, 1), tag=None, **kw) -> tuple[ShmTransport, ShmTransport, str]:
    """Two transports of "processes" 0 and 1 in this process (their groups run in threads)."""
    from torch.distributed import TCPStore
    server = _store()

    def client():
        return TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10),
                        wait_for_workers=False)
    tag = tag or secrets.token_hex(5)
    pids = kw.pop("pids", {0: (os.getpid(), None), 1: (os.getpid(), None)})
    pulls = kw.pop("pulls", False)
    a = ShmTransport(client(), "t", tag, rank_process, 0, [1], pids=pids, connect=client,
                     pull_peers=[1] if pulls else [], **kw)
    b = ShmTransport(client(), "t", tag, rank_process, 1, [0], pids=pids, connect=client,
                     pull_peers=[0] if pulls else [], **kw)
    a._keep_store = b._keep_store = server      # noqa: SLF001 - keep the server alive
    return a, b, f"xr{tag}_"


@contextlib.contextmanager
def _pair_cleaned(**kw) -> Iterator[tuple[ShmTransport, ShmTransport, str]]:
    """``_pair``, closed on the way out; then no segment of theirs is left in /dev/shm."""
    a, b, prefix = _pair(**kw)
    try:
        yield a, b, prefix
    finally:
        a.close()
        b.close()
    assert shm_names(prefix) == []


def _both(fa, fb) -> list[Any]:
    """Run ``fa`` here and ``fb`` in a thread; return both results (or raise fa's error)."""
    out: list[Any] = [None, None]

    def run_b():
        try:
            out[1] = fb()
        except BaseException as e:   # noqa: BLE001 - handed back to the test
            out[1] = e
    t = threading.Thread(target=run_b)
    t.start()
    try:
        out[0] = fa()
    except BaseException as e:       # noqa: BLE001
        out[0] = e
    t.join(30)
    assert not t.is_alive()
    return out


def _data(src: int, dst: int, tag: int, n: int | None = None) -> np.ndarray:
    n = n if n is not None else (1 + (src * 7919 + dst * 104729 + tag * 1299709) % 50000)
    return np.random.default_rng([src, dst, tag]).integers(0, 256, n, dtype=np.uint8)


def _round(t: ShmTransport, me: set[int], peers: set[int], tags, sizes=None, timeout=10,
           torch_every=3, alloc=None) -> dict:
    got = {}
    off = 0
    with t.group(timeout):
        for src in sorted(peers):
            for dst in sorted(me):
                for tag in tags:
                    n = _data(src, dst, tag, None if sizes is None else sizes(tag)).size
                    buf = np.zeros(n, np.uint8) if tag % torch_every else torch.zeros(
                        n, dtype=torch.uint8)
                    got[(src, dst, tag)] = buf
                    t.recv(buf, src, dst, tag)
        for src in sorted(me):
            for dst in sorted(peers):
                for tag in tags:
                    d = _data(src, dst, tag, None if sizes is None else sizes(tag))
                    if alloc is not None and tag % 2:
                        staged = alloc[off:off + d.size]
                        off += d.size
                        staged[...] = d
                        d = staged
                    t.send(d if tag % 2 else torch.from_numpy(d.copy()), src, dst, tag)
    return {k: bool(np.array_equal(np.asarray(v), _data(*k, None if sizes is None else
                                                        sizes(k[2])))) for k, v in got.items()}


@pytest.mark.parametrize("pull", [False, True], ids=["copy", "pull"])
def test_exchange_both_ways_byte_exact_reuses_segments_and_leaves_nothing(pull):
    with _pair_cleaned(rank_process=(0, 0, 1, 1), pulls=pull) as (a, b, prefix):
        names = []
        for step in range(3):
            ra, rb = _both(lambda: _round(a, {0, 1}, {2, 3}, range(6)),
                           lambda: _round(b, {2, 3}, {0, 1}, range(6)))
            assert not isinstance(ra, BaseException), ra
            assert not isinstance(rb, BaseException), rb
            assert all(ra.values()) and all(rb.values()) and len(ra) == len(rb) == 24
            names.append(sorted(s.name for s in [*a._out.values(), *b._out.values()]))
        if pull:    # read in place from the sender's memory: no segment, no sender copy
            assert names[2] == [] and a.bytes_copied_in == b.bytes_copied_in == 0
            assert a.bytes_pulled == a.bytes_received > 0
        else:       # the first round spills into fresh segments; then one per pair, reused
            assert names[1] == names[2] and len(names[2]) == 2 and a.bytes_pulled == 0
        # receivers unlinked the pair segments as soon as they mapped them
        assert shm_names(prefix) == []
        assert a.bytes_received > 0 and b.bytes_received > 0


def test_growing_messages_spill_then_settle_and_zero_sizes():
    with _pair_cleaned() as (a, b, prefix):
        for n in (1000, 5000, 5000, 0, 200000, 200000):
            sizes = (lambda tag, n=n: n)
            ra, rb = _both(lambda: _round(a, {0, 1}, {2}, range(3), sizes),
                           lambda: _round(b, {2}, {0, 1}, range(3), sizes))
            assert all(ra.values()) and all(rb.values()), (n, ra, rb)
        assert len(a._out) == 1 and a._out[1].size >= 6 * 200000


def test_staging_from_alloc_is_exposed_in_place():
    with _pair_cleaned() as (a, b, prefix):
        stage = a.alloc(1 << 20)
        assert stage.nbytes == 1 << 20
        assert len(shm_names(prefix)) == 1        # read by several peers: named until close
        sizes = (lambda tag: 4096)
        ra, rb = _both(lambda: _round(a, {0, 1}, {2}, [1], sizes, alloc=stage),
                       lambda: _round(b, {2}, {0, 1}, [1], sizes))
        assert all(ra.values()) and all(rb.values())
        assert a.bytes_in_place == 2 * 4096 and a.bytes_copied_in == 0


def test_mismatched_size_and_misuse_raise_and_clean_up():
    a, b, prefix = _pair()

    def send():
        with a.group(5):
            a.send(np.ones(100, np.uint8), 0, 2, 0)

    def recv():
        with b.group(5):
            b.recv(np.zeros(99, np.uint8), 0, 2, 0)
    ra, rb = _both(send, recv)
    assert isinstance(rb, TransportError) and "sender posted 100 bytes" in str(rb)
    assert "receive buffer has 99" in str(rb)
    assert isinstance(ra, (TransportError, TransportTimeout))     # never acknowledged
    assert shm_names(prefix) == []
    with pytest.raises(TransportError, match="unusable"):
        with b.group(1):
            pass
    c, d, _ = _pair()
    with pytest.raises(TransportError, match="outside"):
        c.send(np.ones(4, np.uint8), 0, 2, 0)
    with pytest.raises(TransportError, match="both in this process"):
        with c.group(1):
            c.send(np.ones(4, np.uint8), 0, 1, 0)
    with pytest.raises(TransportError, match="posted twice"):
        with d.group(1):
            d.recv(np.ones(4, np.uint8), 0, 2, 0)
            d.recv(np.ones(4, np.uint8), 0, 2, 0)
    e, f, _ = _pair()
    with pytest.raises(TransportError, match="contiguous buffers"):
        with f.group(1):
            f.recv(np.zeros((4, 4), np.uint8)[:, 1], 0, 2, 0)
    for t in (a, b, c, d, e, f):
        t.close()


@pytest.mark.parametrize("pull", [False, True], ids=["copy", "pull"])
def test_a_receive_lands_in_a_destinations_strided_rows(pull):
    """A receive posted as a destination's region (the left or right half of each row of a
    row-parallel torch shard: ``takes_views``) gets the message's bytes in the rows' C
    order, bit for bit, pulled with a local iovec per row (2,100 rows: more than the 1,024
    iovecs one ``process_vm_readv`` takes) or copied out of the sender's segment; the
    rest of each row is untouched and no staging is involved."""
    rows, half = 2100, 37                           # odd row bytes: 74
    shard = torch.full((rows, 2 * half), -7, dtype=torch.int16)
    left, right = shard.numpy()[:, :half], shard.numpy()[:, half:]
    cube = np.full((3, 5, 8), 9, np.float32)         # a 3-d region: [1:3, :, 2:6]
    region = cube[1:3, :, 2:6]
    msgs = {0: _data(0, 2, 0, left.nbytes), 1: _data(0, 2, 1, region.nbytes)}
    with _pair_cleaned(pulls=pull) as (a, b, prefix):
        assert b.takes_views(0, 2) and b.takes_views(1, 2)
        assert not b.takes_views(2, 0) and not a.takes_views(0, 1) and not b.takes_views(0, 9)

        def send():
            with a.group(20):
                for tag, d in msgs.items():
                    a.send(d, 0, 2, tag)

        def recv():
            with b.group(20):
                b.recv(left, 0, 2, 0)
                b.recv(region, 0, 2, 1)
        ra, rb = _both(send, recv)
        assert ra is None and rb is None, (ra, rb)
        assert left.tobytes() == msgs[0].tobytes() and region.tobytes() == msgs[1].tobytes()
        assert (right == -7).all() and (cube[0] == 9).all() and (cube[1:, :, :2] == 9).all()
        assert (cube[1:, :, 6:] == 9).all()
        assert b.bytes_into_rows == left.nbytes + region.nbytes
        assert b.bytes_pulled == (b.bytes_received if pull else 0)


def test_pull_rows_splits_at_iov_max_and_goes_on_after_short_reads(monkeypatch):
    """``pull_rows`` hands the kernel at most IOV_MAX local iovecs per call and, when a
    call lands fewer bytes than asked (the kernel stops at a fault or its per-call limit),
    goes on from the byte it stopped at, also inside a row."""
    import ctypes

    from xreshard.transport import shm_memory as sm
    fn, iovec, _ = sm._process_vm_readv()
    counts: list[int] = []

    def short(pid, local, n_local, remote, n_remote, flags):
        """process_vm_readv of this process that lands at most 1,000 bytes a call."""
        counts.append(n_local)
        assert n_remote == 1
        src, budget, done = remote._obj.iov_base, min(remote._obj.iov_len, 1000), 0
        for i in range(n_local):
            take = min(local[i].iov_len, budget - done)
            ctypes.memmove(local[i].iov_base, src + done, take)
            done += take
            if done == budget:
                break
        return done
    monkeypatch.setattr(sm, "_CMA", (short, iovec, ctypes))
    wide = np.zeros((3000, 41), np.uint8)
    rows = wide[:, 3:40]                        # 37 bytes a row: reads stop inside rows
    msg = _data(0, 1, 0, rows.nbytes)
    sm.pull_rows(os.getpid(), sm.row_runs(rows), int(msg.ctypes.data), msg.nbytes)
    assert rows.tobytes() == msg.tobytes() and not wide[:, :3].any() and not wide[:, 40].any()
    assert max(counts) <= sm.IOV_MAX and len(counts) >= msg.nbytes // 1000
    monkeypatch.setattr(sm, "_CMA", (fn, iovec, ctypes))
    counts.clear()
    big = np.zeros((2500, 8), np.uint16)[:, 2:5]     # the real call, 2,500 rows
    want = _data(0, 1, 1, big.nbytes)
    sm.pull_rows(os.getpid(), sm.row_runs(big), int(want.ctypes.data), want.nbytes)
    assert big.tobytes() == want.tobytes()


def test_a_pulling_receiver_reads_while_the_sender_still_posts():
    """Records to a pulling peer go out in batches as the sends are posted: the receiver
    lands the first messages while the sender's group is still open (it used to see none
    before the sender's group exit), and every byte is exact."""
    big = [_data(0, 2, tag, 3 << 20) for tag in range(3)]
    landed = threading.Event()
    seen: list[int] = []
    with _pair_cleaned(pulls=True) as (a, b, prefix):
        def send():
            with a.group(20):
                a.send(big[0], 0, 2, 0)             # 3 MiB: past the first batch's size
                # the group is still open: wait (bounded) until the receiver has bytes
                seen.append(int(landed.wait(15)))
                a.send(big[1], 0, 2, 1)
                a.send(big[2], 0, 2, 2)

        got = [np.zeros(3 << 20, np.uint8) for _ in range(3)]

        def look() -> None:
            deadline = time.monotonic() + 15
            while not b.bytes_received and time.monotonic() < deadline:
                time.sleep(0.01)
            if b.bytes_received:
                landed.set()

        def recv():
            watch = threading.Thread(target=look)
            watch.start()
            with b.group(20):
                for tag in range(3):
                    b.recv(got[tag], 0, 2, tag)
            watch.join(20)
        ra, rb = _both(send, recv)
        assert ra is None and rb is None, (ra, rb)
        assert seen == [1], "the receiver read nothing before the sender's group exit"
        assert all(np.array_equal(g, d) for g, d in zip(got, big))
        assert b.bytes_pulled == 3 * (3 << 20)


def test_a_pulling_receiver_reads_the_next_batch_while_it_pulls(monkeypatch):
    """The record batches of a pulling peer are read ahead: while the receiving thread
    pulls batch 0's bytes, batch 1 is fetched from the store already (the store's round
    trip used to start only after the last pull of batch 0), and every byte is exact."""
    import xreshard.transport.shm as shm_mod
    big = [_data(0, 2, tag, 3 << 20) for tag in range(2)]
    got = [np.zeros(3 << 20, np.uint8) for _ in range(2)]
    read: list[str] = []
    early: list[bool] = []
    real_pull = shm_mod.pull

    def pull(*args: Any) -> None:
        if not early:       # the first pull (batch 0): has batch 1 been read meanwhile?
            deadline = time.monotonic() + 10
            while not any(k.endswith("/1") for k in read) and time.monotonic() < deadline:
                time.sleep(0.01)
            early.append(any(k.endswith("/1") for k in read))
        real_pull(*args)

    monkeypatch.setattr(shm_mod, "pull", pull)
    with _pair_cleaned(pulls=True) as (a, b, prefix):
        discard = b._watch.discard      # noqa: SLF001 - called once per record read

        def seen(keys: list[str]) -> None:
            read.extend(keys)
            discard(keys)
        b._watch.discard = seen         # type: ignore[method-assign]  # noqa: SLF001

        def send():
            with a.group(30):
                a.send(big[0], 0, 2, 0)         # batch 0 (past 1 MiB)
                a.send(big[1], 0, 2, 1)         # batch 1, the last, at the group's exit

        def recv():
            with b.group(30):
                for tag in range(2):
                    b.recv(got[tag], 0, 2, tag)
        ra, rb = _both(send, recv)
        assert ra is None and rb is None, (ra, rb)
    assert early == [True], "batch 1 was read only after batch 0's pulls"
    assert all(np.array_equal(g, d) for g, d in zip(got, big))


def test_a_receiver_that_fails_mid_round_stops_its_batch_reader():
    """A receiver that raises on batch 0 while its reader waits for batch 1 (the sender's
    group still open) wakes and ends that reader at once: no thread is left waiting on the
    store until the timeout, and the sender hears of the failure."""
    release = threading.Event()
    with _pair_cleaned(pulls=True) as (a, b, prefix):
        def send():
            with a.group(120):
                a.send(_data(0, 2, 0, 2 << 20), 0, 2, 0)    # batch 0
                release.wait(20)        # the group stays open: batch 1 is not out yet
                a.send(np.ones(16, np.uint8), 0, 2, 1)

        def recv():
            try:
                with b.group(120):
                    b.recv(np.zeros(16, np.uint8), 0, 2, 1)     # tag 0 was never posted
            finally:
                release.set()
        t0 = time.monotonic()
        ra, rb = _both(recv, send)
        assert isinstance(ra, TransportError) and "did not post a receive" in str(ra), ra
        assert isinstance(rb, TransportError), rb
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                t.name == "xreshard-shm-read" for t in threading.enumerate()):
            time.sleep(0.02)
        assert not any(t.name == "xreshard-shm-read" for t in threading.enumerate())
        assert time.monotonic() - t0 < 60       # not the 120 s timeout


def test_a_pulling_sender_that_sends_an_unposted_message_is_named_at_once():
    """A pulling sender's last batch says that nothing more comes: a receiver whose posts
    disagree names the message it did not expect, instead of waiting out its timeout."""
    a, b, prefix = _pair(pulls=True)

    def send():
        with a.group(120):
            a.send(np.ones(16, np.uint8), 0, 2, 0)
            a.send(np.ones(16, np.uint8), 0, 2, 2)

    def recv():
        with b.group(120):
            b.recv(np.zeros(16, np.uint8), 0, 2, 0)
            b.recv(np.zeros(16, np.uint8), 0, 2, 1)
    t0 = time.monotonic()
    ra, rb = _both(send, recv)
    assert isinstance(rb, TransportError) and not isinstance(rb, TransportTimeout), rb
    assert "0->2 tag 2" in str(rb) and "did not post a receive" in str(rb), rb
    assert time.monotonic() - t0 < 60       # not the 120 s timeout
    a.close()
    b.close()
    assert shm_names(prefix) == []


def test_pull_probe_reads_another_process_memory_or_says_no():
    from xreshard.transport.shm import can_pull, pull
    mark = np.frombuffer(b"token-123", np.uint8).copy()
    assert can_pull(os.getpid(), int(mark.ctypes.data), b"token-123")
    assert not can_pull(os.getpid(), int(mark.ctypes.data), b"token-124")
    assert not can_pull(2**22 + 12345, int(mark.ctypes.data), b"token-123")   # no such pid
    out = np.zeros(9, np.uint8)
    pull(os.getpid(), int(out.ctypes.data), int(mark.ctypes.data), 9)
    assert out.tobytes() == b"token-123"


def test_silent_peer_times_out_naming_it():
    a, b, prefix = _pair(process_labels=["trainer[0]", "rollout[0]"])
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"message 0->2 tag 7 \(round 1\) from "
                                               r"trainer\[0\].*within 1 s"):
        with b.group(1.0):
            b.recv(np.zeros(8, np.uint8), 0, 2, 7)    # "process 0" never posts
    assert time.monotonic() - t0 < 5
    b.close()
    a.close()
    assert shm_names(prefix) == []


def test_receiver_detects_a_sender_that_moved_on():
    with _pair_cleaned() as (a, b, prefix):
        payload = np.arange(256, dtype=np.uint8)
        orig = a._place

        def place_then_bump(peer, arr):
            seg, off, unlink = orig(peer, arr)
            seg.header[1] += 1          # what a sender reusing the segment too early does
            return seg, off, unlink
        a._place = place_then_bump

        def send():
            with a.group(5):
                a.send(payload, 0, 2, 0)

        def recv():
            with b.group(5):
                b.recv(np.zeros(256, np.uint8), 0, 2, 0)
        ra, rb = _both(send, recv)
        assert isinstance(rb, TransportError) and "sender moved on" in str(rb)


# ---------------------------------------------------------------------- routing (pure)


def _caps(hosts, reach, cuda=None):
    return [{"host": h, "shm_reach": r, "cuda_devices": (cuda or {}).get(i, []),
             "cuda_reach": (cuda or {}).get(i, [])} for i, (h, r) in enumerate(zip(hosts, reach))]


def test_routes_per_pair_mixed_hosts():
    # processes: 0 (2 ranks, host a), 1 (host a), 2 (host b), 3 (host a, shm off)
    rank_process = [0, 0, 1, 2, 3]
    caps = _caps(["a", "a", "b", "a"], [[1], [0], [], []])
    r = choose_routes(rank_process, ["cpu"] * 5, caps)
    assert r.kind(0, 1) == "local"
    assert r.kind(0, 2) == r.kind(2, 1) == "shm"
    assert r.kind(0, 3) == r.kind(3, 2) == "gloo"        # other host
    assert r.kind(4, 0) == r.kind(2, 4) == "gloo"        # same host, shm off there
    assert r.kinds == ("local", "shm", "gloo")
    assert r.peers(0, "shm") == [1] and r.peers(2, "gloo") == [0, 1, 3]
    # one host name but neither reads the other's probe (separate /dev/shm): gloo
    r2 = choose_routes([0, 1], ["cpu"] * 2, _caps(["a", "a"], [[], [0]]))
    assert r2.kind(0, 1) == "gloo" and r2.kinds == ("gloo",)
    assert choose_routes(rank_process, ["cpu"] * 5, caps, "gloo").kind(0, 2) == "gloo"
    with pytest.raises(RefitError, match=r"'shm' cannot move every pair: processes 0 \(a\) "
                                         r"and 2 \(b\) are on other hosts"):
        choose_routes(rank_process, ["cpu"] * 5, caps, "shm")
    with pytest.raises(RefitError, match="moves 'cpu' buffers"):
        choose_routes([0, 1], ["cuda"] * 2, _caps(["a", "a"], [[1], [0]]), "shm")


def test_routes_gpu_same_device_peer_access_and_refusal():
    cuda = {0: ["GPU-0"], 1: ["GPU-0"], 2: ["GPU-1"], 3: ["GPU-2"]}
    caps = _caps(["a", "a", "a", "a"], [[], [], [], []], cuda)
    caps[2]["cuda_reach"] = ["GPU-1", "GPU-0"]
    caps[0]["cuda_reach"] = ["GPU-0", "GPU-1"]
    r = choose_routes([0, 1, 2, 3], ["cuda"] * 4, caps)
    assert r.kind(0, 1) == "cuda_ipc"                     # one GPU
    assert r.kind(0, 2) == r.kind(2, 0) == "cuda_ipc"     # peer access both ways
    assert r.kind(1, 2) == "nccl"                         # process 1 cannot reach GPU-1
    assert r.kind(2, 3) == "nccl"
    assert r.kinds == ("cuda_ipc", "nccl")
    with pytest.raises(RefitError, match=r"rank 0 \(process 0, GPU GPU-0\) and rank 3 "
                                         r"\(process 3, GPU GPU-2\) are on different devices "
                                         r"without peer access.*Request 'nccl' or 'auto'"):
        choose_routes([0, 1, 2, 3], ["cuda"] * 4, caps, "cuda_ipc")


# ---------------------------------------------------------------------- real processes


def shm_exchange(ctx: Context, num_tags: int) -> dict:
    """Every pair of ranks exchanges messages through "auto" (local + shm)."""
    with ctx.join(timeout=30) as w:
        auto = w.transport("auto")
        shm = auto.parts["shm"]
        got = {}
        for _ in range(2):
            with auto.group(timeout=30):
                for src in range(w.num_ranks):
                    for dst in range(w.num_ranks):
                        if src == dst:
                            continue
                        for tag in range(num_tags):
                            if w.is_local(dst):
                                buf = np.zeros(_data(src, dst, tag).size, np.uint8)
                                got[(src, dst, tag)] = buf
                                auto.recv(buf, src, dst, tag)
                            if w.is_local(src):
                                auto.send(_data(src, dst, tag), src, dst, tag)
        bad = [list(k) for k, v in got.items() if not np.array_equal(v, _data(*k))]
        routes = {f"{s}->{d}": w.route(s, d) for s, d in [(0, 1), (0, 2), (2, 3)]}
        return {"bad": bad, "routes": routes, "name": auto.name, "prefix": shm.prefix,
                "by_kind": auto.bytes_by_transport}


def test_auto_routes_same_host_processes_through_shm():
    results = launch(shm_exchange, [Role("plain", "g", 0, num_devices=2),
                                    Role("plain", "g", 1, num_devices=2)], args=(4,), timeout=60)
    for r in results:
        v = r.value
        assert v["bad"] == []
        assert v["routes"] == {"0->1": "local", "0->2": "shm", "2->3": "local"}
        assert v["name"] == "auto(local+shm)"
        assert set(v["by_kind"]) == {"local", "shm"} and v["by_kind"]["shm"] > 0
    assert shm_names(results[0].value["prefix"]) == []


def test_auto_keeps_gloo_when_a_process_turns_shm_off():
    roles = [Role("plain", "g", 0), Role("plain", "g", 1)]
    # process 0 joins with Tuning(shm=False) (was XRESHARD_SHM=0, which from_env still reads)
    results = launch(shm_exchange_hosts, roles, args=(False, 0), timeout=60)
    assert [r.value["name"] for r in results] == ["auto(local+gloo)"] * 2
    assert all(r.value["bad"] == [] for r in results)
    # (other hosts: see the mixed-world refit below)


def shm_exchange_hosts(ctx: Context, two_hosts: bool, shm_off: int | None = None) -> dict:
    from xreshard.config import Tuning
    host = ("a" if ctx.role.index < 2 else "b") if two_hosts else None
    tuning = Tuning(shm=ctx.role.index != shm_off)
    with ctx.join(1, timeout=30, host=host, tuning=tuning) as w:
        auto = w.transport("auto")
        got = {}
        with auto.group(timeout=30):
            for src in range(w.num_ranks):
                for dst in range(w.num_ranks):
                    if src != dst and w.is_local(dst):
                        got[(src, dst)] = np.zeros(_data(src, dst, 0).size, np.uint8)
                        auto.recv(got[(src, dst)], src, dst, 0)
                    if src != dst and w.is_local(src):
                        auto.send(_data(src, dst, 0), src, dst, 0)
        bad = [list(k) for k, v in got.items() if not np.array_equal(v, _data(*k, 0))]
        routes = {f"{s}->{d}": w.route(s, d) for s, d in [(0, 1), (0, 2), (2, 1)]
                  if max(s, d) < w.num_ranks}
        return {"name": auto.name, "bad": bad, "routes": routes}


def _host(ctx: Context, hosts: list[str] | None) -> str | None:
    return None if hosts is None else hosts[ctx.launch_index]


def jax_sender_shm(ctx: Context, steps: int, hosts: list[str] | None = None) -> dict:
    import xreshard as xr

    world = ctx.join(groups=["trainer", "rollout"], host=_host(ctx, hosts))
    refit = xr.Refit(world, transpose={n for n, t in cases.JAX_TORCH_TENSORS.items()
                                       if "T" in t[3]},
                     config=xr.RefitConfig(timeout=60, bucket_bytes=1 << 16))
    for step in range(steps):
        refit(send=cases._jax_params(cases.JAX_TORCH_TENSORS, "bfloat16", step))
    auto = world.transport("auto")
    out = {"by_kind": auto.bytes_by_transport, "moved": refit.plan.stats.bytes_moved,
           "prefix": auto.parts["shm"].prefix, "name": auto.name,
           "routes": {str(r): world.route(world.rank_ids[0], r)
                      for r in world.group_ranks("rollout")}}
    world.close()
    return out


def torch_receiver_shm(ctx: Context, steps: int, hosts: list[str] | None = None) -> dict:
    import torch.distributed as dist
    import xreshard as xr

    members = sum(r.group == "rollout" for r in ctx.roles)
    cases._torch_group(ctx, members, ctx.role.index, "rollout")
    world = ctx.join(groups=["trainer", "rollout"], host=_host(ctx, hosts))
    state = cases._dtensors(cases.JAX_TORCH_TENSORS, "bfloat16", members, None)
    refit = xr.Refit(world, receive=state, config=xr.RefitConfig(timeout=60,
                                                                 bucket_bytes=1 << 16))
    for step in range(steps):
        refit()
        cases._check_dtensors(state, cases.JAX_TORCH_TENSORS, "bfloat16", step, "bfloat16")
    auto = world.transport("auto")
    out = {"by_kind": auto.bytes_by_transport, "version": refit.version, "name": auto.name}
    world.close()
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_jax_to_torch_bit_exact_over_shm_and_a_remote_engine_over_gloo_in_one_refit():
    # the trainer and rollout[0..1] share host "a" (shm), rollout[2] is on "b" (gloo): three
    # processes over shm and a mixed world in one refit, two refits, bit-exact everywhere
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(3)]
    results = launch([jax_sender_shm] + [torch_receiver_shm] * 3, roles,
                     args=(2, ["a", "a", "a", "b"]), timeout=150)
    sender = results[0].value
    assert sender["name"] == "auto(local+shm+gloo)"
    assert sender["routes"] == {"4": "shm", "5": "shm", "6": "gloo"}
    near = [r.value["by_kind"] for r in results[1:3]]
    far = results[3].value["by_kind"]
    assert all(k["shm"] > 0 and k["gloo"] == 0 for k in near)
    assert far["gloo"] > 0 and far["shm"] == 0
    assert sender["by_kind"]["shm"] + sender["by_kind"]["gloo"] == 2 * sender["moved"]
    assert sender["by_kind"]["shm"] == sum(k["shm"] for k in near)
    assert all(r.value["version"] == 2 for r in results[1:])
    assert shm_names(sender["prefix"]) == []


@pytest.mark.slow
def test_torch_to_jax_over_shm_bit_exact():
    roles = [Role("jax", "trainer", 0, num_devices=4), Role("torch", "rollout", 0),
             Role("torch", "rollout", 1)]
    results = launch([cases.jax_receiver, cases.torch_sender, cases.torch_sender],
                     roles, args=(2,), timeout=150)
    assert results[0].value == {"version": 2, "devices": 4}


def shm_dies_mid_refit(ctx: Context, timeout: float, how: str) -> dict:
    """rollout[1] dies (os._exit or SIGKILL) after its first unpack; the others raise.
    Every message goes through shared segments (``Tuning(shm_pull=False)``)."""
    import xreshard as xr

    tensors = {"big": ((512, 256), ("a", "b"), ["S1"], "")}
    world = ctx.join(groups=["trainer", "rollout"], tuning=xr.Tuning(shm_pull=False))
    config = xr.RefitConfig(timeout=timeout, bucket_bytes=1 << 16, staging_bytes=1 << 17)
    if ctx.role.group == "trainer":
        refit = xr.Refit(world, send=cases._jax_params(tensors, "float32", 0), config=config)
    else:
        import torch.distributed as dist
        cases._torch_group(ctx, sum(r.group == "rollout" for r in ctx.roles), ctx.role.index,
                           "rollout")
        refit = xr.Refit(world, receive=cases._dtensors(tensors, "float32",
                                                        dist.get_world_size(), None),
                         config=config)
        if ctx.role.index == 1:
            cases.die_after_first_unpack(kill=how == "kill")
    shm = world.transport("auto").parts["shm"]
    if ctx.role.group == "trainer":
        # the trainer names its segments as it creates them (the test checks they existed)
        make = shm._new_segment

        def new_segment(kind, size):
            seg = make(kind, size)
            created.append(seg.name)
            return seg
        created: list[str] = []
        shm._new_segment = new_segment
    t0 = time.monotonic()
    error = cases._attempt(refit)
    return {"error": error, "seconds": time.monotonic() - t0, "version": refit.version,
            "prefix": shm.prefix, "copied_in": shm.bytes_copied_in, "pulled": shm.bytes_pulled,
            "created": created if ctx.role.group == "trainer" else []}


@pytest.mark.slow
def test_peer_killed_mid_refit_raises_everywhere_and_leaves_no_segment():
    # through shared segments (Tuning(shm_pull=False)): the pull path creates none to leak
    how = "kill"
    roles = [Role("jax", "trainer", 0, num_devices=4)] + [
        Role("torch", "rollout", i) for i in range(2)]
    timeout = 5.0
    results = launch(shm_dies_mid_refit, roles, args=(timeout, how), timeout=120,
                     check=False, fail_fast=False)
    assert results[2].returncode == -signal.SIGKILL
    for live in results[:2]:
        assert live.ok, live.describe()
        v = live.value
        assert v["error"] != "no error" and v["version"] == 0
        assert v["seconds"] < 3 * timeout + 5, v
    trainer = results[0].value
    assert "died" in trainer["error"] or "rollout[1]" in trainer["error"], trainer["error"]
    assert trainer["copied_in"] > 0 and trainer["pulled"] == 0 and trainer["created"]
    assert shm_names(trainer["prefix"]) == []       # none of them is left in /dev/shm


def test_records_are_sealed_and_bound_to_key_round_and_writer():
    from xreshard.errors import AuthenticationError
    from xreshard.runtime.store import Seal
    from xreshard.transport.peers import Records
    seal = Seal(b"secret", "w", "nonce")
    with _pair_cleaned(seal=seal) as (a, b, prefix):
        ra, rb = _both(lambda: _round(a, {0, 1}, {2}, range(2)),
                       lambda: _round(b, {2}, {0, 1}, range(2)))
        assert all(ra.values()) and all(rb.values())
        # a process without the token writes round 2's record before the sender does
        import json as _json
        key = b._msg_key(2, 0, 2, 0)
        b._store.set(key, _json.dumps({"key": key, "addr": 0, "n": 8, "gen": 2}))
        with pytest.raises(AuthenticationError, match="does not hold an xreshard payload"):
            with b.group(5):
                b.recv(np.zeros(8, np.uint8), 0, 2, 0)
    signed = Records(seal, 0)
    raw = signed.pack("shm", "k/1", 1, {"n": 8})
    assert signed.unpack("shm", "k/1", 1, 0, raw, {})["n"] == 8
    with pytest.raises(TransportError, match="replayed or misplaced"):
        signed.unpack("shm", "k/2", 1, 0, raw, {})            # moved to another message
    with pytest.raises(AuthenticationError):
        signed.unpack("shm", "k/1", 2, 0, raw, {})            # replayed in another round
    with pytest.raises(AuthenticationError):
        signed.unpack("shm", "k/1", 1, 3, raw, {})            # claimed by another writer


def test_a_process_that_exits_without_closing_leaves_no_segment():
    import subprocess
    import sys
    tag = secrets.token_hex(5)
    code = (f"import numpy as np\n"
            f"from xreshard.transport.shm import ShmTransport\n"
            f"t = ShmTransport(None, 'k', {tag!r}, [0, 1], 0, [1])\n"
            f"t.alloc(1 << 16)[:] = 1\n"
            f"import os; assert any(n.startswith('xr{tag}_') for n in os.listdir('/dev/shm'))\n"
            f"raise SystemExit(3)   # no close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    assert shm_names(f"xr{tag}_") == []


def test_a_peer_that_failed_is_noticed_by_the_processes_waiting_for_it():
    """The sender's group fails (its block raised) while the receiver waits for its message:
    the receiver raises naming that failure within a watcher interval, not at its timeout
    (and not as a dead process: it is alive)."""
    a, b, prefix = _pair(process_labels=["trainer[0]", "rollout[0]"])

    def send():
        with a.group(20):
            raise RuntimeError("the trainer's packing failed")

    def recv():
        with b.group(20):
            b.recv(np.zeros(8, np.uint8), 0, 2, 7)
    t0 = time.monotonic()
    ra, rb = _both(send, recv)
    assert isinstance(ra, RuntimeError)
    assert isinstance(rb, TransportError) and not isinstance(rb, TransportTimeout), rb
    assert "from trainer[0] never came: that process failed: trainer[0]" in str(rb), rb
    assert time.monotonic() - t0 < 20
    a.close()
    b.close()
    assert shm_names(prefix) == []
