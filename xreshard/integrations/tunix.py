"""A Tunix rollout on a real vLLM engine, refit shard to shard from the actor mesh.

Tunix's own vLLM rollout (``VllmRollout``) drives tpu-inference: it builds ``vllm.LLM`` in
the trainer process and reshards JAX arrays into the runner's JAX state, so on GPUs (or
CPU) a Tunix user has no vLLM rollout. :class:`XreshardVllmRollout` is one, plugged in
where Tunix takes a custom engine::

    cluster_config = rl_cluster_lib.ClusterConfig(
        rollout_engine=functools.partial(XreshardVllmRollout, tensor_parallel_size=2),
        role_to_mesh={Role.ACTOR: mesh, Role.REFERENCE: mesh, Role.ROLLOUT: mesh}, ...)

Decision record.

* The engine runs in processes of its own, never in the trainer's: ``vllm.LLM`` with V1
  multiprocessing (the engine core and, with TP > 1, every worker are child processes;
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which Tunix's sampler sets, is refused), started
  with ``load_format="dummy"`` and ``weight_transfer_config={"backend": "xreshard"}`` from
  an HF config written from the Tunix model's config. Or attach to one (``llm=``): any
  object with ``vllm.LLM``'s ``generate`` and weight-transfer methods.
* ``update_params`` is xreshard's vLLM backend (``XreshardTrainerWeightTransferEngine``):
  every JAX device of the actor mesh sends its own shards to the vLLM ranks that hold
  them, through naming rules (a per-family table, chosen from the model class:
  :mod:`xreshard.integrations.tunix_tables`) that view Tunix's ``[D, N, H]`` kernels as
  HF tensors without a copy (Gemma's ``[N, D, H]`` q/k/v kernels: a copy of each shard).
  No array is gathered on the trainer. RLCluster calls it under
  ``jax.transfer_guard(... "disallow_explicit")`` on CPU; reading a shard's host buffer is
  no device transfer there, so the refit runs under ``transfer_guard("allow")``.
* The first sync happens at construction (Tunix's engines do the same: generation comes
  before the first ``sync_weights``). ``model()`` is None: the rollout model lives in the
  engine's processes, and a None model tells Tunix's learner to sync every step
  (``is_sharing_weights`` is False).
* ``generate`` tokenizes with Tunix's tokenizer (the engine skips its own), left-pads the
  prompts to ``max_prompt_length`` (truncating from the left, as Tunix's samplers do),
  samples with one seed per request (``seed + i``: a GRPO group of identical prompts must
  not get identical samples) and returns the sampled tokens' logprobs.
  ``get_per_token_logps`` answers from those (kept from one refit to the next: the rows
  Tunix asks about are the rows it just generated, in micro-batches) and scores any other
  row on the engine (vLLM's prompt logprobs).
* Options pass through: ``delta`` and ``atomic`` (:class:`~xreshard.config.RefitConfig`
  fields every worker gets at init), ``wire_dtype``, and ``engine_kwargs`` / ``hf_config``
  for the engine: a block-FP8 engine (``hf_config={"quantization_config": ...}``,
  ``engine_kwargs={"quantization": "fp8"}``) is refit through the backend's
  quantize-on-the-way path (codes and scales on the wire; docs/tunix.md).
* LoRA (a model qwix's ``apply_lora_to_model`` gave ``nnx.LoRAParam`` factors): the engine
  starts with ``enable_lora`` and serves the adapter from its LoRA slot
  (``lora_request``); ``update_params`` with ``nnx.LoRAParam`` in ``filter_types`` (what
  RLCluster passes for a LoRA actor) refits only the adapter, through xreshard's in-memory
  LoRA refit (``send_loras``), and the base weights never move again after the first sync.
  qwix's factors are kernels, ``A [in, r]`` and ``B [r, out]``, with heads kept as dims
  (``q_proj`` ``B [r, N, H]``, ``o_proj`` ``A [N, H, r]``): a naming table per family views
  them as PEFT's ``lora_A [r, in]`` / ``lora_B [out, r]`` through the same views of the
  shards as the base weights, never a copy. qwix keeps ``alpha`` in its provider, not in
  the model, so it is an argument (``lora_alpha``); qwix scales by ``alpha / rank`` as PEFT
  does without rsLoRA.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from xreshard.errors import RefitError
from xreshard.extras import require

from .tunix_tables import (FAMILIES, UNMAPPED, Family, HeadsToRows, TunixNamingError,
                           check_names, family_of, hf_config_of, tunix_lora_rules, tunix_rules,
                           write_model_dir)

logger = logging.getLogger(__name__)

__all__ = ["XreshardVllmRollout", "TunixNamingError", "Family", "FAMILIES", "UNMAPPED",
           "HeadsToRows", "family_of", "tunix_rules", "tunix_lora_rules", "hf_config_of",
           "write_model_dir", "check_names", "split_lora", "lora_adapter"]

base_rollout = require("tunix.rl.rollout.base_rollout", "tunix", "xreshard.integrations.tunix")


def pure_tree(params: Any) -> Any:
    """An ``nnx.State`` (leaves ``nnx.Param``/``Variable``) as a plain nested dict of arrays."""
    to_pure = getattr(params, "to_pure_dict", None)
    return to_pure() if callable(to_pure) else params


def split_lora(params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(base, lora)``: the ``/``-joined leaves of ``params`` (an ``nnx.State`` or a
    pytree), the qwix LoRA factors (``*_lora_a``, ``*_lora_b``) apart from the rest."""
    flat = dict(_flat_items(pure_tree(params)))
    lora = {n: a for n, a in flat.items() if n.endswith(("_lora_a", "_lora_b"))}
    return {n: a for n, a in flat.items() if n not in lora}, lora


def _flat_items(tree: Any) -> list[tuple[str, Any]]:
    from xreshard.adapters.naming import flatten_tree
    return list(flatten_tree(tree).items())


@dataclass(frozen=True)
class _Described:
    """A factor as a :class:`~xreshard.adapters.lora.LoRAAdapter` describes it (its bytes
    are bound elsewhere, as views of the shards)."""

    shape: tuple[int, ...]
    dtype: Any


def lora_adapter(lora: Mapping[str, Any], rules: Sequence[Any], *, name: str, lora_id: int,
                 alpha: float, arrays: bool = False) -> Any:
    """The :class:`~xreshard.adapters.lora.LoRAAdapter` of qwix factors ``lora`` (``/``-joined
    paths -> arrays) under ``rules`` (:func:`tunix_lora_rules`): PEFT-oriented shapes
    (``arrays=False``: described only, the refit binds views of the shards), or numpy
    copies of the factors (``arrays=True``: for ``write_peft_dir``, a reference load).

    Raises:
        LoRAError: the factors disagree on the rank.
    """
    import numpy as np

    from xreshard.adapters.lora import LoRAAdapter, LoRAError, peft_module
    from xreshard.adapters.naming import NameMap

    views = NameMap(tuple(rules)).apply({n: tuple(a.shape) for n, a in lora.items()})
    host = {n: np.asarray(a) for n, a in lora.items()} if arrays else {}
    pairs: dict[str, dict[str, Any]] = {}
    for refit_name, view in views.items():
        module, ab = peft_module(refit_name.split("/", 1)[1])
        src = lora[view.sources[0].name]
        pairs.setdefault(module, {})[ab] = (np.ascontiguousarray(view.view(host)) if arrays
                                            else _Described(tuple(view.shape), src.dtype))
    ranks = {p["A"].shape[0] for p in pairs.values()} | {p["B"].shape[1] for p in pairs.values()}
    if len(ranks) != 1:
        raise LoRAError(f"qwix LoRA factors of ranks {sorted(ranks)}: one rank per adapter "
                        "(vLLM's rank_pattern is not mapped yet)")
    return LoRAAdapter(name, lora_id=lora_id, r=ranks.pop(), alpha=alpha,
                       weights={m: (p["A"], p["B"]) for m, p in sorted(pairs.items())})


# ---------------------------------------------------------------------------- the rollout

@dataclass
class _InitInfo:
    """Carries ``delta`` / ``atomic`` into the backend's :class:`RefitConfig` (the workers
    build theirs from the trainer's ``config.to_dict()``)."""

    delta: bool = False
    atomic: bool = False


def _init_info_cls() -> Any:
    from xreshard.adapters.vllm import XreshardTrainerInitInfo

    @dataclass
    class TunixInitInfo(XreshardTrainerInitInfo):
        delta: bool = False
        atomic: bool = False

        def refit_config(self) -> Any:
            return dataclasses.replace(super().refit_config(), delta=self.delta,
                                       atomic=self.atomic)
    return TunixInitInfo


_BaseRollout: Any = base_rollout.BaseRollout

#: vLLM's ``max_lora_rank`` choices (``vllm.config.lora.MaxLoRARanks``, 0.32)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class XreshardVllmRollout(_BaseRollout):
    """A Tunix ``BaseRollout`` on a real vLLM engine that xreshard refits shard to shard.

    Tunix builds it as ``rollout_engine(rollout_actor=, tokenizer=, mesh=,
    rollout_config=)``; bind the rest with ``functools.partial``.

    Args:
        rollout_actor: the Tunix model whose weights the engine serves (RLCluster passes
            the actor for a custom engine); its class picks the naming table.
        tokenizer: Tunix's tokenizer (HF, SentencePiece, or any object with ``encode``,
            ``decode``, ``bos_id``, ``eos_id``, ``pad_id``).
        mesh: the rollout mesh RLCluster passes (unused: the engine has its own devices).
        rollout_config: Tunix's ``RolloutConfig`` (sampling knobs, lengths,
            ``tensor_parallel_size`` when ``tensor_parallel_size`` is not given).
        tensor_parallel_size: the engine's TP size (default ``rollout_config``'s, else 1).
        llm: attach to this running engine (``vllm.LLM`` started with
            ``weight_transfer_config={"backend": "xreshard"}``) instead of starting one.
        model_dir: where the engine's ``config.json`` is written (default a temp dir).
        engine_kwargs: more ``vllm.LLM`` arguments (``dtype``, ``max_model_len``,
            ``quantization``, ...), over the defaults.
        hf_config: fields over the written ``config.json`` (e.g. ``quantization_config``).
        rules, rule_params: a naming table of your own (default the family's).
        delta, atomic, wire_dtype, timeout, stream_bytes: refit options
            (:class:`~xreshard.config.RefitConfig`, ``XreshardTrainerInitInfo``).
        lora_alpha: qwix's ``LoraProvider(alpha=...)``, for a model with LoRA factors
            (required then: qwix keeps it in the provider, not in the model).
        lora_name, lora_id: the adapter's name and slot in the engine (vLLM's
            ``lora_name`` / ``lora_int_id``); ``generate`` serves it.
        lora_rules: a LoRA naming table of your own (default :func:`tunix_lora_rules`).
    """

    def __init__(self, rollout_actor: Any = None, tokenizer: Any = None, mesh: Any = None,
                 rollout_config: Any = None, *, tensor_parallel_size: int | None = None,
                 llm: Any = None, model_dir: str | None = None,
                 engine_kwargs: Mapping[str, Any] | None = None,
                 hf_config: Mapping[str, Any] | None = None,
                 rules: Sequence[Any] | None = None, rule_params: Mapping[str, int] | None = None,
                 delta: bool = False, atomic: bool = False, wire_dtype: str | None = None,
                 timeout: float = 300.0, stream_bytes: int | None = None,
                 lora_alpha: float | None = None, lora_name: str = "tunix", lora_id: int = 1,
                 lora_rules: Sequence[Any] | None = None) -> None:
        import jax
        from flax import nnx
        from tunix.generate import tokenizer_adapter

        if rollout_actor is None:
            raise RefitError("XreshardVllmRollout needs rollout_actor (the Tunix model whose "
                             "weights the engine serves)")
        if jax.process_count() > 1:
            raise RefitError(f"XreshardVllmRollout runs in one controller process (Tunix's "
                             f"RLCluster); this JAX has {jax.process_count()} processes")
        self._config = rollout_config if rollout_config is not None \
            else base_rollout.RolloutConfig()
        self._tokenizer: Any = tokenizer if tokenizer is None or isinstance(
            tokenizer, tokenizer_adapter.TokenizerAdapter) \
            else tokenizer_adapter.TokenizerAdapter(tokenizer)
        self._actor_name = type(rollout_actor).__name__
        self._rules = tuple(rules) if rules is not None else tunix_rules(rollout_actor)
        base, lora = split_lora(nnx.state(rollout_actor, nnx.Param))
        check_names(self._rules, list(base), self._actor_name)
        self._lora: Any = None      # (rules, name, id, alpha) of a LoRA model
        lora_kwargs: dict[str, Any] = {}
        if lora:
            if lora_alpha is None:
                raise RefitError(f"{self._actor_name} has qwix LoRA factors ({len(lora)} "
                                 "nnx.LoRAParam leaves): pass lora_alpha= (the alpha of qwix's "
                                 "LoraProvider; the model does not keep it)")
            lrules = tuple(lora_rules) if lora_rules is not None \
                else tunix_lora_rules(rollout_actor, lora_name)
            check_names(lrules, list(lora), self._actor_name)
            self._lora = (lrules, lora_name, int(lora_id), float(lora_alpha))
            rank = self._adapter(lora).r
            lora_kwargs = {"enable_lora": True, "max_loras": 1,
                           "max_lora_rank": min(x for x in _VLLM_LORA_RANKS if x >= rank)}
        tp = tensor_parallel_size or (self._config.tensor_parallel_size
                                      if self._config.tensor_parallel_size > 0 else 1)
        self.tensor_parallel_size = tp
        self._tmp = None
        if llm is None:
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                raise RefitError("VLLM_ENABLE_V1_MULTIPROCESSING=0 would build the vLLM "
                                 "engine inside the trainer process (Tunix's own sampler sets "
                                 "it); unset it: XreshardVllmRollout runs the engine in "
                                 "processes of its own")
            if model_dir is None:
                model_dir = self._tmp = tempfile.mkdtemp(prefix="xreshard-tunix-")
            write_model_dir(rollout_actor, model_dir, hf_config)
            llm = self._start_engine(model_dir, tp, {**lora_kwargs, **(engine_kwargs or {})})
        self.llm = llm
        from xreshard.adapters.vllm import LLMClient, XreshardTrainerWeightTransferEngine
        info = _init_info_cls()(rank=0, engine_world_size=tp, rules=self._rules,
                                rule_params=rule_params, timeout=timeout,
                                wire_dtype=wire_dtype, stream_bytes=stream_bytes,
                                delta=delta, atomic=atomic)
        self._engine = XreshardTrainerWeightTransferEngine.trainer_init(
            info, client=LLMClient(llm))
        self.last_report: Any = None
        self.last_lora_report: Any = None
        self.refit_seconds: list[float] = []
        self._calls = 0
        self._last: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
        # the first sync: generation comes before RLCluster's first sync_weights
        self.update_params(nnx.state(rollout_actor, nnx.Param), (nnx.Param,))

    def _start_engine(self, model_dir: str, tp: int, engine_kwargs: Mapping[str, Any]) -> Any:
        from vllm import LLM

        from .worker import WORKER_EXTENSION
        c = self._config
        kwargs: dict[str, Any] = {
            "model": model_dir, "skip_tokenizer_init": True, "tensor_parallel_size": tp,
            "load_format": "dummy", "enforce_eager": True, "seed": 0,
            "max_model_len": int(c.max_prompt_length + c.max_tokens_to_generate),
            "logprobs_mode": c.rollout_vllm_logprobs_mode,
            "worker_extension_cls": WORKER_EXTENSION,
            "weight_transfer_config": {"backend": "xreshard"},
        }
        if c.rollout_vllm_max_num_seqs:
            kwargs["max_num_seqs"] = c.rollout_vllm_max_num_seqs
        kwargs.update(c.rollout_vllm_kwargs or {})
        kwargs.update(engine_kwargs)
        t0 = time.monotonic()
        llm = LLM(**kwargs)
        logger.info("xreshard: vLLM engine (TP=%d) started in %.1f s", tp, time.monotonic() - t0)
        return llm

    # ------------------------------------------------------------ weights

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Refit the engine from ``params`` (an ``nnx.State`` on the actor mesh), shard to
        shard: each JAX device sends its shards to the vLLM ranks that hold them.

        With ``nnx.LoRAParam`` in ``filter_types`` (RLCluster's sync of a LoRA actor),
        ``params`` holds the qwix factors only and only the adapter is refit, into the
        engine's LoRA slot (xreshard's in-memory LoRA refit); the base weights stay as the
        first sync left them. A state with both (``nnx.Param``) refits both.

        Raises:
            TunixNamingError: a path no naming table maps.
            RefitError: LoRA factors for a rollout built without them, or a LoRA filter
                with no factors in ``params``.
        """
        import jax
        from flax import nnx

        wants_lora = any(isinstance(t, type) and issubclass(t, nnx.LoRAParam)
                         for t in (filter_types or ()))
        base, lora = split_lora(params)
        if lora and self._lora is None:
            raise RefitError(f"update_params got {len(lora)} qwix LoRA factors (e.g. "
                             f"{next(iter(lora))!r}) but this rollout was built from a model "
                             "without them: its engine has no LoRA slot (build it from the "
                             "LoRA model)")
        if wants_lora and not lora:
            raise RefitError("update_params: filter_types holds nnx.LoRAParam but params hold "
                             "no qwix LoRA factors (*_lora_a, *_lora_b)")
        check_names(self._rules, list(base), self._actor_name)
        t0 = time.perf_counter()
        with jax.transfer_guard("allow"):
            if base:
                self.last_report = self._engine.send_weights(base)
            if lora:
                self.last_lora_report = self._send_lora(lora)
        self.llm.reset_prefix_cache()
        self.refit_seconds.append(time.perf_counter() - t0)
        self._last = {}         # sampled logprobs are the old policy's from here on

    def _adapter(self, lora: Mapping[str, Any], arrays: bool = False) -> Any:
        rules, name, lora_id, alpha = self._lora
        return lora_adapter(lora, rules, name=name, lora_id=lora_id, alpha=alpha, arrays=arrays)

    def _send_lora(self, lora: Mapping[str, Any]) -> Any:
        """The adapter's round: its factors bound as views of their shards through the LoRA
        naming table (qwix's 3-D factors are no 2-D arrays to hand over)."""
        from xreshard.adapters.jax import bind_named
        from xreshard.adapters.naming import NameMap

        check_names(self._lora[0], list(lora), self._actor_name)
        bound = bind_named(lora, NameMap(self._lora[0]), self._engine.sender.stream.jax_ranks)
        return self._engine.send_loras([self._adapter(lora)], bound=bound)

    def lora_request(self) -> Any:
        """The ``LoRARequest`` that serves the refit adapter (None without LoRA)."""
        if self._lora is None:
            return None
        from xreshard.adapters.vllm import lora_request
        return lora_request(self._lora[1], self._lora[2])

    def reference_adapter(self, params: Any) -> Any:
        """The :class:`~xreshard.adapters.lora.LoRAAdapter` of ``params``' LoRA factors as
        numpy copies (gathered: for ``write_peft_dir`` and a reference load, not refits)."""
        if self._lora is None:
            raise RefitError("this rollout's model has no LoRA factors")
        return self._adapter(split_lora(params)[1], arrays=True)

    def lora_reports(self) -> list[dict[str, Any]]:
        """Every engine worker's report of its LoRA rounds, in TP rank order."""
        return sorted(self.llm.collective_rpc("xreshard_lora_report"),
                      key=lambda w: w["tp_rank"])

    def transfer_reports(self) -> list[dict[str, Any]]:
        """Every engine worker's report of the last refit (bytes received, its shard bytes),
        in TP rank order."""
        return sorted(self.llm.collective_rpc("xreshard_transfer_report"),
                      key=lambda w: w["tp_rank"])

    # ------------------------------------------------------------ sampling

    def _encode(self, prompt: str, max_len: int) -> list[int]:
        ids = [int(t) for t in self._tokenizer.encode(str(prompt))]
        return ids[-max_len:] if len(ids) > max_len else ids

    def _sampling(self, config: Any, seed: int | None, **extra: Any) -> Any:
        from vllm import SamplingParams
        stop = list(config.eos_tokens) if config.eos_tokens else [self.eos_id()]
        return SamplingParams(
            max_tokens=config.max_tokens_to_generate, temperature=float(config.temperature),
            top_p=1.0 if config.top_p is None else float(config.top_p),
            top_k=-1 if config.top_k in (None, 0) else int(config.top_k), seed=seed,
            stop_token_ids=stop, detokenize=False, **(config.rollout_vllm_sampling_kwargs or {}),
            **extra)

    def generate(self, prompts: Sequence[str], rollout_config: Any = None,
                 **kwargs: Any) -> Any:
        """Sample one completion per prompt on the engine (Tunix's ``RolloutOutput``)."""
        import numpy as np

        c = rollout_config if rollout_config is not None else self._config
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self._encode(p, c.max_prompt_length) for p in prompts]
        base = None if c.seed is None else int(np.asarray(c.seed).reshape(-1)[0])
        n = len(ids)
        requests = [{"prompt_token_ids": p} for p in ids]
        params = [self._sampling(c, None if base is None else base + self._calls * n + i,
                                 logprobs=0) for i in range(n)]
        self._calls += 1
        outs = self.llm.generate(requests, params, use_tqdm=False,
                                 lora_request=self.lora_request())
        tokens, texts, logprobs = [], [], []
        padded = np.full((n, c.max_prompt_length), self.pad_id(), dtype=np.int32)
        for i, (p, o) in enumerate(zip(ids, outs)):
            out = o.outputs[0]
            toks = np.asarray(list(out.token_ids), dtype=np.int32)
            lp = np.asarray([step[t].logprob for step, t in zip(out.logprobs or [], toks)],
                            dtype=np.float32)
            tokens.append(toks)
            logprobs.append(lp)
            stop = set(c.eos_tokens or [self.eos_id()])
            texts.append(self._tokenizer.decode([int(t) for t in toks if int(t) not in stop]))
            if p:
                padded[i, -len(p):] = p
            self._last[(tuple(p), tuple(int(t) for t in toks))] = lp
        return base_rollout.RolloutOutput(text=texts, logits=None, tokens=tokens,
                                          left_padded_prompt_tokens=padded, logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens: Any, completion_tokens: Any) -> Any:
        """Per-token logprobs ``[B, T]`` of ``completion_tokens`` given ``prompt_tokens``
        (both padded with ``pad_id``: prompts on the left, completions on the right; 0 at
        padding): the sampled logprobs of the rows ``generate`` made since the last refit
        (Tunix asks about the rows it just generated, in micro-batches), the engine's
        prompt logprobs for any other row."""
        import jax.numpy as jnp
        import numpy as np

        pad = self.pad_id()
        prompts, comps = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        out = np.zeros(comps.shape, dtype=np.float32)
        missing = []
        for i in range(comps.shape[0]):
            p = tuple(int(t) for t in prompts[i] if t != pad)
            row = [int(t) for t in comps[i]]
            while row and row[-1] == pad:
                row.pop()
            key = (p, tuple(row))
            if key in self._last:
                lp = self._last[key]
                out[i, :len(lp)] = lp
            elif row:
                missing.append((i, list(p), row))
        if missing:
            c = self._config
            sp = self._sampling(dataclasses.replace(c, max_tokens_to_generate=1), None,
                                prompt_logprobs=0)
            outs = self.llm.generate([{"prompt_token_ids": q + c_ids} for _, q, c_ids in missing],
                                     sp, use_tqdm=False, lora_request=self.lora_request())
            for (i, q, c_ids), o in zip(missing, outs):
                steps = o.prompt_logprobs[len(q):]
                out[i, :len(c_ids)] = [step[t].logprob for step, t in zip(steps, c_ids)]
        return jnp.asarray(out)

    def pad_id(self) -> int:
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        return int(self._tokenizer.eos_id())

    def model(self) -> Any:
        """None: the rollout model lives in the engine's processes (so Tunix syncs weights
        every step: it skips the sync only when the rollout shares the actor's weights)."""
        return None

    def shutdown(self) -> None:
        """Leave the refit world and stop the engine this rollout started."""
        import shutil
        if self._tmp is None:       # attached: the engine stays up, without this trainer
            try:
                self.llm.shutdown_weight_transfer_engine()
            finally:
                self._engine.shutdown()
            return
        try:    # the engine's workers first: they would otherwise outlive the store
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self._engine.shutdown()
            shutil.rmtree(self._tmp, ignore_errors=True)
