"""The intermediate representation: values that describe where bytes live.

``Mesh``, ``Layout`` (product and explicit form), ``Region``, the interval and region
geometry, and ``Topology``. Pure values: nothing here imports the planner, the runtime
or a framework (``tests/test_structure.py`` pins it).
"""
