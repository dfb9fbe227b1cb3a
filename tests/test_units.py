"""How sizes, rates and reports read: never ``0.0 MiB``, rates over the time spent moving."""

from __future__ import annotations

from xreshard.config import RefitReport
from xreshard.runtime.commcount import CommCounts
from xreshard.units import format_bytes, format_rate, format_seconds


def test_sizes_take_the_largest_unit_they_fill():
    assert [format_bytes(n) for n in (0, 512, 1024, 12800, 2107392, 3 * 2**30)] == [
        "0 B", "512 B", "1.00 KiB", "12.5 KiB", "2.01 MiB", "3.00 GiB"]
    assert format_bytes(99.97 * 1024) == "100 KiB"
    assert format_seconds(0.0633) == "63.3 ms" and format_seconds(3.4) == "3.40 s"
    assert format_rate(2e9, 1.0) == "2.00 GB/s" and format_rate(2e6, 0.1) == "20.0 MB/s"
    assert format_rate(1, 0) == "-"


def _report(**kw) -> RefitReport:
    base = dict(version=2, seconds=0.1, plan_seconds=0.05, bytes_sent=2107392,
                bytes_received=0, bytes_local=0, bytes_moved_world=2107392,
                bytes_gather_broadcast_world=3 * 2107392, num_rounds=1, num_messages=2,
                num_zero_copy=0, staging_bytes=0, replanned=False, move_seconds=0.02)
    return RefitReport(**{**base, **kw})


def test_a_report_rates_bytes_over_the_time_spent_moving_and_shows_setup_apart():
    r = _report()
    assert r.setup_seconds == 0.1 - 0.02
    assert abs(r.gbps - 2107392 / 0.02 / 1e9) < 1e-12
    text = str(r)
    assert "in 20.0 ms moving (0.11 GB/s); setup 80.0 ms (checks 50.0 ms)" in text, text
    assert "MiB" in text and "0.0 MiB" not in text and "received 0 B" in text
    relayed = str(_report(bytes_forwarded=4096, replanned=True))
    assert "forwarded 4.00 KiB" in relayed and "(planning 50.0 ms)" in relayed, relayed


def test_comm_counts_print_as_a_table_of_pairs():
    c = CommCounts()
    assert str(c) == "count_comm: 0 rounds, 0 messages; sent 0 B, received 0 B (nothing posted)"
    c.bytes_sent[(0, 4)] += 2**20
    c.messages_sent[(0, 4)] += 1
    c.bytes_received[(5, 0)] += 300
    c.messages_received[(5, 0)] += 2
    c.rounds = 1
    assert str(c).splitlines() == [
        "count_comm: 1 round, 3 messages; sent 1.00 MiB, received 300 B",
        "  src -> dst |     sent | msgs | received | msgs",
        "      0 -> 4 | 1.00 MiB |    1 |        - |    -",
        "      5 -> 0 |        - |    - |    300 B |    2"]
    assert "bytes_sent={(0, 4): 1048576}" in repr(c)
