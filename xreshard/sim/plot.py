"""``xreshard simulate --plot``: a per-rank timeline and the rank x rank transfer heatmap.

matplotlib is an optional extra (``pip install 'xreshard[plot]'``), imported only here.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def require_matplotlib() -> Any:
    """matplotlib.pyplot with the non-interactive Agg backend, or a SimulationError."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        from .simulate import SimulationError
        raise SimulationError("--plot needs matplotlib: pip install 'xreshard[plot]' "
                              "(or pip install matplotlib)") from e
    return plt


def plot(path: str, traffic: Any, replay: Any, num_ranks: int, *, title: str = "") -> None:
    """Write ``path``: left, when each rank is busy (from a round's start to its last
    message landing, sends and receives), coloured network / NVLink-forward; right, the
    bytes each rank sends to each rank (log scale)."""
    plt = require_matplotlib()
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(15, 6), width_ratios=(3, 2))
    start = replay.round_start[traffic.round] if len(traffic) else np.zeros(0)
    end = replay.finish
    for fwd, color, label in ((False, "tab:blue", "sent directly"),
                              (True, "tab:orange", "forwarded by a relay")):
        sel = traffic.forward == fwd
        if not sel.any():
            continue
        # per (rank, round): busy until its last message of that round lands
        for ranks in (traffic.src[sel], traffic.dst[sel]):
            key = ranks.astype(np.int64) * (traffic.num_rounds + 1) + traffic.round[sel]
            uniq, inv = np.unique(key, return_inverse=True)
            last = np.zeros(len(uniq))
            np.maximum.at(last, inv, end[sel])
            first = np.full(len(uniq), np.inf)
            np.minimum.at(first, inv, start[sel])
            rank = uniq // (traffic.num_rounds + 1)
            ax_t.hlines(rank, first, last, colors=color, linewidth=1.0, label=label)
            label = None
    ax_t.set_xlabel("seconds")
    ax_t.set_ylabel("rank")
    ax_t.set_ylim(-1, num_ranks)
    ax_t.invert_yaxis()
    ax_t.legend(loc="lower right")
    ax_t.set_title(title or "refit timeline")
    heat = np.zeros((num_ranks, num_ranks))
    np.add.at(heat, (traffic.src, traffic.dst), traffic.nbytes.astype(float))
    shown = np.where(heat > 0, np.log10(np.maximum(heat, 1.0)), np.nan)
    im = ax_h.imshow(shown, cmap="viridis", interpolation="nearest", aspect="auto")
    fig.colorbar(im, ax=ax_h, label="log10 bytes")
    ax_h.set_xlabel("destination rank")
    ax_h.set_ylabel("source rank")
    ax_h.set_title("bytes per rank pair")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
