"""Not the core: the demo, the multi-process launcher and test helpers.

* :mod:`xreshard.tools.launch`: ``launch(fn, roles)`` runs one fresh process per
  :class:`~xreshard.tools.launch.Role` (JAX on N CPU devices, torch, or plain), collects
  their JSON results and kills everything at the timeout; tests, benchmarks and the demo
  start their jobs with it.
* :mod:`xreshard.tools.testing`: ``run_local`` executes a plan between numpy arrays in one
  process, as the executor moves regions, for planner tests.
* :mod:`xreshard.tools.demo`: ``xreshard demo``, a JAX trainer refitting torch DTensor
  processes.

Importing this package imports nothing else.
"""
