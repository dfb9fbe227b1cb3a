"""Shared pytest setup.

JAX reads its platform and CPU device count once, when its backend starts, so they must
be set before any test imports jax: tests see 8 CPU devices (layouts.md section 2.3).
Environment variables, not ``jax.config.update``, so nothing imports jax here; an
explicit setting in the caller's environment wins.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
