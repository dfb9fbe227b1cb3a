"""The worker extension an FP8 test engine starts with: xreshard's, with vLLM's FP8 kernel
choice stood in for where this CPU has none.

vLLM's CPU FP8 GEMM kernels need AMX, and without a kernel vLLM refuses to build an FP8
layer at all ("Failed to find a kernel that can implement the ScaledMM linear layer"), so
no FP8 engine starts on the CI's CPUs. vLLM imports this module by name in each of its
worker processes before it builds the model (``worker_extension_cls``); importing it there
enters :func:`xreshard.adapters.vllm.kernel_stand_ins` for the rest of the process, so the
engine builds its FP8 layers with vLLM's own parameters and loaders, and with a stand-in
kernel whose post-processing keeps the loaded codes and scales (its GEMM raises: such an
engine loads and refits, it does not generate). With ``enforce_eager`` vLLM's CPU worker
runs no warm-up forward, so the engine starts. Only tests name this module.
"""

from __future__ import annotations

from xreshard.adapters.vllm import kernel_stand_ins
from xreshard.integrations.worker import CheckpointWorkerExtension

#: the ``worker_extension_cls`` of an FP8 test engine
WORKER_EXTENSION = "tests.tunix_fp8_worker.StandInWorkerExtension"

_STAND_INS = kernel_stand_ins()
_STAND_INS.__enter__()          # for the life of the worker process (it only loads weights)


class StandInWorkerExtension(CheckpointWorkerExtension):
    """xreshard's worker extension, in a process where FP8 kernels are stood in for."""
