"""FP8 destinations quantized on the way, as an extension: the sender's work ahead
(:mod:`xreshard.runtime.quantize_ahead`, ``Tuning.fp8_ahead``) and the report's
``quantized`` figures. The planner decides per tensor whether a call quantizes, so every
Refit holds this extension; on a call that quantizes nothing each hook returns at once
(one attribute test: no per-tensor work)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from . import Extension
from ..quantize_ahead import QuantAhead

__all__ = ["Fp8"]


class Fp8(Extension):
    """Quantize this process's FP8 items while the call checks and plans."""

    name = "fp8"

    def __init__(self, ahead: bool = True):
        self.ahead = QuantAhead(enabled=ahead)

    def check(self, call: Any) -> tuple[Any, list[list[str]]]:
        """Start the work ahead (not on a call refused already, and not for the buckets
        a delta encoder quantizes as it diffs them: each FP8 item once)."""
        if not call.errors and call.prepared is not None and call.prepared.quant is not None:
            self.ahead.start(call.prepared, call.src, call.programs, skip=call.skip_ahead)
        return None, []

    @contextlib.contextmanager
    def begin(self, call: Any) -> Iterator[None]:
        if call.prepared.quant is None:     # nothing quantized: any work ahead ends at end()
            yield
            return
        with self.ahead.used(call.prepared, call.programs, call.config.timeout):
            yield

    def report(self, call: Any, fields: dict[str, Any]) -> None:
        if call.prepared.quant is not None:
            from ..quantized import quantized_report
            fields["quantized"] = quantized_report(call.prepared, call.stats)

    def end(self) -> None:
        self.ahead.stop()
