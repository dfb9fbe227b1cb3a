"""Framework bridges (jax, torch, vllm). Each imports its framework lazily."""
