"""``xreshard simulate --plot``: when each rank is busy, and which ranks send to which.

One row per replayed schedule (``--schedule auto``: direct above relay), all on one time
axis:

* a timeline: time on x, the lower bound and the predicted end drawn as lines; ranks on y,
  the sources above the destinations, NVLink domains marked at the side; each pixel
  coloured by what the rank is doing then - network transfers (blue), NVLink transfers
  (green), relay forwards (orange) - with the share of the pixel's time it is busy as the
  colour's strength, so a round of microseconds in a refit of seconds still shows;
* the bytes each source rank sends each destination rank (log scale over at least two
  decades, so pairs that differ by 30% look alike), domains marked;
* for a relay, the bytes destination ranks forward to each other, in a panel of its own
  and in the forwards' orange, captioned: forwards stay inside a domain (squares on the
  diagonal) and no rank forwards to itself (the empty diagonal).

matplotlib is an optional extra (``pip install 'xreshard[plot]'``), imported only here.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

#: colours of the classes of ``engine.BUSY_CLASSES`` (network, nvlink, forward)
COLORS = np.array([[0.12, 0.40, 0.80], [0.15, 0.62, 0.30], [0.95, 0.50, 0.05]])

#: pixels across a timeline
WIDTH = 900


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


def busy_raster(replay: Any, num_ranks: int, end: float, width: int = WIDTH) -> np.ndarray:
    """``[rank, pixel, class]``: the share of each pixel's time (``end / width`` seconds)
    a rank spends busy with each class (``replay.busy``: each round, each rank is busy
    with a class from the round's start until its last such message lands)."""
    edges = np.linspace(0.0, end, width + 1)
    starts = replay.round_start
    n = len(starts)
    if n == 0:
        return np.zeros((num_ranks, width, 3))
    # C(t) = busy time before t = (whole rounds before t) + (the part of t's round)
    at = np.clip(np.searchsorted(starts, edges, side="right") - 1, 0, n - 1)
    want = np.unique(at)
    snap: dict[int, np.ndarray] = {}
    running = np.zeros((num_ranks, 3))
    j = 0
    for k, b in enumerate(replay.busy):
        while j < len(want) and want[j] == k:
            snap[k] = running.copy()
            j += 1
        if j == len(want):
            break
        running += b
    cover = np.stack([snap[int(k)] + np.minimum(np.maximum(e - starts[k], 0.0),
                                                 replay.busy[int(k)])
                      for e, k in zip(edges, at)], axis=1)
    return np.clip(np.diff(cover, axis=1) / (end / width), 0.0, 1.0)


def _image(raster: np.ndarray, order: np.ndarray) -> np.ndarray:
    """RGB of a raster (white = idle): the classes' colours mixed by their shares (a rank
    receiving and forwarding at once shows a colour of its own, not the last class
    drawn), as strong as the busiest class; square roots lift short activity into view."""
    f = np.sqrt(raster[order])
    strength = f.max(axis=-1, keepdims=True)
    mix = (f / np.maximum(f.sum(axis=-1, keepdims=True), 1e-12)) @ COLORS
    return 1.0 - strength + mix * strength


def _pair_bytes(traffic: Any, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """``(direct, forwarded)``: bytes per (src, dst) rank pair, split by forwards."""
    both = np.zeros((2, num_ranks, num_ranks))
    if hasattr(traffic, "pattern"):                          # PairTraffic
        per = np.array([int(s.sum()) for s in traffic.sizes_of], float)
        fwd = (np.zeros(len(traffic.src), bool) if traffic.forward is None
               else traffic.forward)
        np.add.at(both, (fwd.astype(int), traffic.src, traffic.dst), per[traffic.pattern])
    else:
        np.add.at(both, (traffic.forward.astype(int), traffic.src, traffic.dst),
                  traffic.nbytes.astype(float))
    return both[0], both[1]


def _domain_marks(ax: Any, domain: np.ndarray, axis: str, offset: int = 0) -> None:
    """Thin lines between NVLink domains along ``axis`` ("x" or "y")."""
    cuts = np.flatnonzero(np.diff(domain)) + 1 + offset
    if len(cuts) > 96:
        return
    for c in cuts:
        (ax.axhline if axis == "y" else ax.axvline)(c - 0.5, color="0.55", lw=0.4)


#: the least range of a heatmap's colour scale, in decades: the data's own min..max would
#: stretch a 30% difference between pairs over the whole colour map
MIN_DECADES = 2.0


def _heat(ax: Any, fig: Any, data: np.ndarray, title: str, ylabel: str, xlabel: str,
          ydom: np.ndarray, xdom: np.ndarray, extent: tuple, cmap: str = "viridis") -> None:
    shown = np.where(data > 0, np.log10(np.maximum(data, 1.0)), np.nan)
    top = float(np.nanmax(shown)) if np.isfinite(shown).any() else 1.0
    low = min(float(np.nanmin(shown)) if np.isfinite(shown).any() else 0.0, top - MIN_DECADES)
    im = ax.imshow(shown, cmap=cmap, interpolation="nearest", aspect="auto", extent=extent,
                   vmin=low, vmax=top)
    nonzero = data[data > 0]
    if nonzero.size:            # the spread in words: colours over 2 decades hide a 30% one
        title += f" (max/min {nonzero.max() / nonzero.min():.2g}x)"
    fig.colorbar(im, ax=ax, label="log10 bytes", fraction=0.05, pad=0.02)
    _domain_marks(ax, ydom, "y", int(extent[3] + 0.5))
    _domain_marks(ax, xdom, "x", int(extent[0] + 0.5))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)


def _timeline(ax: Any, name: str, pred: Any, result: Mapping[str, Any], end: float,
              domain: np.ndarray) -> None:
    num, num_src = result["num_ranks"], result["src_world_size"]
    raster = busy_raster(pred.replay, num, end)
    gap = max(2, num // 40)                 # a white band between sources and destinations
    img = _image(raster, np.arange(num))
    img = np.concatenate([img[:num_src], np.ones((gap,) + img.shape[1:]), img[num_src:]])
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=(0, end, len(img), 0))
    for label, lo, hi in (("sources", 0, num_src), ("destinations", num_src + gap, len(img))):
        ax.text(-0.01 * end, (lo + hi) / 2, f"{label}\n({hi - lo} ranks)", ha="right",
                va="center", fontsize=8)
    cuts = np.flatnonzero(np.diff(domain)) + 1
    rows = np.where(cuts < num_src, cuts, cuts + gap)
    if len(rows) <= 96:
        for r in rows:
            ax.axhline(r, color="0.55", lw=0.4)
    bounds = np.concatenate([[0], rows, [len(img)]])
    if len(bounds) - 1 <= 12:
        for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if hi - lo > gap:
                ax.text(1.005, 1 - (lo + hi) / 2 / len(img), f"domain {k}",
                        transform=ax.transAxes, fontsize=7, va="center")
    else:
        ax.text(1.005, 0.5, f"{len(bounds) - 1}\nNVLink\ndomains\n(grey\nlines)",
                transform=ax.transAxes, fontsize=7, va="center")
    bound = result["lower_bound_seconds"]
    ax.axvline(bound, color="k", ls="--", lw=1)
    ax.axvline(pred.seconds, color="crimson", lw=1.2)
    ax.set_yticks([])
    ax.set_xlim(0, end)
    ax.tick_params(labelsize=8)
    ax.set_title(f"{name}: {pred.seconds:.3f} s (red line; lower bound {bound:.3f} s, dashed)"
                 f" - {pred.num_rounds:,} rounds, {pred.num_messages:,} messages",
                 fontsize=9, loc="left")


def plot(path: str, result: Mapping[str, Any]) -> None:
    """Write ``path`` (see the module docstring) for a :func:`simulate` result made with
    ``busy=True``."""
    plt = require_matplotlib()
    from matplotlib.patches import Patch
    preds = [(k, result["_predictions"][k]) for k in ("direct", "relay")
             if k in result["_predictions"]]
    num, num_src = result["num_ranks"], result["src_world_size"]
    domain = np.asarray(result["_placement"].domain)
    end = 1.04 * max(max(p.seconds for _, p in preds), result["lower_bound_seconds"])
    fig = plt.figure(figsize=(16, 1.2 + 3.6 * len(preds)))
    grid = fig.add_gridspec(len(preds), 3, width_ratios=(3.2, 1.3, 1.3), wspace=0.35,
                            hspace=0.55, left=0.08, right=0.95, top=0.86, bottom=0.12)
    first = None
    for i, (name, pred) in enumerate(preds):
        ax = fig.add_subplot(grid[i, 0], sharex=first)
        first = first or ax
        _timeline(ax, name, pred, result, end, domain)
        if i == len(preds) - 1:
            ax.set_xlabel("seconds", fontsize=9)
        direct, forwarded = _pair_bytes(pred.traffic, num)
        _heat(fig.add_subplot(grid[i, 1]), fig, direct[:num_src, num_src:],
              f"{name}: bytes source -> destination", "source rank", "destination rank",
              domain[:num_src], domain[num_src:], (num_src - 0.5, num - 0.5, num_src - 0.5,
                                                   -0.5))
        ax3 = fig.add_subplot(grid[i, 2])
        if forwarded.any():
            _heat(ax3, fig, forwarded[num_src:, num_src:], f"{name}: bytes forwarded (relay)",
                  "forwarding destination rank", "destination rank", domain[num_src:],
                  domain[num_src:], (num_src - 0.5, num - 0.5, num - 0.5, num_src - 0.5),
                  cmap="Oranges")
            ax3.text(0.5, -0.17, "forwards stay inside an NVLink domain (squares on the "
                     "diagonal);\nthe diagonal itself is empty: no rank forwards to itself",
                     transform=ax3.transAxes, ha="center", va="top", fontsize=7, color="0.3")
        else:
            ax3.axis("off")
            ax3.text(0.5, 0.5, "no forwards\n(every byte comes from a source rank)",
                     ha="center", va="center", fontsize=9, color="0.4")
    fig.suptitle(f"{result['model']}: {result['src']} -> {result['dst']} on "
                 f"{result['cluster']} ({num} GPUs), {result['wire']['describe']}",
                 fontsize=11)
    both = _image(np.array([[[1.0, 0.0, 1.0]]]), np.arange(1))[0, 0]
    fig.legend(handles=[Patch(color=COLORS[0], label="network transfer"),
                        Patch(color=COLORS[1], label="NVLink transfer"),
                        Patch(color=COLORS[2], label="relay forward (NVLink)"),
                        Patch(color=both, label="receiving and forwarding at once")],
               loc="upper right", ncol=4, fontsize=8, frameon=False,
               bbox_to_anchor=(0.97, 0.955))
    _save(fig, path)
    plt.close(fig)


def _save(fig: Any, path: str) -> None:
    """Write ``fig``; a PNG as a 128-colour palette image (a quarter of the bytes; the
    octree keeps the few flat colours exact, where median cut merged the rare orange of
    the forwards into its neighbours. Pillow comes with matplotlib)."""
    if not path.lower().endswith(".png"):
        fig.savefig(path, dpi=90)
        return
    import io
    from PIL import Image
    buf = io.BytesIO()
    fig.savefig(buf, dpi=90, format="png")
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE).save(
            path, optimize=True)
