"""Item codecs: how one item of a bucket (a program step, :class:`..programs.Step`) becomes
bytes of its message and lands again, by its format (``xreshard.planner.formats``).

* :class:`CastCodec` (``Plain`` and ``Cast(wire)``): the item's elements, cast to the wire
  dtype by the sender where it differs (bits copied as they are otherwise) and back by the
  receiver (:func:`..copies.copy_into`), in row-major order, or for an item of a tensor
  its senders hold transposed (``Step.transposed``) in theirs: the receiver transposes;
* :class:`Fp8Codec` (``Fp8``): the item's whole blocks quantized by the sender (host, or
  the device that holds them, with the call's :class:`.kernels.Kernels`), its scales then
  its codes in the message; the receiver writes each into its binding
  (:mod:`..quantized`). Its work ahead (quantizing before ``refit/check``) is
  :mod:`..quantize_ahead`'s, taken at pack time.

Every codec has ``pack(e, buf, bindings)``, ``unpack(e, buf, bindings)`` and
``wire_bytes(e)``; :class:`ItemCodecs` picks one per step. The executor keeps what is
faster than a codec per item for plain host items (one ``np.concatenate`` over a run of
small items, one assignment per unpacked item), which is the cast codec's bytes.
"""

from __future__ import annotations

from typing import Any, Mapping

from .. import quantized
from ..copies import array_module, copy_into
from .kernels import HOST, Kernels

__all__ = ["CastCodec", "Fp8Codec", "ItemCodecs", "item", "message_view"]


def item(binding: Any, i: int | None, slices: tuple) -> Any:
    """The view a program step names: buffer ``i`` of an explicit binding (None: the one
    array of a product binding), sliced."""
    return (binding if i is None else binding[i])[slices]


def message_view(buf: Any, e: Any) -> Any:
    """Step ``e``'s bytes of message ``buf`` as an array of the item's canonical shape in
    the wire's bits: row-major, or for a :attr:`..programs.Step.transposed` step the
    transpose of the row-major ``region.T`` the message holds (a column-major view)."""
    data = buf[e.lo:e.hi].view(e.bits)
    if e.transposed:
        return data.reshape(e.shape[::-1]).T
    return data.reshape(e.shape)


class CastCodec:
    """``Plain`` and ``Cast(wire)`` items (see the module docstring)."""

    def pack(self, e: Any, buf: Any, bindings: Mapping) -> None:
        out = message_view(buf, e)
        copy_into(array_module(buf), out, e.wire, item(bindings[e.key], e.index, e.slices),
                  e.dtype)

    def unpack(self, e: Any, buf: Any, bindings: Mapping) -> None:
        dst = item(bindings[e.key], e.index, e.slices)
        copy_into(array_module(dst), dst, e.dtype, message_view(buf, e), e.wire)

    def wire_bytes(self, e: Any) -> int:
        return e.hi - e.lo


class Fp8Codec:
    """``Fp8`` items: scales, then codes (see the module docstring)."""

    def __init__(self, kernels: Kernels = HOST):
        self.kernels = kernels

    def pack(self, e: Any, buf: Any, bindings: Mapping) -> None:
        quantized.pack(e, buf, bindings, item, self.kernels)

    def unpack(self, e: Any, buf: Any, bindings: Mapping) -> None:
        quantized.unpack(e, buf, bindings, item)

    def wire_bytes(self, e: Any) -> int:
        return e.hi - e.lo          # the scales' bytes, then the codes'


CAST = CastCodec()


class ItemCodecs:
    """The item codecs of one call, built with its kernels: :meth:`of` a step."""

    def __init__(self, kernels: Kernels = HOST):
        self.cast = CAST
        self.fp8 = Fp8Codec(kernels)

    def of(self, e: Any) -> CastCodec | Fp8Codec:
        """The codec of program step ``e`` (its ``quant``: an FP8 item)."""
        return self.cast if e.quant is None else self.fp8
