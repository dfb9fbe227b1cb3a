"""Transports: local copies in one process, gloo between real processes (byte-exact,
many tags, several ranks per process), timeouts and dead peers."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest
torch = pytest.importorskip("torch")

from xreshard.tools.launch import Context, Role, launch
from xreshard.transport.base import TransportError, TransportTimeout
from xreshard.transport.gloo import GlooTransport
from xreshard.transport.local import LocalTransport

# ---------------------------------------------------------------------- local


def test_local_copies_numpy_and_torch_buffers():
    t = LocalTransport(ranks=[0, 1, 2])
    a = np.arange(16, dtype=np.uint8)
    b = torch.arange(100, 116, dtype=torch.uint8)
    out = [np.zeros(16, np.uint8), torch.zeros(16, dtype=torch.uint8), np.zeros(16, np.uint8),
           torch.zeros(16, dtype=torch.uint8)]
    with t.group(timeout=1):
        t.recv(out[0], 0, 1, 7)
        t.send(a, 0, 1, 7)
        t.send(a, 0, 2, 7)          # same tag, other pair: a different message
        t.recv(out[1], 0, 2, 7)
        t.send(b, 1, 0, 0)
        t.recv(out[2], 1, 0, 0)
        t.send(b, 2, 1, 3)
        t.recv(out[3], 2, 1, 3)
    np.testing.assert_array_equal(out[0], a)
    assert out[1].tolist() == a.tolist()
    assert out[2].tolist() == b.tolist()
    assert torch.equal(out[3], b)


def test_local_unmatched_posts_are_named_and_nothing_is_copied():
    t = LocalTransport()
    dst = np.zeros(4, np.uint8)
    with pytest.raises(TransportError, match=r"2 unmatched post\(s\).*recv 3->4 tag 2 \(no send\)"
                                             r".*send 5->6 tag 1 \(no recv\)"):
        with t.group(timeout=1):
            t.send(np.ones(4, np.uint8), 5, 6, 1)
            t.recv(dst, 3, 4, 2)
            t.send(np.ones(4, np.uint8), 0, 1, 0)
            t.recv(dst, 0, 1, 0)
    assert not dst.any()


def test_local_mistakes_raise():
    t = LocalTransport(ranks=[0, 1])
    buf = np.zeros(4, np.uint8)
    with pytest.raises(TransportError, match="outside"):
        t.send(buf, 0, 1, 0)
    with pytest.raises(TransportError, match="this process's ranks"):
        with t.group(timeout=1):
            t.send(buf, 0, 2, 0)
    with pytest.raises(TransportError, match="posted twice"):
        with t.group(timeout=1):
            t.send(buf, 0, 1, 0)
            t.send(buf, 0, 1, 0)
    with pytest.raises(TransportError, match="4 bytes, recv buffer 3"):
        with t.group(timeout=1):
            t.send(buf, 0, 1, 0)
            t.recv(np.zeros(3, np.uint8), 0, 1, 0)
    with pytest.raises(KeyError):              # an error in the block: no matching, no copy
        with t.group(timeout=1):
            t.send(buf, 0, 1, 0)
            raise KeyError("user")
    with t.group(timeout=1):                   # and the transport is still usable
        pass


# ---------------------------------------------------------------------- gloo tag encoding


class _FakeWork:
    def wait(self, timeout):
        return True


class _FakePG:
    def __init__(self):
        self.calls = []

    def size(self):
        return 3

    def send(self, tensors, peer, tag):
        self.calls.append(("send", peer, tag))
        return _FakeWork()

    def recv(self, tensors, peer, tag):
        self.calls.append(("recv", peer, tag))
        return _FakeWork()


def test_gloo_tag_encoding_is_injective_and_fits_31_bits():
    rank_process = [0, 0, 0, 1, 2, 2]           # process 0 hosts 3 ranks: L = 3
    pg = _FakePG()
    t = GlooTransport(pg, rank_process, process_index=0)
    assert t.tag_limit == 2**31 // 9
    tags = [0, 1, 2, t.tag_limit - 1]
    buf = np.zeros(1, np.uint8)
    with t.group(timeout=1):
        for src, dst, tag in itertools.product([0, 1, 2], [3, 4, 5], tags):
            t.send(buf, src, dst, tag)
    keys = [(peer, code) for _, peer, code in pg.calls]
    assert len(set(keys)) == len(keys) == 3 * 3 * len(tags)
    assert all(0 <= code < 2**31 for _, code in keys)
    with pytest.raises(TransportError, match="tag .* is outside"):
        with t.group(timeout=1):
            t.send(buf, 0, 3, t.tag_limit)
    with pytest.raises(TransportError, match="both in this process"):
        with t.group(timeout=1):
            t.send(buf, 0, 1, 0)
    with pytest.raises(TransportError, match="not in this process"):
        with t.group(timeout=1):
            t.recv(buf, 0, 3, 0)


# ---------------------------------------------------------------------- gloo, real processes


def _payload(src: int, dst: int, tag: int) -> np.ndarray:
    n = 1 + (src * 7919 + dst * 104729 + tag * 1299709) % 20000
    if tag == 0 and src == 0:
        n = 4 << 20                      # one large message per receiver of rank 0
    return np.random.default_rng([src, dst, tag]).integers(0, 256, n, dtype=np.uint8)


def exchange(ctx: Context, num_tags: int) -> dict:
    with ctx.join(timeout=20) as w:
        auto = w.transport("auto")
        gloo = w.transport("gloo")
        tags = list(range(num_tags)) + [gloo.tag_limit - 1]
        received = {}
        with auto.group(timeout=20):
            for src, dst in itertools.permutations(range(w.num_ranks), 2):
                for tag in tags:
                    if w.is_local(src):
                        data = _payload(src, dst, tag)
                        auto.send(data if tag % 2 else torch.from_numpy(data), src, dst, tag)
                    if w.is_local(dst):
                        n = _payload(src, dst, tag).size
                        buf = np.empty(n, np.uint8) if tag % 3 else torch.empty(n, dtype=torch.uint8)
                        received[(src, dst, tag)] = buf
                        auto.recv(buf, src, dst, tag)
        bad = [k for k, buf in received.items()
               if not np.array_equal(np.asarray(buf), _payload(*k))]
        # A second group through gloo alone: the transport is reusable.
        peer = next(r for r in range(w.num_ranks) if not w.is_local(r))
        out = np.zeros(1000, np.uint8)
        with gloo.group(timeout=20):
            gloo.send(np.full(1000, w.process_index + 1, np.uint8), w.rank_ids[0], peer, 3)
            gloo.recv(out, peer, w.rank_ids[0], 3)
        routes = {f"{s}->{d}": w.route(s, d) for s, d in [(0, 1), (0, 2), (2, 3)]}
        return {"received": len(received), "bad": [list(k) for k in bad],
                "second": int(out[0]), "routes": routes, "tag_limit": gloo.tag_limit,
                "name": auto.name}


def test_gloo_two_processes_two_ranks_each_byte_exact():
    num_tags = 12
    results = launch(exchange, [Role("plain", "g", 0, num_devices=2),
                                Role("plain", "g", 1, num_devices=2)],
                     args=(num_tags,), timeout=60, env={"XRESHARD_SHM": "0"})  # gloo, not shm
    for i, r in enumerate(results):
        v = r.value
        assert v["bad"] == []
        assert v["received"] == 2 * 3 * (num_tags + 1)       # each local rank hears 3 peers
        assert v["second"] == (2 - i)                         # the other process's fill byte
        assert v["routes"] == {"0->1": "local", "0->2": "gloo", "2->3": "local"}
        assert v["tag_limit"] == 2**31 // 4
        assert v["name"] == "auto(local+gloo)"


def silent_peer(ctx: Context) -> dict:
    import torch.distributed  # noqa: F401 - not counted in the timed wait

    with ctx.join(1, timeout=20) as w:
        t = w.transport("gloo")
        if ctx.launch_index == 1:
            time.sleep(4)                       # never posts its receive
            return {}
        t0 = time.monotonic()
        try:
            with t.group(timeout=2):
                t.send(np.ones(64, np.uint8), w.rank_ids[0], 1 - w.rank_ids[0], 5)
        except TransportTimeout as e:
            out = {"error": str(e), "elapsed": time.monotonic() - t0}
        try:
            with t.group(timeout=2):
                pass
        except TransportError as e:
            out["after"] = str(e)
        return out


def test_gloo_peer_that_never_posts_times_out():
    v = launch(silent_peer, [Role("plain", "g", 0), Role("plain", "g", 1)], timeout=60)[0].value
    assert 2 <= v["elapsed"] < 2 + 5      # bounded by the timeout (+ slack for a loaded box)
    assert "gloo send to rank 1" in v["error"] and "tag 5" in v["error"]
    assert "within 2 s" in v["error"] and "g[1]" in v["error"]
    assert "unusable" in v["after"]


def dying_peer(ctx: Context) -> dict:
    with ctx.join(1, timeout=20) as w:
        t = w.transport("gloo")
        me, peer = w.rank_ids[0], 1 - w.rank_ids[0]
        if ctx.launch_index == 1:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
            with t.group(timeout=30):
                t.recv(np.zeros(64, np.uint8), peer, me, 1)
                t.recv(np.zeros(64, np.uint8), peer, me, 3)      # never sent: blocks here
            return {}
        t0 = time.monotonic()
        try:
            with t.group(timeout=10):
                t.send(np.ones(64, np.uint8), me, peer, 1)
                t.recv(np.zeros(64, np.uint8), peer, me, 2)      # never sent: peer dies
        except (TransportError, TransportTimeout) as e:
            return {"type": type(e).__name__, "error": str(e), "elapsed": time.monotonic() - t0}
        return {}


def test_gloo_peer_killed_mid_group_fails_fast():
    results = launch(dying_peer, [Role("plain", "g", 0), Role("plain", "g", 1)], timeout=60,
                     check=False, fail_fast=False)
    assert results[1].returncode == -signal.SIGKILL
    v = results[0].value
    assert v["type"] == "TransportError" and v["elapsed"] < 10
    assert "recv from rank 1" in v["error"] and "tag 2" in v["error"]


@pytest.mark.parametrize("dtype", ["uint8", "int8", "float16", "float32", "complex128"])
def test_local_receive_into_a_strided_region_copies_its_bytes_in_c_order(dtype):
    """A receive posted as a strided view (a row range of a wider array, as the executor
    posts a same-process destination region: ``takes_views``) gets the message's bytes in
    the view's C order, bit for bit; the rest of the array is untouched."""
    rng = np.random.default_rng(1)
    region = rng.integers(0, 256, (6, 5 * np.dtype(dtype).itemsize), dtype=np.uint8)
    wide = np.zeros((6, 9), dtype)
    view = wide[:, 2:7]
    assert not view.flags.c_contiguous
    t = LocalTransport([0, 1])
    assert t.takes_views(0, 1) and not t.takes_views(0, 2)
    with t.group(timeout=5):
        t.recv(view, 0, 1, 3)
        t.send(region.reshape(-1), 0, 1, 3)
    assert view.tobytes() == region.tobytes()
    assert not wide[:, :2].any() and not wide[:, 7:].any()


def test_routed_transport_takes_views_only_for_pairs_routed_to_local():
    from xreshard.transport.routed import RoutedTransport
    routed = RoutedTransport({"local": LocalTransport([0, 1]), "gloo": object()},
                             lambda s, d: "local" if {s, d} <= {0, 1} else "gloo", [0, 1])
    assert routed.takes_views(1, 0) and not routed.takes_views(0, 2)


def test_only_row_ranges_are_taken_as_views():
    """A region whose rows are contiguous is received in place; a transposed one (a Flax
    kernel) keeps staging and the executor's tiled unpack; device-like or read-only
    buffers too."""
    from types import SimpleNamespace

    from xreshard.transport.base import takes_view
    t, pair = LocalTransport([0, 1]), SimpleNamespace(src=0, dst=1)
    wide = np.zeros((8, 12), np.float32)
    assert takes_view(t, pair, wide[:, 2:6])
    assert not takes_view(t, pair, wide.T[2:6])             # columns: transposed
    assert not takes_view(t, SimpleNamespace(src=0, dst=2), wide[:, 2:6])
    assert not takes_view(object(), pair, wide[:, 2:6])     # a transport without it
    frozen = wide[:, 2:6]
    frozen.flags.writeable = False
    assert not takes_view(t, pair, frozen)
