"""The refit simulator: how long a refit takes on a cluster, without a cluster.

* ``simulate``: the entry points (``simulate()``, ``xreshard simulate``);
* ``cluster``: the cluster model (presets ``dgx-h100``, ``hgx-h200``, ``gb200-nvl72``, JSON
  clusters) and placements of world ranks on GPUs;
* ``traffic``: the messages a schedule sends, as arrays (round, src, dst, bytes); the
  direct schedule exactly as ``xreshard.planner.schedule.schedule`` would cut it, for every rank.
* ``relay``: a relay schedule built from a plan (one network copy per destination domain,
  NVLink fan-out), as a pure function.
* ``engine``: replays messages on a cluster model, round by round, max-min fair.
* ``plot``: per-rank timeline and transfer heatmap (matplotlib, optional).

Pure numpy; nothing here imports a framework.
"""
