"""Recipes: how well-known training and inference setups shard a model, as data.

A recipe string names a framework and its mesh sizes, e.g. ``"megatron:pp=4,ep=16,dp=2"``,
``"vllm:tp=8,dp=16"``, ``"fsdp:dp=8,tp=4"``, ``"jax:fsdp=4,tp=2"``; a missing size is 1.
``recipe_layouts(model, recipe, offset)`` turns a model's parameters into
``{name: Layout}`` with world ranks numbered from ``offset`` (row-major over the recipe's
mesh axes, first axis major), ready for ``xreshard.planner.plan``.

Everything framework-specific is in three tables:

* ``ROLES``: what a tensor is, from its (HF-style) name: column-parallel, row-parallel, ...
* ``STAGES``: the pipeline stage of the tensors outside ``model.layers.N``.
* ``FRAMEWORKS``: per framework, its mesh axes and, per role, the placement on each axis
  (DTensor-style strings: ``"S<dim>"``, ``"SS<dim>/<split_factor>"``; axes not named
  replicate) or, for JAX, a PartitionSpec. Two placement words are not DTensor's:
  ``"expert"`` pins a per-expert tensor to the ranks of its expert's group on that axis,
  and ``"S0kv"`` shards k/v rows over tp by key-value head, replicating heads over
  consecutive tp ranks when tp > num_key_value_heads (vLLM's QKVParallelLinear).

The code below only walks the parameters, looks their role up and builds (and caches) one
``Layout`` per distinct (role, shape, dtype, stage, expert group).
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..errors import XreshardError
from ..ir.layout import Layout, Mesh, Region, Split

logger = logging.getLogger(__name__)

__all__ = ["RecipeError", "Recipe", "parse_recipe", "recipe_layouts", "ROLES", "STAGES",
           "FRAMEWORKS"]


class RecipeError(XreshardError):
    """A recipe string is malformed, or the recipe cannot shard this model."""


# ---------------------------------------------------------------------------- the tables

#: (name pattern, role); the first match wins. Patterns are searched in the name with its
#: layer and expert indices replaced by N and E ("model.layers.N.mlp.experts.E.up_proj.weight").
#: Roles:
#:   vocab            embedding / output head, [vocab, hidden]
#:   col              column-parallel linear (and its bias): output rows split over tp
#:   kv               k_proj / v_proj (and bias): column-parallel by key-value head
#:   row              row-parallel linear: input columns split over tp
#:   hidden_in        replicated under TP, [out, hidden]: MLA q/kv down-projections, router
#:   rep              replicated: norms, router score bias, biases of row-parallel layers
#:   expert_col/_row  one routed expert's gate|up / down  (per-expert layout)
#:   experts_gate_up  all experts of a layer, [E, 2I, H] = cat(gate, up) on dim 1 (stacked)
#:   experts_down     all experts of a layer, [E, H, I]                          (stacked)
ROLES: tuple[tuple[str, str], ...] = (
    (r"\.experts\.(E|\d+)\.(gate_proj|up_proj)\.weight$", "expert_col"),
    (r"\.experts\.(E|\d+)\.down_proj\.weight$", "expert_row"),
    (r"\.experts\.gate_up_proj$", "experts_gate_up"),
    (r"\.experts\.down_proj$", "experts_down"),
    (r"(^|\.)(embed_tokens|lm_head)\.weight$", "vocab"),
    (r"\.(k_proj|v_proj)\.(weight|bias)$", "kv"),
    (r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.(weight|bias)$", "col"),
    (r"\.(o_proj|down_proj)\.weight$", "row"),
    (r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$|\.mlp\.gate\.weight$", "hidden_in"),
    (r"norm\.weight$|\.bias$|_bias$", "rep"),
)

#: pipeline stage of tensors outside ``model.layers.N`` (layer N sits on stage N*pp//L,
#: Megatron's contiguous split, the first stages taking the remainder). A tied embedding
#: (config tie_word_embeddings, no lm_head) also sits on the last stage, as Megatron keeps a
#: copy there for the output layer.
STAGES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)embed_tokens\.", "first"),
    (r"(^|\.)norm\.weight$|(^|\.)lm_head\.", "last"),
)


@dataclass(frozen=True)
class Framework:
    """One framework's mesh axes (major first) and its placement table."""

    name: str
    axes: tuple[str, ...]
    table: Mapping[str, Any]
    """role -> {axis: placement} (torch-style) or role -> PartitionSpec tuple (jax)."""
    example: str
    stage_axis: str | None = None
    """axis over which layers are pipelined (each tensor lives on one stage's ranks)."""
    even: bool = False
    """JAX: even splits only; a dim that does not divide is replicated instead."""


FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (
    # Megatron-Core. Rank order "tp-cp-ep-dp-pp" (tp fastest), cp = 1: mesh (pp, dp, ep, tp),
    # where dp is the *expert* data-parallel size; dense parameters are replicated over dp
    # and ep both (Megatron carves EP out of DP: dense DP = dp*ep). Expert TP = tp.
    # Megatron splits heads and query groups evenly: num_attention_heads and
    # num_key_value_heads must divide by tp; num experts by ep. Vocab is not padded here.
    Framework("megatron", ("pp", "dp", "ep", "tp"), stage_axis="pp",
              example="megatron:pp=4,ep=16,dp=2,tp=1", table={
                  "vocab": {"tp": "S0"},            # VocabParallelEmbedding, output_layer
                  "col": {"tp": "S0"},              # linear_qkv, linear_fc1, MLA q/kv up-proj
                  "kv": {"tp": "S0"},               # query groups split over tp
                  "row": {"tp": "S1"},              # linear_proj, linear_fc2
                  "hidden_in": {},                  # MLA down-proj ("duplicated"), router
                  "rep": {},
                  "expert_col": {"ep": "expert", "tp": "S0"},   # expert e on ep rank e//(E/ep)
                  "expert_row": {"ep": "expert", "tp": "S1"},
                  # gate rows and up rows each over tp
                  "experts_gate_up": {"ep": "S0", "tp": "SS1/2"},
                  "experts_down": {"ep": "S0", "tp": "S2"},
              }),
    # vLLM: dp engine replicas of a tp group; no expert parallelism; replicated over dp.
    # Even splits (vLLM's divide() asserts), heads % tp == 0, and kv heads either split
    # (KV % tp == 0) or replicated over tp/KV consecutive ranks (tp % KV == 0). The vocab
    # is padded as VocabParallelEmbedding / ParallelLMHead pad it: to a multiple of
    # VLLM_VOCAB_PADDING (pad_vocab_size), then split evenly over tp; the padded tail
    # holds no tensor element (_vllm_vocab).
    Framework("vllm", ("dp", "tp"), example="vllm:tp=8,dp=16", table={
        "vocab": {"tp": "S0"},                      # VocabParallelEmbedding, ParallelLMHead
        "col": {"tp": "S0"},                        # QKV / MergedColumnParallelLinear
        "kv": {"tp": "S0kv"},
        "row": {"tp": "S1"},                        # RowParallelLinear
        "hidden_in": {},                            # ReplicatedLinear
        "rep": {},
        "expert_col": {"tp": "S0"},                 # FusedMoE w13, w1 / w3 halves
        "expert_row": {"tp": "S1"},                 # FusedMoE w2
        "experts_gate_up": {"tp": "SS1/2"},
        "experts_down": {"tp": "S2"},
    }),
    # FSDP2 (+ TP as torchtitan's plan, + HSDP replicas): mesh (rep, dp, tp). fully_shard
    # shards dim 0 of every parameter over dp; where TP also shards dim 0 the dp placement
    # becomes _StridedShard(0, tp) (FSDP shards the TP-local block, docs/layouts.md §4.4).
    # torch.chunk semantics: nothing needs to divide.
    Framework("fsdp", ("rep", "dp", "tp"), example="fsdp:dp=8,tp=4", table={
        "vocab": {"dp": "S0", "tp": "S0"},          # RowwiseParallel embedding, Colwise output
        "col": {"dp": "S0", "tp": "S0"},            # ColwiseParallel wq/wk/wv/w1/w3
        "kv": {"dp": "S0", "tp": "S0"},
        "row": {"dp": "S0", "tp": "S1"},            # RowwiseParallel wo/w2
        "hidden_in": {"dp": "S0"},
        "rep": {"dp": "S0"},                        # norms: SequenceParallel (replicated)
        "expert_col": {"dp": "S0", "tp": "S0"},
        "expert_row": {"dp": "S0", "tp": "S1"},
        "experts_gate_up": {"dp": "S0", "tp": "SS1/2"},
        "experts_down": {"dp": "S0", "tp": "S2"},
    }),
    # JAX (MaxText-like logical axes): mesh (dp, fsdp, tp), specs in torch [out, in] dims:
    # hidden ("embed") dims over fsdp, heads / mlp / vocab dims over tp, experts unsplit.
    # NamedSharding needs even splits: a dim whose size does not divide by its axes is
    # replicated for that tensor instead (e.g. DeepSeek's kv_a_proj_with_mqa rows never
    # are split; q_norm [128] is replicated anyway), logged at INFO.
    Framework("jax", ("dp", "fsdp", "tp"), even=True, example="jax:fsdp=4,tp=2", table={
        "vocab": ("tp", "fsdp"),                    # ('vocab', 'embed')
        "col": ("tp", "fsdp"),                      # ('embed', 'heads'|'mlp') transposed
        "kv": ("tp", "fsdp"),
        "row": ("fsdp", "tp"),                      # ('heads'|'mlp', 'embed') transposed
        "hidden_in": (None, "fsdp"),                # ('embed', 'q_lora'|'kv_lora'|'exp')
        "rep": (),
        "expert_col": ("tp", "fsdp"),
        "expert_row": ("fsdp", "tp"),
        "experts_gate_up": (None, "tp", "fsdp"),    # ('exp', 'mlp', 'embed')
        "experts_down": (None, "fsdp", "tp"),       # ('exp', 'embed', 'mlp')
    }),
)}


# ---------------------------------------------------------------------------- recipe strings

@dataclass(frozen=True)
class Recipe:
    """A framework and its mesh sizes, e.g. ``Recipe.parse("vllm:tp=8,dp=16")``."""

    framework: str
    sizes: tuple[tuple[str, int], ...]
    """(axis, size) for every axis of the framework's mesh, major first."""

    @classmethod
    def parse(cls, text: str) -> Recipe:
        return parse_recipe(text)

    def size(self, axis: str) -> int:
        return dict(self.sizes)[axis]

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.sizes)

    def mesh(self, offset: int = 0) -> Mesh:
        """The whole recipe's mesh, ranks ``offset .. offset + world_size - 1``."""
        return Mesh(tuple(s for _, s in self.sizes),
                    tuple(range(offset, offset + self.world_size)),
                    tuple(a for a, _ in self.sizes))

    def layouts(self, model: Any, offset: int = 0, *,
                config: Mapping[str, Any] | None = None) -> dict[str, Layout]:
        return recipe_layouts(model, self, offset, config=config)

    def __str__(self) -> str:
        return f"{self.framework}:" + ",".join(f"{a}={s}" for a, s in self.sizes)


def parse_recipe(text: str | Recipe) -> Recipe:
    """Parse ``"<framework>:<axis>=<size>,..."``; missing axes get size 1.

    Raises:
        RecipeError: unknown framework or axis, an entry that is not ``axis=size``, a
            size that is not a positive integer, or an axis given twice.
    """
    if isinstance(text, Recipe):
        return text
    if not isinstance(text, str):
        raise RecipeError(f"a recipe is a string like 'vllm:tp=8,dp=16', got {text!r}")
    head, _, body = text.strip().partition(":")
    name = head.strip().lower()
    fw = FRAMEWORKS.get(name)
    if fw is None:
        raise RecipeError(f"recipe {text!r}: unknown framework {head.strip()!r}; expected one "
                          f"of {', '.join(sorted(FRAMEWORKS))}, e.g. "
                          + ", ".join(repr(f.example) for f in FRAMEWORKS.values()))
    given: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in body.split(","))):
        axis, eq, value = (s.strip() for s in entry.partition("="))
        if not eq or not axis:
            raise RecipeError(f"recipe {text!r}: entry {entry!r} is not axis=size; write e.g. "
                              f"{fw.example!r}")
        if axis not in fw.axes:
            raise RecipeError(f"recipe {text!r}: {name} has no axis {axis!r}; its axes are "
                              f"{', '.join(fw.axes)} (e.g. {fw.example!r})")
        if axis in given:
            raise RecipeError(f"recipe {text!r}: axis {axis!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1 or str(size) != value.lstrip("+"):
            raise RecipeError(f"recipe {text!r}: {axis}={value!r} is not a positive integer")
        given[axis] = size
    return Recipe(name, tuple((a, given.get(a, 1)) for a in fw.axes))


# ---------------------------------------------------------------------------- layouts

def recipe_layouts(model: Any, recipe: str | Recipe, offset: int = 0, *,
                   config: Mapping[str, Any] | None = None,
                   notes: list[str] | None = None) -> dict[str, Layout]:
    """``{name: Layout}`` for every parameter of ``model`` under ``recipe``.

    Args:
        model: a ``Model`` (``load_model``) or an iterable of ``(name, shape, dtype)``.
        recipe: a recipe string or ``Recipe``.
        offset: world rank of the recipe's first mesh position.
        config: HF config values (num_attention_heads, num_key_value_heads, ...); taken
            from ``model.config`` when not given. Without it the head checks and vLLM's
            kv-head replication are skipped (k/v rows are then split like any column).
        notes: when given, receives one line per thing the recipe did that its user may
            not expect (JAX dims that do not divide, replicated instead), for a terminal.

    Returns:
        Layouts in parameter order; equal layouts are the same object.

    Example, ``megatron:pp=2,tp=2`` on a 2-layer model (ranks 0-3; stage s = ranks 2s, 2s+1)::

        # tensor                                     | rank | region
        # model.embed_tokens.weight [8, 4]           |    0 | [0:4, 0:4]
        #                                            |    1 | [4:8, 0:4]
        # model.layers.1.mlp.down_proj.weight [4, 8] |    2 | [0:4, 0:4]
        #                                            |    3 | [0:4, 4:8]
        # lm_head.weight [8, 4]                      |    2 | [0:4, 0:4]
        #                                            |    3 | [4:8, 0:4]

    Raises:
        RecipeError: a tensor no rule in ``ROLES`` matches, or a recipe the model cannot
            use (heads, kv heads or experts that do not divide, more stages than layers,
            uneven vLLM / Megatron splits).
    """
    recipe = parse_recipe(recipe)
    if config is None:
        config = getattr(model, "config", None) or {}
    params = getattr(model, "params", model)
    builder = _Builder(recipe, offset, config)
    out = builder.build(params)
    if notes is not None and builder.replicated_dims:
        dims = builder.replicated_dims
        notes.append(f"{recipe}: {builder.replicated_tensors} tensor(s) have dims that do not "
                     f"divide evenly over their mesh axes; those dims are replicated instead "
                     f"(JAX NamedSharding needs even splits), e.g. {'; '.join(dims[:3])}")
    return out


_ROLE_RES = tuple((re.compile(p), role) for p, role in ROLES)
_STAGE_RES = tuple((re.compile(p), where) for p, where in STAGES)


def _template(name: str) -> tuple[str, int | None, int | None]:
    """``model.layers.3.mlp.experts.7.up_proj.weight`` -> (template, layer 3, expert 7).

    The template (indices replaced by ``N`` and ``E``) is what ``ROLES`` patterns match.
    """
    head, sep, rest = name.partition(".layers.")
    if not sep:
        return name, None, None
    layer, _, tail = rest.partition(".")
    if not layer.isdigit():
        return name, None, None
    before, sep, after = tail.partition(".experts.")
    if sep:
        expert, _, last = after.partition(".")
        if expert.isdigit():
            return f"{head}.layers.N.{before}.experts.E.{last}", int(layer), int(expert)
    return f"{head}.layers.N.{tail}", int(layer), None


_PARSED: dict[int, tuple[Sequence, tuple[Sequence, list]]] = {}


def _parse(params: Iterable[Sequence]) -> tuple[Sequence, list]:
    """(params with tuple shapes, their ``_template``s). Memoized for tuples (a ``Model``'s
    params), as the source and destination recipes of a refit parse the same model."""
    hit = _PARSED.get(id(params))
    if hit is not None and hit[0] is params:
        return hit[1]
    original = params
    params = params if isinstance(params, (list, tuple)) else list(params)
    if params and not all(isinstance(p[1], tuple) for p in params):
        params = [(n, tuple(int(d) for d in s), dt) for n, s, dt in params]
    result = params, [_template(p[0]) for p in params]
    if isinstance(original, tuple):
        if len(_PARSED) >= 8:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[id(original)] = (original, result)
    return result


def _role(template: str, name: str) -> str:
    for pattern, role in _ROLE_RES:
        if pattern.search(template):
            return role
    raise RecipeError(f"no recipe rule matches tensor {name!r} (searched as {template!r}); "
                      "add a (pattern, role) to xreshard.catalog.recipes.ROLES")


class _Builder:
    """One recipe applied to one parameter list; caches meshes and layouts."""

    def __init__(self, recipe: Recipe, offset: int, config: Mapping[str, Any]) -> None:
        if offset < 0:
            raise RecipeError(f"rank offset must be >= 0, got {offset}")
        self.recipe = recipe
        self.fw = FRAMEWORKS[recipe.framework]
        self.sizes = dict(recipe.sizes)
        self.offset = offset
        self.config = config
        strides, s = {}, 1
        for axis, size in reversed(recipe.sizes):
            strides[axis], s = s, s * size
        self.strides = strides
        self.meshes: dict[tuple, Mesh] = {}
        self.layouts: dict[tuple, Layout] = {}
        self.interned: dict[Layout, Layout] = {}      # equal layouts of different roles
        self.replicated_dims: list[str] = []
        self.replicating: set[tuple] = set()          # layout keys that replicate a dim
        self.replicated_tensors = 0

    # ------------------------------------------------------------ walk

    def build(self, params: Iterable[Sequence]) -> dict[str, Layout]:
        params, parsed = _parse(params)
        templates = dict.fromkeys(tpl for tpl, _, _ in parsed)
        layers = {layer for _, layer, _ in parsed}
        layers.discard(None)
        num_layers = max(layers) + 1 if layers else 0
        tied = (bool(self.config.get("tie_word_embeddings"))
                and not any(t.endswith("lm_head.weight") for t in templates))
        expert_axis = {role: axis for role, entry in self.fw.table.items()
                       if isinstance(entry, Mapping)
                       for axis, p in entry.items() if p == "expert"}
        num_experts: dict[int, int] = {}              # layer -> routed experts (per-expert)
        if expert_axis:
            for _, layer, expert in parsed:
                if expert is not None and expert >= num_experts.get(layer, 0):
                    num_experts[layer] = expert + 1
        self._check_model(params, parsed, templates, num_experts)
        stage_axis = self.fw.stage_axis
        num_stages = self.sizes[stage_axis] if stage_axis else 1
        if num_stages > num_layers > 0:
            raise RecipeError(f"{self.recipe}: {num_stages} pipeline stages but the model has "
                              f"{num_layers} layers; use pp <= {num_layers}")
        stage_of = [(layer * num_stages // num_layers,) for layer in range(num_layers)]

        # per template: (role, pinned to its expert's group?, stages outside the layers)
        info: dict[str, tuple[str, bool, tuple[int, ...] | None]] = {}
        per_group = {layer: n // self.sizes[axis] for layer, n in num_experts.items()
                     for axis in set(expert_axis.values())}   # experts per group, by layer
        out: dict[str, Layout] = {}
        layouts = self.layouts
        for (name, shape, dtype), (tpl, layer, expert) in zip(params, parsed):
            t = info.get(tpl)
            if t is None:
                role = _role(tpl, name)
                outside = (None if layer is not None else (0,) if num_stages == 1
                           else self._outside_stages(name, tpl, num_stages, tied))
                t = info[tpl] = (role, role in expert_axis and expert is not None, outside)
            role, pinned, stages = t
            if stages is None:
                stages = stage_of[layer]
            key = (role, shape, dtype, stages, expert // per_group[layer] if pinned else None)
            layout = layouts.get(key)
            if layout is None:
                before = len(self.replicated_dims)
                layout = self._layout(name, role, shape, dtype, stages, key[4])
                layout = layouts[key] = self.interned.setdefault(layout, layout)
                if len(self.replicated_dims) > before:
                    self.replicating.add(key)
            self.replicated_tensors += key in self.replicating
            out[name] = layout
        if self.replicated_dims:
            logger.info("%s: %d tensor dims do not divide evenly and are replicated instead, "
                        "e.g. %s", self.recipe, len(self.replicated_dims),
                        "; ".join(self.replicated_dims[:3]))
        return out

    def _vllm_vocab(self, name: str, shape: tuple[int, ...], dtype: Any, mesh: Mesh,
                    splits: list[tuple[int, int, int]]) -> Layout:
        return _vllm_vocab_layout(name, shape, dtype, mesh, splits, self.recipe)

    def _outside_stages(self, name: str, tpl: str, num_stages: int,
                        tied: bool) -> tuple[int, ...]:
        for pattern, where in _STAGE_RES:
            if pattern.search(tpl):
                if where == "last":
                    return (num_stages - 1,)
                return (0, num_stages - 1) if tied else (0,)
        raise RecipeError(f"{self.recipe}: tensor {name!r} is outside model.layers.N and no "
                          "rule in xreshard.catalog.recipes.STAGES gives its pipeline stage")

    def _check_model(self, params: Sequence, parsed: list, templates: Iterable[str],
                     num_experts: Mapping[int, int]) -> None:
        """Divisibility the framework itself demands (Megatron, vLLM)."""
        fw, cfg = self.fw.name, self.config
        if fw not in ("megatron", "vllm"):
            return
        tp = self.sizes["tp"]
        heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        has_kv = any(t.endswith(("k_proj.weight", "v_proj.weight")) for t in templates)
        if heads and heads % tp:
            raise RecipeError(f"{self.recipe}: num_attention_heads {heads} % tp {tp} != 0; "
                              f"{fw} splits attention heads evenly over tp - choose a tp "
                              f"dividing {heads}")
        if kv and has_kv:
            if fw == "megatron" and kv % tp:
                raise RecipeError(f"{self.recipe}: num_key_value_heads {kv} % tp {tp} != 0; "
                                  "Megatron splits query groups evenly over tp - choose a tp "
                                  f"dividing {kv}")
            if fw == "vllm" and kv % tp and tp % kv:
                raise RecipeError(f"{self.recipe}: num_key_value_heads {kv} and tp {tp}: vLLM "
                                  "needs one to divide the other (kv heads are split, or "
                                  "replicated over tp/kv ranks)")
        if fw == "megatron":
            ep = self.sizes["ep"]
            stacked = set()
            if any(t.endswith(".experts.down_proj") for t in templates):
                stacked = {(layer, p[1][0]) for p, (tpl, layer, _) in zip(params, parsed)
                           if tpl.endswith(".experts.down_proj")}
            for layer, n in sorted(set(num_experts.items()) | stacked):
                if n % ep:
                    raise RecipeError(f"{self.recipe}: layer {layer} has {n} routed experts, "
                                      f"not divisible by ep {ep}; Megatron gives every ep rank "
                                      "the same number of experts")

    # ------------------------------------------------------------ one layout

    def _mesh(self, pins: Mapping[str, tuple[int, ...]],
              reshape: tuple[str, int] | None = None) -> Mesh:
        """The sub-mesh where ``pins`` fix axis coordinates (one index: the axis is dropped;
        several: it stays, of that size). ``reshape=(axis, k)`` splits an axis into
        (axis of size k, ``axis_rep`` of size n/k), same row-major rank order."""
        key = (tuple(sorted(pins.items())), reshape)
        mesh = self.meshes.get(key)
        if mesh is not None:
            return mesh
        ranges, shape, names = [], [], []
        for axis, size in self.recipe.sizes:
            idx = pins.get(axis, tuple(range(size)))
            ranges.append([i * self.strides[axis] for i in idx])
            if axis in pins and len(idx) == 1:
                continue
            if reshape is not None and reshape[0] == axis and 1 < reshape[1] < len(idx):
                shape += [reshape[1], len(idx) // reshape[1]]
                names += [axis, f"{axis}_rep"]
            else:
                shape.append(len(idx))
                names.append(axis)
        ranks = tuple(self.offset + sum(c) for c in itertools.product(*ranges))
        mesh = self.meshes[key] = Mesh(tuple(shape), ranks, tuple(names))
        return mesh

    def _layout(self, name: str, role: str, shape: tuple[int, ...], dtype: Any,
                stages: tuple[int, ...], group: int | None) -> Layout:
        fw = self.fw
        pins: dict[str, tuple[int, ...]] = {}
        if fw.stage_axis:
            pins[fw.stage_axis] = stages
        entry = fw.table[role]
        if fw.even:                                           # JAX PartitionSpec
            mesh = self._mesh(pins)
            spec = []
            for dim, axes in enumerate(entry[:len(shape)]):
                names = () if axes is None else (axes,) if isinstance(axes, str) else axes
                ways = math.prod(self.sizes[a] for a in names)
                if ways > 1 and shape[dim] % ways:
                    self.replicated_dims.append(f"{name!r} dim {dim} ({shape[dim]}) over "
                                                f"{'x'.join(names)}={ways}")
                    names = ()
                spec.append(names or None)
            return Layout.from_spec(shape, dtype, mesh, spec, name=name)
        placements = dict(entry)
        reshape = None
        for axis, p in entry.items():
            if p == "expert":
                if group is None:
                    raise RecipeError(f"{self.recipe}: tensor {name!r} is placed by expert "
                                      "but belongs to no expert group")
                pins[axis] = (group,)
                del placements[axis]
            elif p == "S0kv":                     # k/v rows by kv head (vLLM)
                placements[axis] = "S0"
                kv, tp = self.config.get("num_key_value_heads"), self.sizes[axis]
                if kv == 1:
                    del placements[axis]              # MQA: every tp rank holds the head
                elif kv and tp > kv:
                    reshape = (axis, kv)              # kv blocks, replicas on tp_rep (minor)
        mesh = self._mesh(pins, reshape)
        axis_names = mesh.axis_names
        assert axis_names is not None                 # _mesh names every axis
        splits = []                                   # (dim, mesh axis, split factor)
        for a, axis in enumerate(axis_names):         # DTensor applies mesh axes in order
            p = placements.get(axis)
            if p is not None and mesh.shape[a] > 1:
                dim, _, sf = p.removeprefix("SS").removeprefix("S").partition("/")
                splits.append((int(dim), a, int(sf or 1)))
        # an axis sharding a dim that a later axis also shards applies first but splits the
        # later axes' blocks (FSDP2 + TP, docs/layouts.md §4.4): _StridedShard(dim, their sizes).
        splits = [(d, a, sf if sf > 1 else math.prod(
            mesh.shape[a2] for d2, a2, _ in splits if d2 == d and a2 > a)) for d, a, sf in splits]
        if fw.name == "vllm" and role == "vocab" and splits:
            return self._vllm_vocab(name, shape, dtype, mesh, splits)
        if fw.name in ("megatron", "vllm") and role != "vocab":
            for d, a, sf in splits:
                ways = mesh.shape[a] * sf
                if shape[d] % ways:
                    raise RecipeError(
                        f"{self.recipe}: tensor {name!r} dim {d} (size {shape[d]}) does not "
                        f"split evenly {mesh.shape[a]} ways over {axis_names[a]!r}"
                        + (f" in {sf} strided pieces" if sf > 1 else "")
                        + f"; {fw.name} shards evenly - choose sizes that divide {shape[d]}")
        return Layout.product(shape, dtype, mesh, [Split(d, a, sf) for d, a, sf in splits])


#: vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py): the vocab is padded to a
#: multiple of it, then split evenly over tp
VLLM_VOCAB_PADDING = 64


def _vllm_vocab_layout(name: str, shape: tuple[int, ...], dtype: Any, mesh: Mesh,
                       splits: list[tuple[int, int, int]], recipe: Recipe) -> Layout:
    """vLLM's vocab-parallel layout: ``padded = ceil(vocab / 64) * 64`` rows split evenly,
    tp rank ``t`` holding rows ``[t * padded / tp, (t + 1) * padded / tp)`` of the padded
    table, clipped to the real vocab (the last ranks may hold fewer rows, or none). The
    same as torch.chunk's split when the vocab is a multiple of 64 * tp (every packaged
    model), and then kept as that product layout.

    Raises:
        RecipeError: the padded vocab does not divide by tp (vLLM's ``divide`` asserts).
    """
    (dim, axis, _), = splits
    vocab, tp = shape[dim], mesh.shape[axis]
    padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded % tp:
        raise RecipeError(f"{recipe}: tensor {name!r} vocab {vocab} is padded to {padded} "
                          f"(a multiple of {VLLM_VOCAB_PADDING}, as vLLM's "
                          f"VocabParallelEmbedding pads it), which does not split evenly "
                          f"over tp={tp}; vLLM refuses it - choose a tp dividing {padded}")
    per = padded // tp
    product = Layout.product(shape, dtype, mesh, [Split(dim, axis, 1)])
    if -(-vocab // tp) == per:
        return product                    # torch.chunk's rows are vLLM's rows
    regions: dict[int, list[Region]] = {}
    for rank in mesh.ranks:
        coord = mesh.coord(rank)
        assert coord is not None                  # rank is one of the mesh's
        t = coord[axis]
        lo, hi = min(t * per, vocab), min((t + 1) * per, vocab)
        regions[rank] = [Region(tuple(lo if d == dim else 0 for d in range(len(shape))),
                                tuple(hi if d == dim else n for d, n in enumerate(shape)))]
    return Layout.explicit_form(shape, dtype, regions)
