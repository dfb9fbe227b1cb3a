"""FP8 vLLM destinations, per rank, byte for byte against vLLM 0.32's own loaders.

Tiny models whose TP-local dims are multiples of 128 (Llama: hidden 256, intermediate
512, 4 q heads and 2 kv heads of 128; Mixtral: 4 experts of intermediate 256) are built
by vLLM for each rank (``fake_tp``) from a block-FP8 checkpoint config, or with vLLM's
online ``fp8_per_block`` / ``mxfp8``. For every rank:

* checkpoint: the BF16 weights are quantized by vLLM's own ``per_block_cast_to_fp8`` into
  a checkpoint (``X.weight`` e4m3 + ``X.weight_scale_inv``), which vLLM's ``load_weights``
  loads; the rank's loaded ``weight`` and ``weight_scale_inv`` parameters must equal,
  byte for byte, xreshard's quantization of the same BF16 weights placed by the recording
  (the pieces recorded from vLLM's loaders on probes);
* online: vLLM loads the BF16 weights and quantizes each TP-local parameter itself; the
  result must equal xreshard's quantizer run on the local parameter the recording
  assembles from the BF16 weights.

Stood in, because vLLM has no FP8 kernel on a CPU without AMX and refuses to build FP8
layers without one: vLLM's *kernel* choice and the kernel's post-processing
(``xreshard.adapters.vllm.KernelStandIn``, which leaves the loaded tensors as they are;
for MoE with backend NONE also ``convert_to_fp8_moe_kernel_format``). Loaders, parameter
creation, block-shape checks and online quantization are vLLM's own.
"""

from __future__ import annotations

import numpy as np
import pytest

from .vllm_cases import LazyModule, requires_vllm

requires_vllm()
torch = pytest.importorskip("torch")
transformers = LazyModule("transformers")
ml_dtypes = pytest.importorskip("ml_dtypes")

from xreshard.adapters import vllm as xv  # noqa: E402
from xreshard.ir.formats import BlockFP8, FormatError, MXFP8  # noqa: E402
from xreshard.quant import host  # noqa: E402

CKPT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}
MOE = "model.layers.0.block_sparse_moe"


def llama(quant_config=None, **over):
    c = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             tie_word_embeddings=False, max_position_embeddings=256)
    cfg = transformers.LlamaConfig(**{**c, **over})
    cfg.architectures = ["LlamaForCausalLM"]
    if quant_config:
        cfg.quantization_config = quant_config
    return cfg


def mixtral(quant_config=None, intermediate=256):
    cfg = transformers.MixtralConfig(
        vocab_size=512, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256)
    cfg.architectures = ["MixtralForCausalLM"]
    if quant_config:
        cfg.quantization_config = quant_config
    return cfg


def specs_of(cfg):
    """HF names -> (shape, bf16); Mixtral's experts per expert, as its checkpoints name them."""
    specs = xv.hf_tensor_specs(cfg, "bfloat16")
    if cfg.architectures == ["MixtralForCausalLM"]:
        specs = {n: v for n, v in specs.items() if ".mlp." not in n}   # transformers' own
        h, i = cfg.hidden_size, cfg.intermediate_size
        specs[f"{MOE}.gate.weight"] = ((cfg.num_local_experts, h), "bfloat16")
        for e in range(cfg.num_local_experts):
            for w, shape in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
                specs[f"{MOE}.experts.{e}.{w}.weight"] = (shape, "bfloat16")
    return specs


def bf16_weights(specs, seed=0):
    """BF16 weights with rows of different magnitudes (so blocks get different scales)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, _) in specs.items():
        t = torch.randn(shape, generator=gen) * 0.02
        if len(shape) == 2:
            t *= torch.exp2(torch.randint(-6, 7, (shape[0], 1), generator=gen).float())
        out[name] = t.to(torch.bfloat16)
    return out


CASES = {
    "llama-checkpoint-tp2": (llama, CKPT, None, dict(tp=2)),
    "llama-fp8_per_block-tp2": (llama, None, "fp8_per_block", dict(tp=2)),
    "llama-mxfp8-tp2": (llama, None, "mxfp8", dict(tp=2)),
    "llama-checkpoint-pp2": (llama, CKPT, None, dict(tp=1, pp=2)),
    "mixtral-checkpoint-ep2": (mixtral, CKPT, None, dict(tp=2, ep=True)),
    "mixtral-checkpoint-tp2": (mixtral, CKPT, None, dict(tp=2)),
    "mixtral-fp8_per_block-ep2": (mixtral, None, "fp8_per_block", dict(tp=2, ep=True)),
    "mixtral-mxfp8-tp2": (mixtral, None, "mxfp8", dict(tp=2)),
}
FAST = {"llama-checkpoint-tp2", "llama-fp8_per_block-tp2", "mixtral-checkpoint-ep2"}


def ranks_of(par):
    return [(t, p) for p in range(par.get("pp", 1)) for t in range(par["tp"])]


def vllm_config_of(make, quant_config, quantization, par):
    return xv.make_vllm_config(make(quant_config), dtype="bfloat16", tp_size=par["tp"],
                               pp_size=par.get("pp", 1),
                               enable_expert_parallel=par.get("ep", False),
                               quantization=quantization)


def vllm_loads(vllm_config, tp_rank, pp_rank, par, weights):
    """The parameters of one rank after vLLM's own ``load_weights`` (and, for online
    methods, vLLM's own quantization, which runs when a layer's weights are complete)."""
    from vllm.config import set_current_vllm_config

    with xv.fake_tp(tp_rank, par["tp"], pp_rank=pp_rank, pp_size=par.get("pp", 1)), \
            set_current_vllm_config(vllm_config):
        model = xv.build_model(vllm_config, device="cpu")
        with xv.kernel_stand_ins(), torch.no_grad():
            model.load_weights(iter(weights.items()))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assemble(rec, tensors, params):
    """``params`` of ``rec``'s rank filled from full HF ``tensors`` through its pieces."""
    out = {p: torch.zeros(rec.param_shapes[p], dtype=getattr(torch, rec.param_dtypes[p]))
           for p in params}
    for name, pieces in rec.pieces.items():
        for piece in pieces:
            if piece.param in out:
                out[piece.param][piece.param_slices] = \
                    tensors[name][piece.region.slices()].reshape(piece.param_region.shape)
    return out


def numpy_bf16(t):
    return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def as_bytes(t):
    t = t.contiguous()
    return t.view(torch.uint8).numpy() if t.element_size() == 1 else t.view(torch.int32).numpy()


def in_use(model):
    """Name -> each parameter as ``model`` computes with it. vLLM's CPU backend hands an
    unquantized linear layer's weight to a prepacked kernel (oneDNN where it takes the
    dtype, as with bf16 on AVX-512; sgl with AMX) and leaves the parameter empty; that
    weight is read back through the kernel (:func:`xreshard.adapters.vllm.gemm_weight`),
    so a comparison sees the same bytes on every x86-64 CPU."""
    modules = dict(model.named_modules())
    out = {}
    for name, param in model.named_parameters():
        module = modules.get(name.rpartition(".")[0])
        prepacked = name.endswith(".weight") and param.numel() == 0 and \
            callable(getattr(module, "cpu_linear", None))
        out[name] = xv.gemm_weight(module) if prepacked else param.detach()
    return out


def vllm_checkpoint(weights, quantized):
    """The block-FP8 checkpoint of ``weights``, quantized by vLLM's own function."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    ckpt = dict(weights)
    for q in quantized:
        ckpt[q.name], ckpt[q.scale] = per_block_cast_to_fp8(
            weights[q.name], list(q.format.block), use_ue8m0=q.format.ue8m0)
    return ckpt


def ours(local, fmt):
    """xreshard's host quantizer on a bf16 tensor, as torch tensors."""
    codes, scales = (host.quantize_mxfp8 if isinstance(fmt, MXFP8) else
                     host.quantize_block_fp8)(numpy_bf16(local), fmt)
    return (torch.from_numpy(codes.view(np.uint8)).view(getattr(torch, fmt.dtype)),
            torch.from_numpy(scales))


@pytest.fixture(scope="module")
def cases():
    """name -> [(recording, vLLM's loaded parameters, weights fed)] per rank, built lazily."""
    cache = {}

    def get(name):
        if name not in cache:
            make, quant_config, quantization, par = CASES[name]
            vllm_config = vllm_config_of(make, quant_config, quantization, par)
            specs = specs_of(make(quant_config))
            weights = bf16_weights(specs)
            if quant_config:
                specs = full_checkpoint_specs(vllm_config, specs, ranks_of(par))
            out = []
            for tp_rank, pp_rank in ranks_of(par):
                rec = xv.record_from_config(vllm_config, tp_rank, par["tp"], specs,
                                            pp_rank=pp_rank, pp_size=par.get("pp", 1))
                fed = vllm_checkpoint(weights, rec.quantized) if rec.quantized else weights
                out.append((rec, vllm_loads(vllm_config, tp_rank, pp_rank, par, fed), weights))
            cache[name] = out
        return cache[name]
    return get


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_each_ranks_fp8_bytes_equal_what_vllm_loads(cases, name):
    checked = 0
    for rec, loaded, weights in cases(name):
        assert bool(rec.quantized) != bool(rec.quantized_params), name
        if rec.quantized:                          # checkpoint: placed by the recording
            quantized = {}
            for q in rec.quantized:
                quantized[q.name], quantized[q.scale] = ours(weights[q.name], q.format)
            params = sorted({p.param for q in rec.quantized for n in (q.name, q.scale)
                             for p in rec.pieces[n]})
            want = assemble(rec, {**weights, **quantized}, params)
            assert not any(p in rec.unfilled for p in params)
        else:                                      # online: quantized per local parameter
            local = assemble(rec, weights, [q.name for q in rec.quantized_params])
            want = {}
            for q in rec.quantized_params:
                want[q.name], want[q.scale] = ours(local[q.name], q.format)
        for param, t in want.items():
            got = loaded[param]
            assert tuple(got.shape) == tuple(t.shape), (param, name)
            assert (as_bytes(got) == as_bytes(t)).all(), f"{name}: {param} differs"
            checked += 1
    assert checked >= 8


def test_recorded_scales_land_in_the_rank_scale_rows():
    """TP=2 Llama checkpoint: k_proj's scales (1 row of 128 rows each rank) go to row 2 of
    the fused qkv scale parameter, after q's 2 rows; o_proj's columns split in half."""
    vllm_config = vllm_config_of(llama, CKPT, None, dict(tp=2))
    specs = specs_of(llama(CKPT))
    recs = [xv.record_from_config(vllm_config, r, 2, specs) for r in range(2)]
    attn = "model.layers.0.self_attn"
    for r, rec in enumerate(recs):
        assert [str(p) for p in rec.pieces[f"{attn}.k_proj.weight_scale_inv"]] == [
            f"{attn}.k_proj.weight_scale_inv[{r}:{r + 1}, 0:2] -> "
            f"{attn}.qkv_proj.weight_scale_inv[2:3, 0:2]"]
        assert [str(p) for p in rec.pieces[f"{attn}.o_proj.weight_scale_inv"]] == [
            f"{attn}.o_proj.weight_scale_inv[0:2, {2 * r}:{2 * r + 2}] -> "
            f"{attn}.o_proj.weight_scale_inv[0:2, 0:2]"]
        assert rec.param_dtypes[f"{attn}.qkv_proj.weight"] == "float8_e4m3fn"
        assert rec.param_dtypes[f"{attn}.qkv_proj.weight_scale_inv"] == "float32"
        assert len(rec.quantized) == 14 and not rec.quantized_params
    assert xv.Recording.from_json(recs[1].to_json()) == recs[1]
    engine = xv.EngineRecording(recs, 1, xv.checkpoint_specs_fp8(specs, recs[0].quantized))
    q = engine.quantized[f"{attn}.k_proj.weight"]
    assert q.format == BlockFP8() and q.scale == f"{attn}.k_proj.weight_scale_inv"
    assert engine.shapes[q.scale] == (2, 2) and engine.dtypes[q.name] == "float8_e4m3fn"
    with pytest.raises(FormatError, match="k_proj.weight' is stored as block_fp8\\(128x128\\) "
                                          "but block_fp8\\(64x64\\) was requested"):
        q.check_request(BlockFP8((64, 64)))
    with pytest.raises(FormatError, match="k_proj.weight' is stored as block_fp8.*not from "
                                          "float8_e4m3fn"):
        q.check_offer("float8_e4m3fn")


def full_checkpoint_specs(vllm_config, specs, ranks):
    """What a checkpoint's headers list: every rank's quantized weights in e4m3 + scales
    (one rank alone knows only the experts it holds)."""
    every = [q for t, p in ranks for q in xv.record_from_config(
        vllm_config, t, max(r[0] for r in ranks) + 1, specs, pp_rank=p,
        pp_size=max(r[1] for r in ranks) + 1).quantized]
    return xv.checkpoint_specs_fp8(specs, every)


def test_experts_and_their_scales_under_expert_parallel():
    """EP=2: experts 2 and 3 whole on rank 1, their w13 scales [2 rows of gate; 2 of up]."""
    vllm_config = vllm_config_of(mixtral, CKPT, None, dict(tp=2, ep=True))
    specs = full_checkpoint_specs(vllm_config, specs_of(mixtral(CKPT)), [(0, 0), (1, 0)])
    rec = xv.record_from_config(vllm_config, 1, 2, specs)
    fused = f"{MOE}.experts.routed_experts"
    got = [str(p) for w in ("w1", "w3") for p in rec.pieces[f"{MOE}.experts.3.{w}.weight_scale_inv"]]
    assert got == [f"{MOE}.experts.3.w1.weight_scale_inv[0:2, 0:2] -> "
                   f"{fused}.w13_weight_scale_inv[1:2, 0:2, 0:2]",
                   f"{MOE}.experts.3.w3.weight_scale_inv[0:2, 0:2] -> "
                   f"{fused}.w13_weight_scale_inv[1:2, 2:4, 0:2]"]
    assert rec.pieces[f"{MOE}.experts.0.w2.weight_scale_inv"] == []
    names = {q.name for q in rec.quantized}       # what this rank stores quantized
    assert f"{MOE}.experts.3.w1.weight" in names and f"{MOE}.experts.0.w1.weight" not in names
    assert f"{MOE}.gate.weight" not in names


def test_pipeline_stages_record_only_their_layers():
    vllm_config = vllm_config_of(llama, CKPT, None, dict(tp=1, pp=2))
    specs = specs_of(llama(CKPT))
    stages = [xv.record_from_config(vllm_config, 0, 1, specs, pp_rank=p, pp_size=2)
              for p in range(2)]
    for p, rec in enumerate(stages):
        assert {q.name.split(".")[2] for q in rec.quantized} == {str(p)}
        assert rec.pp_rank == p and rec.pp_size == 2


@pytest.mark.parametrize("make,quant_config,quantization,match", [
    (lambda q: llama(q, intermediate_size=384), CKPT, None,
     "layer model.layers.0.mlp.down_proj: vLLM refuses.*input_size_per_partition = 192 is "
     "not divisible by weight quantization block_k = 128"),
    (lambda q: mixtral(q, intermediate=192), CKPT, None,
     "layer '.*routed_experts': its TP shard is not a multiple of the \\[128, 128\\] block, "
     "so vLLM refines the block grid"),
    (lambda q: llama(q, head_dim=64), CKPT, None,
     "layer 'model.layers.0.self_attn.qkv_proj': its fused partitions \\[128, 64, 64\\] are "
     "not multiples of the 128-row block"),
    (lambda q: llama(q, intermediate_size=96), None, "mxfp8",
     "layer model.layers.0.mlp.down_proj: vLLM refuses.*input_size_per_partition \\(48\\)"),
], ids=["row-parallel-edge", "moe-edge", "fused-qkv-mismatch", "mxfp8-group"])
def test_layouts_vllm_refuses_are_refused_naming_the_layer(make, quant_config, quantization,
                                                           match):
    vllm_config = xv.make_vllm_config(make(quant_config), dtype="bfloat16", tp_size=2,
                                      quantization=quantization)
    with pytest.raises(FormatError, match=match):
        xv.record_from_config(vllm_config, 0, 2, specs_of(make(quant_config)))


def test_a_scale_recording_that_does_not_match_the_blocks_is_refused():
    """A worker whose scale pieces are not those of its blocks (here: rank 1's k_proj
    scales dropped) fails EngineRecording on every worker, naming the scale tensor."""
    import dataclasses

    vllm_config = vllm_config_of(llama, CKPT, None, dict(tp=2))
    specs = specs_of(llama(CKPT))
    recs = [xv.record_from_config(vllm_config, r, 2, specs) for r in range(2)]
    k = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    pieces = {**recs[1].pieces, k: []}
    bad = [recs[0], dataclasses.replace(recs[1], pieces=pieces)]
    for worker in range(2):
        with pytest.raises(FormatError, match=f"'{k}' on rank 1 holds \\[\\] but the blocks"):
            xv.EngineRecording(bad, worker, xv.checkpoint_specs_fp8(specs, recs[0].quantized))


def test_kernel_stand_in_refuses_to_run_and_restores_vllms_choosers():
    import vllm.model_executor.kernels.linear as linear_kernels

    before = linear_kernels.choose_scaled_mm_linear_kernel
    with xv.kernel_stand_ins():
        assert linear_kernels.choose_scaled_mm_linear_kernel is not before
    assert linear_kernels.choose_scaled_mm_linear_kernel is before
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.mlp.down_proj"
    with pytest.raises(RuntimeError, match="down_proj: this platform has no FP8 GEMM kernel"):
        xv.KernelStandIn().apply_weights(layer, torch.zeros(1, 4))


@pytest.mark.parametrize("name", ["llama-checkpoint-tp2",
                                  pytest.param("mixtral-checkpoint-ep2", marks=pytest.mark.slow)])
def test_reload_from_fp8_shards_writes_what_a_fresh_load_writes(name):
    """The receive side a refit into a block-FP8 checkpoint engine uses, today: checkpoint
    A loaded and processed, then each rank's e4m3 + scale shards of checkpoint B handed to
    vLLM's layerwise reload (``reload_from_shards``: vLLM's loaders, then its own
    ``process_weights_after_loading``) - the rank's parameters equal a fresh load of B."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    make, quant_config, quantization, par = CASES[name]
    vllm_config = vllm_config_of(make, quant_config, quantization, par)
    specs = full_checkpoint_specs(vllm_config, specs_of(make(quant_config)), ranks_of(par))
    rec = xv.record_from_config(vllm_config, 1, par["tp"], specs)
    a, b = (vllm_checkpoint(bf16_weights(specs_of(make(quant_config)), seed), rec.quantized)
            for seed in (1, 2))
    with xv.fake_tp(1, par["tp"]), set_current_vllm_config(vllm_config):
        model = xv.build_model(vllm_config, device="cpu")
        with xv.kernel_stand_ins(), torch.no_grad():
            model.load_weights(iter(a.items()))
            process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
            xv.reload_from_shards(model, vllm_config.model_config, [
                (n, xv.shard_weight(n, specs[n][0], xv.parts_from_full(ps, b[n])))
                for n, ps in rec.pieces.items() if ps])
    got = in_use(model)
    want = vllm_loads(vllm_config, 1, 0, par, b)
    touched = {p.param for ps in rec.pieces.values() for p in ps}
    assert any(rec.param_dtypes[p] == "float8_e4m3fn" for p in touched)
    for param in touched:
        assert (as_bytes(got[param].detach()) == as_bytes(want[param])).all(), param


@pytest.mark.slow
def test_online_blocks_straddling_two_hf_tensors_are_finished_by_the_worker():
    """Online fp8_per_block, TP=2, heads of 64: rank 1's fused qkv parameter holds q rows
    0:128 and k|v rows 128:192|192:256, so its second block row straddles k_proj and
    v_proj. q_proj travels quantized (its pieces are whole blocks on its own grid); k_proj
    and v_proj travel bf16 into the scratch copy and the worker quantizes that block. After
    ``Destination.load`` the rank's bytes equal what vLLM's online method computes from
    loading the same bf16 weights itself."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    make = lambda q=None: llama(q, head_dim=64)       # noqa: E731
    par = dict(tp=2)
    vllm_config = vllm_config_of(make, None, "fp8_per_block", par)
    specs = specs_of(make())
    recs = [xv.record_from_config(vllm_config, r, 2, specs) for r in range(2)]
    engine = xv.EngineRecording(recs, 1, specs)
    attn = "model.layers.0.self_attn"
    assert f"{attn}.q_proj.weight" in engine.quantized
    assert f"{attn}.k_proj.weight" not in engine.quantized
    assert any(p.param == f"{attn}.qkv_proj.weight{xv.SCRATCH}"
               for p in engine.rec.pieces[f"{attn}.v_proj.weight"])
    dest = xv.Destination.place(engine, [0, 1], 0)
    a, b = bf16_weights(specs, 1), bf16_weights(specs, 2)
    with xv.fake_tp(1, 2), set_current_vllm_config(vllm_config):
        model = xv.build_model(vllm_config, device="cpu")
        with xv.kernel_stand_ins(), torch.no_grad():
            model.load_weights(iter(a.items()))
            process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    buffers = dest.buffers(model, False, "cpu", engine.names)
    bound = dest.bind(buffers, [], engine.names)
    full = dict(b)                          # what the senders put on the wire, per tensor
    for q in engine.quantized.values():
        full[q.name], full[q.scale] = ours(b[q.name], q.format)
    for (_, name), views in bound.bindings.items():
        regions = dest.layouts[name].regions(dest.rank)
        for view, region in zip(views if isinstance(views, list) else [views], regions):
            src = full[name][region.slices()].contiguous()
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[src.element_size()]
            view.view(f"u{src.element_size()}")[...] = \
                src.view(bits).numpy().view(f"u{src.element_size()}").reshape(view.shape)
    with xv.fake_tp(1, 2), set_current_vllm_config(vllm_config), xv.kernel_stand_ins(), \
            torch.no_grad():
        dest.load(model, vllm_config.model_config, buffers, False, engine.names)
    want = vllm_loads(vllm_config, 1, 0, par, b)
    got = in_use(model)
    for param in (f"{attn}.qkv_proj.weight", f"{attn}.qkv_proj.weight_scale_inv",
                  "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert (as_bytes(got[param].detach()) == as_bytes(want[param])).all(), param


@pytest.mark.parametrize("quantization,scale", [("fp8_per_block", "weight_scale_inv"),
                                                ("mxfp8", "weight_scale")])
def test_online_recording_quantizes_each_hf_tensor_on_its_parameters_grid(quantization, scale):
    """TP=2 Llama, online: every HF weight's pieces are whole blocks of its rank's fused
    parameter, so each is a quantized tensor with scales of its own, placed in the
    parameter's scale rows (k_proj's after q's); with 64-row heads k|v share a block of
    rank 1's qkv parameter, so k_proj and v_proj go bf16 to its scratch copy instead."""
    vllm_config = vllm_config_of(llama, None, quantization, dict(tp=2))
    specs = specs_of(llama())
    recs = [xv.record_from_config(vllm_config, r, 2, specs) for r in range(2)]
    engine = xv.EngineRecording(recs, 1, specs)
    attn = "model.layers.0.self_attn"
    k = engine.quantized[f"{attn}.k_proj.weight"]
    assert k.scale == f"{attn}.k_proj.{scale}" and k.shape == (256, 256)
    rows = 1 if quantization == "mxfp8" else 128       # scale rows per weight row block
    (piece,) = engine.rec.pieces[k.scale]
    assert piece.param == f"{attn}.qkv_proj.{scale}"
    assert piece.region.starts[0] == 128 // rows and piece.param_region.starts[0] == 256 // rows
    assert engine.rec.param_dtypes[f"{attn}.qkv_proj.weight"] == "float8_e4m3fn"
    assert engine.dtypes[k.scale] == k.format.scale_dtype
    assert k.scale not in sum(engine.offered_groups(1 << 40), [])   # never offered
    assert not engine.without_online().quantized                    # bf16, vLLM quantizes

    small = lambda q=None: llama(q, head_dim=64)       # noqa: E731
    vllm_config = vllm_config_of(small, None, quantization, dict(tp=2))
    specs = specs_of(small())
    recs = [xv.record_from_config(vllm_config, r, 2, specs) for r in range(2)]
    engine = xv.EngineRecording(recs, 0, specs)
    assert f"{attn}.q_proj.weight" in engine.quantized
    if quantization == "fp8_per_block":                # mxfp8 groups never straddle rows
        assert f"{attn}.k_proj.weight" not in engine.quantized
        assert {p.param for p in engine.rec.pieces[f"{attn}.k_proj.weight"]} == {
            f"{attn}.qkv_proj.weight{xv.SCRATCH}"}
