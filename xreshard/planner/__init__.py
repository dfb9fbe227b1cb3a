"""The planner: pure functions from layouts, a topology and a config to a call's plan.

Templates, streams and balance build the plan (``plan.plan``); ``schedule`` cuts it into
buckets and rounds; ``relay`` builds the two stages of a relayed refit. Nothing here
touches memory, a process or a transport (``tests/test_structure.py`` pins it).
"""
