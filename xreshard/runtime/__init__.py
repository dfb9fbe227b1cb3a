"""The runtime: what touches memory and processes.

The world and its store, bindings and their checks, the metadata collectives, the
executor that runs a prepared call, checksums, and the user-facing ``Refit``.
"""
