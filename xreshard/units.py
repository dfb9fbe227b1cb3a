"""Sizes, durations and rates as people read them (reports, tables, the CLI).

Binary prefixes for sizes (a MiB is 2**20 bytes, as memory is counted), decimal GB/s for
rates (as links are rated). A size never prints as ``0.0 MiB``: it takes the largest unit
it fills, ``512 B``, ``12.5 KiB``, ``2.01 MiB``.
"""

from __future__ import annotations

__all__ = ["format_bytes", "format_rate", "format_seconds"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``n`` bytes with three significant digits in the largest binary unit it fills.

    >>> format_bytes(0), format_bytes(512), format_bytes(12800), format_bytes(2107392)
    ('0 B', '512 B', '12.5 KiB', '2.01 MiB')
    """
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:.0f} B"
    unit = 0
    while n >= 1024 and unit < len(_UNITS) - 1:
        n /= 1024
        unit += 1
    digits = 2 if n < 9.995 else 1 if n < 99.95 else 0
    return f"{sign}{n:.{digits}f} {_UNITS[unit]}"


def format_seconds(s: float) -> str:
    """``s`` seconds as ``850 us``, ``12.3 ms`` or ``4.20 s``."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def format_rate(num_bytes: float, seconds: float) -> str:
    """``num_bytes`` over ``seconds`` in decimal GB/s (MB/s below 0.1 GB/s); ``-`` when
    nothing was timed."""
    if seconds <= 0:
        return "-"
    rate = num_bytes / seconds
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e8 else f"{rate / 1e6:.1f} MB/s"
