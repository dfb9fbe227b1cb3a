"""The wire features as codecs (issue 32 items 1-2): the kernels a call's codecs run come
from ``Tuning`` and reach every codec (FP8 too), the executor has no subclass, and
``xreshard/runtime/codecs`` holds the codecs."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import xreshard as xr
from xreshard.planner.prepare import CallOptions, prepare

ROOT = pathlib.Path(xr.__file__).parent


def _fp8_call(tuning):
    """One FP8 call in one process (local transport): a trainer's bf16 halves -> two
    receivers' codes and scales, split blocks included; every destination compared with
    vLLM's quantizer's bytes (xreshard.quant.host). Returns the device ops' counts it
    added."""
    from xreshard.dtypes import numpy_dtype
    from xreshard.ir.formats import BlockFP8, QuantizedTensor
    from xreshard.ir.topology import Topology
    from xreshard.quant.host import quantize_block_fp8
    from xreshard.runtime import device_ops
    from xreshard.runtime.execute import run
    from xreshard.runtime.metadata import stage_bindings
    from xreshard.tools.testing import local_arrays_from_global
    from xreshard.transport.local import LocalTransport

    shape, fmt = (256, 300), BlockFP8()
    src = {"w": xr.Layout.explicit_form(shape, "bfloat16", {     # columns cut at 150
        r: [[(0, 256), (k * 150, (k + 1) * 150)]] for k, r in enumerate((0, 1))})}
    qt = QuantizedTensor("w", "w.scale", fmt, shape)
    dst = {key: xr.Layout.explicit_form(full, dtype, {
        r: [[(t * full[0] // 2, (t + 1) * full[0] // 2), (0, full[1])]]
        for t, r in enumerate((2, 3))})
        for key, full, dtype in (("w", shape, fmt.dtype), ("w.scale", qt.scale_shape,
                                                           fmt.scale_dtype))}
    topo = Topology.of({r: (r, "h") for r in range(4)})
    prepared = prepare(src, dst, topo, CallOptions(bucket_bytes=1 << 14), ranks=range(4),
                       quantized={"w": qt})
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(shape) * 0.02).astype(numpy_dtype("bfloat16"))
    real = {(r, n): [np.zeros(lay.regions(r)[0].shape, numpy_dtype(lay.dtype))]
            for n, lay in dst.items() for r in lay.ranks}
    src_b = {(r, "w"): [local_arrays_from_global(src["w"], r, values)[0]] for r in (0, 1)}
    before = dict(device_ops.COUNTS)
    run(prepared, stage_bindings(prepared, src_b, real), LocalTransport(), timeout=60,
        programs={}, tuning=tuning)
    codes, scales = quantize_block_fp8(values, fmt, name="w")
    for r in (2, 3):
        for key, want in (("w", codes), ("w.scale", scales)):
            region = dst[key].regions(r)[0]
            part = want[tuple(slice(a, b) for a, b in zip(region.starts, region.stops))]
            assert real[(r, key)][0].tobytes() == np.ascontiguousarray(part).tobytes(), key
    return {k: v - before.get(k, 0) for k, v in device_ops.COUNTS.items()
            if v != before.get(k, 0)}


def test_tuning_device_kernels_reach_the_fp8_device_path():
    """``Tuning(device_kernels="torch")`` runs the FP8 quantizers of the device path with
    torch ops even where ``host_device_ops`` (the device path on host bindings) says JAX:
    the tuning's choice wins, as it does for the delta diff. Before issue 32 the FP8
    device path asked for "auto" whatever the tuning said (it quantized with the test
    switch's framework). The bytes are vLLM's either way."""
    pytest.importorskip("torch")
    from xreshard.config import Tuning

    counts = _fp8_call(Tuning(executor="rounds", host_device_ops="jax", device_kernels="torch"))
    assert counts.get("quantize/torch", 0) > 0 and "quantize/jax" not in counts, counts
    # host bindings without host_device_ops: the host quantizer, no device op at all
    assert _fp8_call(Tuning(executor="rounds")) == {}


def test_tuning_reads_the_switches_once():
    """The switches that bypassed Tuning are fields, read by ``Tuning.from_env`` only."""
    from xreshard.config import Tuning
    from xreshard.errors import RefitError
    from xreshard.runtime.codecs.kernels import Kernels

    t = Tuning.from_env({"XRESHARD_TEST_DEVICE_OPS": "torch", "XRESHARD_QUANT_THREADS": "3",
                         "XRESHARD_DEVICE_KERNELS": "jax"})
    assert (t.host_device_ops, t.quant_threads, t.device_kernels) == ("torch", 3, "jax")
    assert Kernels.of(t) == Kernels("jax", "torch", 3) and Kernels.of(t).prefer == "jax"
    assert Kernels.of(Tuning(host_device_ops="torch")).prefer == "torch"
    assert Tuning.from_env({}).host_device_ops is None
    with pytest.raises(RefitError, match="XRESHARD_TEST_DEVICE_OPS='cupy'"):
        Tuning.from_env({"XRESHARD_TEST_DEVICE_OPS": "cupy"})
    with pytest.raises(RefitError, match="quant_threads"):
        Tuning(quant_threads=0)
    for path in ("runtime/device_ops.py", "runtime/quantize_device.py", "quant/host.py"):
        assert "os.environ" not in (ROOT / path).read_text(), path
def _subclasses_of_executor() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = base.attr if isinstance(base, ast.Attribute) else getattr(
                        base, "id", None)
                    if name is not None and name.endswith("Executor") and \
                            name != "ThreadPoolExecutor":
                        found.append(f"{path.relative_to(ROOT)}:{node.name}({name})")
    return found


def test_no_executor_subclass_and_the_codecs_package_exists():
    """Wire features are codecs the one executor runs, not subclasses of it (issue 32)."""
    assert (ROOT / "runtime" / "codecs" / "__init__.py").is_file()
    assert _subclasses_of_executor() == []


def test_formats_are_decided_once_by_the_planner():
    """``prepare`` is one path (plan -> relay stages -> formats -> schedule): every
    ``(name, stage)`` item has one format, FP8 ones sized by the schedule as scales +
    codes; a relayed FP8 call forwards them as plain tensors in stage 1; a delta call's
    framing is SIZED; and the second planner of FP8 calls is gone."""
    from xreshard.ir.formats import BlockFP8, QuantizedTensor
    from xreshard.ir.topology import Topology
    from xreshard.planner import formats as F
    from xreshard.planner import prepare as P

    assert not hasattr(P, "_prepare_quantized") and not hasattr(P, "_relay_quantized")
    shape, fmt = (256, 256), BlockFP8()
    src = {"w": xr.Layout.explicit_form(shape, "bfloat16", {0: [[(0, 256), (0, 256)]]}),
           "b": xr.Layout.explicit_form((256,), "float32", {0: [[(0, 256)]]})}
    qt = QuantizedTensor("w", "w.scale", fmt, shape)
    dst = {"w": xr.Layout.explicit_form(shape, fmt.dtype, {r: [[(0, 256), (0, 256)]]
                                                          for r in (1, 2)}),
           "w.scale": xr.Layout.explicit_form(qt.scale_shape, fmt.scale_dtype, {
               r: [[(0, n) for n in qt.scale_shape]] for r in (1, 2)}),
           "b": xr.Layout.explicit_form((256,), "float32", {r: [[(0, 256)]] for r in (1, 2)})}
    topo = Topology.of({0: (0, "t"), 1: (1, "a"), 2: (2, "a")})
    direct = prepare(src, dst, topo, CallOptions(wire_dtype={"b": "bfloat16"}),
                     ranks=range(3), quantized={"w": qt})
    assert direct.formats.item("w") == F.Fp8(fmt, "bfloat16", False)
    assert direct.formats.item("b") == F.Cast("bfloat16")
    assert direct.formats.framing == F.FIXED and "w" in direct.formats.quant.tensors
    items = [it for rnd in direct.schedule.rounds for b in rnd for it in b.items
             if it.name == "w"]
    assert items and all(it.quantized for it in items)
    assert sum(it.nbytes for it in items) == 2 * fmt.wire_bytes(shape)   # two receivers
    relayed = prepare(src, dst, topo, CallOptions(relay="on", delta=True), ranks=range(3),
                      quantized={"w": qt})
    assert len(relayed.stages) == 2 and relayed.formats.framing == F.SIZED
    assert relayed.formats.item("w", 0) == F.Fp8(fmt, "bfloat16", False)
    assert relayed.formats.item("w", 1) == F.PLAIN
    assert relayed.formats.item("w.scale", 1) == F.PLAIN
    assert relayed.formats.item("b", 0) == F.PLAIN


def _runtime_imports() -> dict[str, set[str]]:
    """Which runtime modules each runtime module imports (at its top or inside a function;
    annotations under ``TYPE_CHECKING`` are not imports)."""
    runtime = ROOT / "runtime"
    graph: dict[str, set[str]] = {}
    for path in sorted(runtime.rglob("*.py")):
        mod = ".".join(path.relative_to(runtime).with_suffix("").parts)
        package = mod.split(".")[:-1] if path.name != "__init__.py" else mod.split(".")
        deps = graph.setdefault(mod, set())
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level or id(node) in typing_only:
                continue
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            if node.level > len(package) + 1:
                continue            # above runtime/
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [
                ".".join(base + [a.name]) for a in node.names]
            deps.update(n for n in names if n)
    return graph


def test_no_import_circle_through_the_executor():
    """Issue 32: execute, delta_device, the delta codec, delta_encode, quantized, verify,
    metadata and binding imported each other in a circle (closed by re-exports through
    execute and the executor choosing its subclass). No runtime module imported by the
    executor imports it back, and none of those eight is on a cycle."""
    graph = _runtime_imports()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep in graph and dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen
    eight = ["execute", "delta_device", "codecs.delta", "delta_encode", "quantized", "verify",
             "metadata", "binding"]
    on_cycles = [m for m in eight if m in reach(m)]
    assert on_cycles == []
    assert "execute" not in reach("execute")
