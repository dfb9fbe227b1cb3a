"""Framework-neutral dtype names and sizes.

A dtype is carried as its canonical name (``"bfloat16"``, ``"float32"``, ...). Any object
whose ``str()`` is such a name works as input: numpy/ml_dtypes dtypes, ``jnp.bfloat16``,
``torch.float32`` (``"torch."`` is stripped).

The canonical name is the truth about a tensor's values; an array's own dtype is only its
element size. A binding may be a raw-bits view (``uint16`` for bf16: what DLPack gives
when the importer has no bf16 type) or a typed one; :func:`as_dtype` and :func:`bits`
turn either into what a copy needs, the same way for numpy and CuPy arrays.
"""

from __future__ import annotations

import functools
from typing import Any

from .errors import LayoutError

#: bytes per element of every dtype xreshard moves
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bool_": "bool",
            "cfloat": "complex64", "cdouble": "complex128", "long": "int64", "int": "int32"}

#: short spellings people type for a dtype, suggested (not accepted: a name is explicit)
_SHORT = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32",
          "f32": "float32", "fp64": "float64", "f64": "float64", "fp8": "float8_e4m3fn",
          "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "i32": "int32", "i64": "int64"}


def dtype_name(dtype: object) -> str:
    """Canonical name of ``dtype``; raises LayoutError for dtypes xreshard cannot move."""
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    if not isinstance(name, str):
        try:  # scalar type classes (np.float32, jnp.bfloat16) name their dtype through numpy
            import numpy as np
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = name.removeprefix("torch.").removeprefix("dtype(").strip("')\"")
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE:
        hint = _SHORT.get(name.lower())
        raise LayoutError(
            f"dtype {dtype!r} is not supported"
            + (f" (did you mean {hint!r}?)" if hint else "")
            + f"; xreshard moves {', '.join(sorted(ITEMSIZE))} "
            "- view sub-byte or packed types as uint8 before describing them")
    return name


def itemsize(dtype: object) -> int:
    """Bytes per element of ``dtype``."""
    n = ITEMSIZE.get(dtype) if isinstance(dtype, str) else None   # canonical: the hot path
    return n if n is not None else ITEMSIZE[dtype_name(dtype)]


#: what numpy calls the types it lacks (bf16, float8): their ml_dtypes names
_ML_DTYPES = frozenset(n for n in ITEMSIZE if n == "bfloat16" or n.startswith("float8"))


@functools.cache
def numpy_dtype(name: str) -> Any:
    """numpy dtype of a canonical dtype name (bfloat16 and float8 through ml_dtypes)."""
    import numpy as np
    name = dtype_name(name)
    if name not in _ML_DTYPES:
        return np.dtype(name)
    from .extras import require
    ml_dtypes = require("ml_dtypes", "jax", f"moving {name}")
    return np.dtype(getattr(ml_dtypes, name))


@functools.cache
def bits_dtype(itemsize: int) -> Any:
    """The unsigned integer (or opaque) numpy dtype of ``itemsize`` bytes."""
    import numpy as np
    return np.dtype({1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}.get(itemsize,
                                                                             f"V{itemsize}"))


def bits(arr: Any) -> Any:
    """``arr`` (numpy or CuPy, any dtype) viewed as same-size unsigned ints, zero-copy."""
    want = bits_dtype(arr.dtype.itemsize)
    return arr if arr.dtype == want else arr.view(want)


def as_dtype(arr: Any, name: str) -> Any:
    """``arr`` (numpy or CuPy) viewed as the canonical dtype ``name``, zero-copy.

    ``arr`` holds that dtype's bits, typed or not (a ``uint16`` view of bf16 values). CuPy
    views any dtype; whether its kernels can compute with it (bf16 needs CuPy >= 14,
    ml_dtypes and numpy >= 2.1.2; float8 never) is checked before a cast, not here.
    """
    want = numpy_dtype(name)
    if arr.dtype == want:
        return arr
    if arr.dtype.itemsize != want.itemsize:
        raise LayoutError(f"an array of dtype {arr.dtype} ({arr.dtype.itemsize} bytes) cannot "
                          f"hold {name} values ({want.itemsize} bytes)")
    return arr.view(want)
