"""Which kernels a call's codecs run: one value, built once from ``Tuning``.

Every codec that computes on bytes (the FP8 quantizers, the delta diff and apply) asks
this value, never the environment, which framework runs its work on device memory and
whether host bindings take the device path too (tests without a GPU):

```
 Tuning(device_kernels, host_device_ops, quant_threads) --Kernels.of--> Kernels
     handed to the executor, and by it to every codec: quantize, encode, apply
```

So ``Tuning(device_kernels="jax")`` reaches the FP8 device quantizer exactly as it reaches
the delta diff (issue 32: before, the FP8 path asked for "auto" whatever the tuning said).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..device_ops import DeviceOps, is_host, ops_for

__all__ = ["Kernels", "HOST"]


@dataclass(frozen=True)
class Kernels:
    """The kernels of one call (see the module docstring)."""

    framework: str = "auto"
    """``Tuning.device_kernels``: "jax", "torch" or "auto" (see :func:`.device_ops.ops_for`)."""
    on_host: str | None = None
    """``Tuning.host_device_ops``: "jax" or "torch" runs host bindings through the device
    path with that framework's CPU ops (tests without a GPU); None: host bindings take the
    host path."""
    quant_threads: int | None = None
    """``Tuning.quant_threads``: threads of the host FP8 quantizer (None: the CPUs this
    process may run on)."""

    @classmethod
    def of(cls, tuning: Any) -> Kernels:
        """The kernels a ``Tuning`` asks for (None: the defaults)."""
        if tuning is None:
            return HOST
        return cls(tuning.device_kernels, tuning.host_device_ops, tuning.quant_threads)

    @property
    def prefer(self) -> str:
        """The framework asked of :func:`.device_ops.ops_for`: the tuning's choice, else
        the host switch's, else "auto"."""
        if self.framework != "auto":
            return self.framework
        return self.on_host or "auto"

    def takes_device(self, arr: Any) -> bool:
        """Whether work on ``arr`` runs on the device path: device memory, or host memory
        with :attr:`on_host` set."""
        return not is_host(arr) or self.on_host is not None

    def device_path(self, *bindings: Any) -> bool:
        """Whether some binding of these ``{key: binding}`` maps takes the device path."""
        if self.on_host is not None:
            return True
        for side in bindings:
            for b in side.values():
                for arr in (b if isinstance(b, (list, tuple)) else (b,)):
                    if not is_host(arr):
                        return True
        return False

    def ops(self, role: str) -> DeviceOps:
        """The ops for ``role`` ("send" or "receive", :func:`.device_ops.ops_for`)."""
        return ops_for(role, self.prefer)


#: the defaults: the host path for host memory, "auto" on devices
HOST = Kernels()
