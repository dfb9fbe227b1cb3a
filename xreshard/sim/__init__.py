"""The refit simulator's parts (see ``xreshard/simulate.py`` for the entry points).

* ``traffic``: the messages a schedule sends, as arrays (round, src, dst, bytes); the
  direct schedule exactly as ``xreshard.schedule.schedule`` would cut it, for every rank.
* ``relay``: a relay schedule built from a plan (one network copy per destination domain,
  NVLink fan-out), as a pure function.
* ``engine``: replays messages on a cluster model, round by round, max-min fair.
* ``plot``: per-rank timeline and transfer heatmap (matplotlib, optional).

Pure numpy; nothing here imports a framework.
"""
