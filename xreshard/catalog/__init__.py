"""Data about the world outside xreshard, for planning and simulating without frameworks.

* :mod:`xreshard.catalog.recipes`: how well-known setups (Megatron, vLLM, FSDP, JAX) shard
  each tensor of a model, as tables (``xreshard plan --src "megatron:pp=4,ep=16"``);
* :mod:`xreshard.catalog.models`: parameter inventories (names, shapes, dtype) of real
  models, read from the JSON files in ``models/`` (schema: docs/models.md).

Importing this package imports nothing else.
"""
