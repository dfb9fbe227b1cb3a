"""Framework bridges (jax, torch, vllm). Each imports its framework lazily.

The core finds the JAX and torch bridges by module path through :mod:`xreshard.runtime.registry`
(it never imports this package); each provides ``accepts`` and ``refit_bind`` (and the
optional hooks the registry lists). A bridge of your own registers the same way::

    xreshard.runtime.registry.register_adapter("mlx", "my_pkg.xreshard_mlx", requires="mlx")
"""
