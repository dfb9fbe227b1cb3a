"""The planner: pure functions from layouts, a topology and options to a call.

Templates, streams and balance build the plan (``plan.plan``); ``schedule`` cuts it into
buckets and rounds; ``relay`` builds the two stages of a relayed refit and their
overlapped schedule; ``prepare.prepare`` returns the whole call as one immutable
``PreparedCall``, which the runtime runs. Nothing here touches memory, a process or a
transport, or imports the runtime (``tests/test_structure.py`` pins it).
"""
