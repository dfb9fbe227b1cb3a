"""Codecs: what changes the bytes of an item or a message on the wire (issue 32).

* :mod:`.kernels`: the one value that says which kernels every codec runs (from ``Tuning``);
* :mod:`.items`: item codecs (plain, cast, FP8 on the host or a device): ``pack``,
  ``unpack``, ``wire_bytes``;
* :mod:`.delta`: the message codec of a delta call (``Sized`` framing: headers one group
  ahead of their payloads), on host or device memory.

The executor (:mod:`xreshard.runtime.execute`) runs every codec through one round loop and
one pipelined loop.
"""
