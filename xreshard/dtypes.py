"""Framework-neutral dtype names and sizes.

A dtype is carried as its canonical name (``"bfloat16"``, ``"float32"``, ...). Any object
whose ``str()`` is such a name works as input: numpy/ml_dtypes dtypes, ``jnp.bfloat16``,
``torch.float32`` (``"torch."`` is stripped).
"""

from __future__ import annotations

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
        raise LayoutError(
            f"dtype {dtype!r} is not supported; xreshard moves {', '.join(sorted(ITEMSIZE))} "
            "- view sub-byte or packed types as uint8 before describing them")
    return name


def itemsize(dtype: object) -> int:
    """Bytes per element of ``dtype``."""
    return ITEMSIZE[dtype_name(dtype)]
