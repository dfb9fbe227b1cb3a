"""Refitting a vLLM engine's speculative draft (a draft model, EAGLE, MTP) with its policy.

vLLM (0.32, 0.33) retargets one weight-update session at the draft:
``start_draft_weight_update()`` (``LLM``, ``AsyncLLM``, the HTTP route
``/start_draft_weight_update``) makes every worker call its backend's
``set_weight_update_target(draft_model, draft_model_config)``; the session's
``update_weights`` then load into the draft, and ``finish_weight_update`` calls
``reset_weight_update_target()`` (v1/worker/gpu_worker.py, ``_start_weight_update`` /
``finish_weight_update``; the CPU worker inherits them). The trainer side of the
``"xreshard"`` backend mirrors it: ``send_draft_weights(weights)`` next to
``send_weights(weights)``, one round each, the draft's after the policy's in the same pause.

Decision record.

* **The draft is a second destination, recorded like the policy.** Each worker records
  the draft on a meta copy built the way vLLM builds it (:func:`draft_build`: a
  ``"draft_model"`` draft under the target's config with the draft's model config and no
  quantization, ``DraftModelProposer._create_draft_vllm_config``; EAGLE/MTP heads under
  the target's config with ``model_config=draft_model_config``,
  ``SpecDecodeBaseProposer._get_model``), all-gathers the recordings, places them on the
  same world ranks and streams them through a Stream of their own (plans cached per
  target, a version per target). The draft's tensor parallelism is the target's: vLLM
  builds it in the worker's own TP group (``"draft_model"`` refuses a different
  ``draft_tensor_parallel_size``, v1/spec_decode/draft_model.py
  ``_raise_if_draft_tp_mismatch``; EAGLE/MTP are built under the target's parallel
  config), so the recording sees the draft's real shards.
* **Which target a round loads is vLLM's session, checked against the trainer's word.**
  The worker engine swaps its per-target state (recording, destination, stream, mode)
  in ``set_weight_update_target`` and back in ``reset_weight_update_target``; the trainer
  says ``{"draft": true}`` in the round's update info, and a disagreement refuses the
  round on every rank before anything moves. So does a draft whose recorded parameters
  include tensors vLLM shares with the policy (an EAGLE/MTP head's embedding or LM head,
  :func:`shared_with_policy`): a draft round would overwrite the policy's.
* **Whether a draft round can run is settled at init, on every process.** After joining,
  every process all-gathers what it knows (each worker: its engine's draft, or why there
  is none; trainer rank 0: whether every client can ``start_draft_weight_update``), so a
  draft round to an engine without a draft raises :class:`DraftError` with one message
  on every trainer rank, before any engine is asked. Rejected: letting vLLM refuse
  ``start_draft_weight_update`` (its ``RuntimeError`` reaches trainer rank 0 only; the
  other trainer ranks would wait out the timeout).
* **The draft takes what it loads.** The workers' draft groups reach the trainer at init,
  and a draft round sends only the tensors the draft loads, so an MTP head (or any draft
  whose weights are part of the policy's) is sent the policy's whole tree; a tensor the
  draft loads and the weights lack still refuses the round on every rank.
* **The weight version labels the policy.** A draft round passes no version to
  ``finish_weight_update``; the engine's weight version stays the policy's.
* Pipeline parallelism with a draft is refused by name (vLLM builds the drafter on the
  last stage only, ``if self.speculative_config and get_pp_group().is_last_rank``):
  TODO(draft-pp).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from xreshard.errors import RefitError

__all__ = ["DraftError", "draft_problem", "draft_build", "record_draft", "draft_verdict",
           "client_problem", "share_groups", "shared_with_policy", "TARGET_STATE"]

logger = logging.getLogger(__name__)

#: the worker engine's attributes that belong to one target (policy or draft)
TARGET_STATE = ("_recording", "_dest", "stream", "_inplace", "_init_errors", "last_report",
                "last_error", "peak_rss_growth")


class DraftError(RefitError):
    """A draft round that cannot run here: the engine has no draft model, its draft
    cannot be refit, or the trainer's client cannot start a draft session. Raised with
    the same message on every trainer process, before any engine is asked."""


def draft_problem(vllm_config: Any) -> str | None:
    """Why this engine has no draft the backend can refit (None: it has one)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ("it runs without speculative decoding (no speculative_config); start it with "
                "speculative_config={'method': 'draft_model' | 'eagle' | 'eagle3' | 'mtp', "
                "...} or refit the policy only (send_weights)")
    if spec.draft_model_config is None:
        return (f"its speculative method {spec.method!r} has no draft model weights; only "
                "'draft_model', EAGLE and MTP drafts are refit")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return ("it runs pipeline parallel and vLLM builds the draft on the last stage only; "
                "a draft refit under pipeline parallelism is not supported yet")
    return None


def draft_build(vllm_config: Any) -> tuple[Any, Any]:
    """``(vllm_config, model_config)`` vLLM builds this worker's draft with: ``build_model(
    cfg, model_config=mc)`` then builds the same model class, on this worker's TP group."""
    spec = vllm_config.speculative_config
    if spec.uses_draft_model():
        from vllm.config.utils import replace
        target = vllm_config.parallel_config
        return replace(vllm_config, quant_config=None, model_config=spec.draft_model_config,
                       parallel_config=replace(spec.draft_parallel_config, rank=target.rank)
                       ), None
    return vllm_config, spec.draft_model_config


def record_draft(vllm_config: Any, specs: Mapping[str, Any] | None) -> Any:
    """The draft's :class:`~.destination.EngineRecording` (collective over the engine's
    workers, as the policy's). ``specs`` default to the draft's checkpoint headers. An
    online-FP8 draft takes bf16 and quantizes itself: whether its kernels keep vLLM's
    quantizer's bytes (``online_refusals``) is checked for the policy's model only."""
    from .build import record_workers
    from .destination import EngineRecording

    cfg, model_config = draft_build(vllm_config)
    return EngineRecording(*record_workers(cfg, specs, model_config=model_config),
                           quantize_online=False)


def draft_verdict(everyone: list[Mapping[str, Any]], num_engines: int) -> str | None:
    """Why a draft round cannot run, from every process's init report (identical on every
    process); None: every engine has a draft and rank 0's clients can start a session.

    Args:
        everyone: each process's ``{"draft": ...}``: a worker's ``{"engine": e,
            "problem": str | None}``, trainer rank 0's ``{"client": str | None}``, other
            trainer processes' ``{}``.
        num_engines: the engines of the world.
    """
    problems: dict[int, str] = {}
    for p in everyone:
        if p.get("problem") and p.get("engine") is not None:
            problems.setdefault(int(p["engine"]), p["problem"])
    if problems:
        e, why = min(problems.items())
        which = f"engine {e}" if num_engines > 1 else "the engine"
        more = f" (and {len(problems) - 1} more engine(s))" if len(problems) > 1 else ""
        return f"{which} has no draft to refit{more}: {why}"
    client = next((p["client"] for p in everyone if p.get("client")), None)
    return client


def share_groups(stream: Any, timeout: float) -> None:
    """The draft's groups, from the first vLLM worker to every process (collective at
    init): the trainer then sends only the tensors the draft loads (an MTP head takes its
    ``mtp.*`` layers from the policy's whole tree)."""
    world = stream.world
    root = next(p for p, info in enumerate(world.processes) if info["group"] == "rollout")
    groups = world.broadcast_json(stream.groups if world.process_index == root else None,
                                  root_process=root, timeout=timeout,
                                  kind="xreshard-vllm/draft-groups")
    stream.set_groups(groups)


def shared_with_policy(draft_model: Any, policy_model: Any, params: list[str]) -> str | None:
    """Why a draft round must not write ``params`` (None: it may): some are the policy's
    own tensors, which vLLM shares into an EAGLE/MTP head (its embedding or LM head, when
    the draft's checkpoint has none or the same: ``_maybe_share_embeddings`` /
    ``_maybe_share_lm_head``); writing them would change the policy too."""
    policy = {id(p) for p in policy_model.parameters()}
    live = dict(draft_model.named_parameters(remove_duplicate=False))
    shared = sorted(n for n in params if n in live and id(live[n]) in policy)
    if not shared:
        return None
    return (f"the draft's {shared[:3]}{' ...' if len(shared) > 3 else ''} are the policy's own "
            "tensors (vLLM shares an EAGLE/MTP head's embedding or LM head with the target), "
            "so a draft round would overwrite the policy's; leave them out of the draft's "
            "draft_specs and refit them with the policy")


def client_problem(clients: list[Any]) -> str | None:
    """Why rank 0's clients cannot start a draft session (None: they can)."""
    for e, c in enumerate(clients):
        if not callable(getattr(c, "start_draft_weight_update", None)):
            return (f"the client of engine {e} ({type(c).__name__}) has no "
                    "start_draft_weight_update(); vLLM's LLM, AsyncLLM and the HTTP route "
                    "/start_draft_weight_update have it: use xreshard's LLMClient, or add "
                    "the method to your client (HTTP: POST /start_draft_weight_update)")
    return None
