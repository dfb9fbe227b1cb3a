"""The vLLM worker extension the integrations start engines with.

:class:`~xreshard.adapters.vllm.WorkerExtension` (reports, digests) plus
``xreshard_load_checkpoint``: vLLM's own in-place reload of a safetensors checkpoint, for an
engine started with ``load_format="dummy"`` (which vLLM's ``reload_weights(weights_path=)``
refuses: the dummy loader has no files to read). It is how the examples and tests check a
refit: the engine's weights after the refit against vLLM's own load of the same weights.
Imports nothing heavy (the workers import it by name).
"""

from __future__ import annotations

from typing import Any

from xreshard.adapters.vllm.plugin import WorkerExtension

__all__ = ["CheckpointWorkerExtension", "WORKER_EXTENSION"]

#: the ``worker_extension_cls`` the integrations pass to ``vllm.LLM``
WORKER_EXTENSION = "xreshard.integrations.worker.CheckpointWorkerExtension"


class CheckpointWorkerExtension(WorkerExtension):
    """``WorkerExtension`` + ``xreshard_load_checkpoint(weights_path)``."""

    model_runner: Any       # the vLLM worker this class is mixed into has it

    def xreshard_load_checkpoint(self, weights_path: str) -> list[str]:
        """Load every ``*.safetensors`` file in ``weights_path`` into the live model through
        vLLM's own loaders (``model_runner.reload_weights`` with the checkpoint's tensors:
        ``load_weights`` under layerwise reload, then vLLM's processing), then re-process
        tied modules as after vLLM's reload (see ``reprocess_tied``); returns those."""
        import glob
        import os

        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        files = sorted(glob.glob(os.path.join(weights_path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {weights_path!r}")
        self.model_runner.reload_weights(
            weights_iterator=safetensors_weights_iterator(files, use_tqdm_on_load=False),
            is_checkpoint_format=True)
        return self.xreshard_reprocess_tied()
