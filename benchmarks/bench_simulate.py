"""Simulated refit times against published runs, the simulator's CPU cost, and the model
checked against this machine.

    python benchmarks/bench_simulate.py                   # every case, a markdown table
    python benchmarks/bench_simulate.py --case m2n --json # one case, plus its JSON

Cases:
  m2n      NCCL M2N DeepSeek-V3, GB200 NVL72: TP1 EP16 DP2 PP4 (128 GPUs, 2 NVLink domains)
           -> TP8 DP16 (128 GPUs, 2 other domains), bf16. Published: direct 3,838 ms,
           hierarchical 1,447 ms. Direct, and the shipped relay (RefitConfig(relay="on"),
           each NVLink domain declared as a host); ``relay_replays_executor``: the relay's
           simulated messages of two ranks (a source and a destination) equal, message for
           message, the executor's own schedule of the same refit (the comparison
           tests/test_simulate.py pins on small worlds).
  nemo     NeMo-RL DeepSeek-V3 on H100: PP16 EP16 -> TP32 DP8 (256 + 256 GPUs).
           Published: 2.39-2.83 s.
  kimi     Kimi-K2 megatron:pp=16,ep=16 (256 H100) -> vllm:tp=16,dp=8 (128 H100), bf16.
           Perplexity: 1.3 s (FP8 on the wire, hardware not published).
  fp8      --wire fp8: Kimi-K2 256 -> 128 H100 (bar: within 1.05x its NIC bound) and
           DeepSeek-V3 on 256 GB200, FP8 beside bf16, direct and relay.
  delta    --delta: Qwen3-235B-A22B, verl's setting (64 trainer GPUs, ep8 x dp8 -> TP16 on
           16), dense and 0.0005 / 0.01 / 0.03 changed, on dgx-h100 and on xdc-h100
           (trainer and engines in two datacenters, 100 Gb/s per node).
  ckpt     checkpoint-engine Kimi-K2 broadcast on 256 H20 (16 x TP16): 16 s published;
           priced from the same cluster numbers (analytic).
  scale    Kimi-K2 at 2,048 ranks (megatron:pp=16,ep=64 -> vllm:tp=16,dp=64, stacked
           experts) on dgx-h100: CPU time (bar: <= 5 min).
  localhost  calibrate this machine (benchmarks/calibrate_localhost.py) and predict refits
           measured here in the same run; ``--json`` prints ``[{layout, predicted_s,
           measured_s}]`` (bar: every ratio in [0.8, 1.25]).

The cluster parameters are the presets' documented values (xreshard/sim/cluster.py), the
same for every case: nothing is fitted to a published number (localhost is measured).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from xreshard.sim.cluster import load_cluster  # noqa: E402
from xreshard.catalog.models import load_model  # noqa: E402
from xreshard.sim.simulate import simulate  # noqa: E402

DSV3 = ("deepseek_v3", "megatron:tp=1,ep=16,dp=2,pp=4", "vllm:tp=8,dp=16")
KIMI = ("kimi_k2", "megatron:pp=16,ep=16", "vllm:tp=16,dp=8")
QWEN235 = ("qwen3_235b_a22b", "megatron:ep=8,dp=8", "vllm:tp=16")


def row(label: str, r: dict, published: str, note: str = "") -> str:
    gb = 1e9
    s = r["schedules"]
    direct = f"{s['direct']['seconds']:.3f}" if "direct" in s else "-"
    relay = f"{s['relay']['seconds']:.3f}" if "relay" in s else "-"
    net = {k: (f"{sum(v for x, v in s[k]['bytes_by_link'].items() if x != 'nvlink') / gb:,.0f}"
               if k in s else "-") for k in ("direct", "relay")}
    best = min(s.values(), key=lambda x: x["seconds"])
    return (f"| {label} | {r['num_ranks']} | {direct} | {relay} | "
            f"{r['lower_bound_seconds']:.3f} ({r['lower_bound']['by']}) | "
            f"{best['seconds'] / r['lower_bound_seconds']:.2f} | {net['direct']} | "
            f"{net['relay']} | {best['critical']['link']}: {best['critical']['where']} | "
            f"{published} | {r['sim_seconds']:.1f} | {note} |")


HEADER = ("| case | GPUs | direct (s) | relay (s) | lower bound (s) | best / bound | "
          "network GB, direct | network GB, relay | critical link (best) | published | "
          "simulator CPU s | note |\n"
          "|---|---:|---:|---:|---|---:|---:|---:|---|---|---:|---|")


def case_m2n(args) -> tuple[list[str], dict]:
    from xreshard.sim.relay import relay_replays_executor
    # each schedule simulated on its own: sim CPU seconds per schedule
    d = simulate(*DSV3, "gb200-nvl72", gpus=256, schedule="direct", progress=args.progress)
    r = simulate(*DSV3, "gb200-nvl72", gpus=256, schedule="relay", progress=args.progress)
    model = load_model("deepseek_v3").total_bytes
    out = [row("M2N DeepSeek-V3, direct", d, "3.838 s (Direct P2P)",
               f"{d['seconds'] / 3.83774 - 1:+.1%} vs published")]
    relay = r["schedules"]["relay"]
    out.append(row("M2N DeepSeek-V3, relay (shipped)", r, "1.447 s (hierarchical)",
                   f"network = {r['bytes_by_link']['network'] / model:.2f} model copies; "
                   f"{relay['num_rounds']:,} rounds, {relay['num_messages']:,} messages"))
    d2 = simulate(*DSV3, "gb200-nvl72", gpus=256, schedule="direct", peer_cap=False,
                  progress=args.progress)
    out.append(row("M2N DeepSeek-V3, direct, no NCCL peer cap (GIN)", d2, "3.838 s",
                   f"{d2['seconds'] / 3.83774 - 1:+.1%} vs published"))
    # the relay's messages of two ranks against the executor's own schedule (relay_layouts,
    # both stage plans, overlapped_schedule): Bucket objects for those ranks only
    ranks = [0, 200]
    t = time.process_time()
    same = relay_replays_executor(r["_plan"], r["_placement"].domain, ranks=ranks,
                                  bucket_bytes=64 << 20, staging_bytes=256 << 20,
                                  simulated=r["_predictions"]["relay"].traffic)
    check = time.process_time() - t
    out.append(f"\nrelay_replays_executor (ranks {ranks}, every message they send or "
               f"receive): {str(same).lower()} ({check:.0f} s CPU for the executor's side)")
    figures = {"case": "m2n", "direct_s": d["seconds"], "relay_s": r["seconds"],
               "relay_replays_executor": same, "relay_check_ranks": ranks,
               "relay_rounds": relay["num_rounds"], "relay_messages": relay["num_messages"],
               "lower_bound_s": r["lower_bound_seconds"], "direct_sim_cpu_s": d["sim_seconds"],
               "relay_sim_cpu_s": r["sim_seconds"], "relay_check_cpu_s": check}
    return out, figures


def case_nemo(args) -> tuple[list[str], dict]:
    r = simulate("deepseek_v3", "megatron:pp=16,ep=16", "vllm:tp=32,dp=8", "dgx-h100",
                 gpus=512, schedule="auto", progress=args.progress)
    return ([row("NeMo-RL DeepSeek-V3 H100, PP16 EP16 -> TP32 DP8", r, "2.39-2.83 s")],
            {"case": "nemo", **{f"{k}_s": v["seconds"] for k, v in r["schedules"].items()}})


def nic_bound(r: dict, schedule: str = "direct") -> float:
    """The most wire bytes one GPU receives over its NIC's rate."""
    return r["schedules"][schedule]["bytes_received_max"] / load_cluster(r["cluster"]).nic_bw


def case_kimi(args) -> tuple[list[str], dict]:
    r = simulate(*KIMI, "dgx-h100", gpus=384, schedule="auto", progress=args.progress)
    bound = nic_bound(r)
    return ([row("Kimi-K2 H100 256 -> 128, bf16", r, "1.3 s (Perplexity, FP8)",
                 f"NIC bound (bytes per GPU / 47 GB/s) {bound:.2f} s")],
            {"case": "kimi", "nic_bound_s": bound,
             **{f"{k}_s": v["seconds"] for k, v in r["schedules"].items()}})


def case_fp8(args) -> tuple[list[str], dict]:
    out, figures = [], {"case": "fp8"}
    k16 = simulate(*KIMI, "dgx-h100", gpus=384, schedule="direct", progress=args.progress)
    k8 = simulate(*KIMI, "dgx-h100", gpus=384, schedule="direct", wire="fp8",
                  progress=args.progress)
    b16, b8 = nic_bound(k16), nic_bound(k8)
    out.append(row("Kimi-K2 H100 256 -> 128, bf16 (direct)", k16, "-",
                   f"NIC bound {b16:.3f} s; over it {k16['seconds'] / b16:.3f}"))
    out.append(row("Kimi-K2 H100 256 -> 128, **FP8** (direct)", k8, "1.3 s (Perplexity)",
                   f"NIC bound {b8:.3f} s; over it **{k8['seconds'] / b8:.3f}** (bar 1.05); "
                   f"wire bytes / bf16 {k8['bytes_received_max'] / k16['bytes_received_max']:.3f}"))
    figures.update(kimi_bf16_s=k16["seconds"], kimi_fp8_s=k8["seconds"], kimi_fp8_nic_bound_s=b8,
                   kimi_fp8_over_nic_bound=k8["seconds"] / b8)
    for wire in ("dtype", "fp8"):
        r = simulate(*DSV3, "gb200-nvl72", gpus=256, schedule="auto", wire=wire,
                     progress=args.progress)
        label = "bf16" if wire == "dtype" else "**FP8**"
        out.append(row(f"M2N DeepSeek-V3 GB200, {label}", r, "1.447 s (hierarchical, bf16)",
                       f"received by the busiest GPU {r['bytes_received_max'] / 1e9:,.1f} GB"))
        figures.update({f"dsv3_{wire}_{k}_s": v["seconds"] for k, v in r["schedules"].items()})
    return out, figures


def case_delta(args) -> tuple[list[str], dict]:
    out, figures = [], {"case": "delta"}
    for cluster in ("dgx-h100", "xdc-h100"):
        dense = None
        for changed in (None, 0.0005, 0.01, 0.03):
            r = simulate(*QWEN235, cluster, gpus=80, schedule="direct", delta=changed,
                         progress=args.progress)
            dense = dense or r
            what = "dense" if changed is None else f"delta {changed:g}"
            published = {("dgx-h100", 0.0005): "verl delta_sharded 11.4-14.9 s at 0.05-0.02% "
                                                "(NCCL broadcast 246-266 s)",
                         ("dgx-h100", 0.03): "NeMo-RL sparse 20.2 s S3 / 24.1 s ZMQ at 3% "
                                             "(247 GB model; dense NCCL 1.46-1.74 s)"}
            out.append(row(f"Qwen3-235B {cluster}, {what}", r,
                           published.get((cluster, changed), "-"),
                           f"{r['seconds'] / dense['seconds']:.3f} of dense"))
            figures[f"{cluster}_{what}_s"] = r["seconds"]
    return out, figures


def case_ckpt(args) -> tuple[list[str], dict]:
    # checkpoint-engine broadcasts the whole model to every GPU (NCCL broadcast between
    # its workers). Priced from the same cluster numbers: every GPU pulling the model
    # through its own NIC, and the floor where each 8-GPU node takes one copy over its 8
    # NICs; the shipped relay does the second and then forwards 7/8 of the model per GPU
    # over NVLink. H20 nodes have the same 8 x 400G NICs as DGX H100. TODO(model): an H20
    # preset, collectives.
    model = load_model("kimi_k2").total_bytes / 2   # FP8 on the wire
    c = load_cluster("dgx-h100")
    per_nic = model / c.nic_bw
    per_node = model / (c.nics_per_node * c.nic_bw)
    forward = model * 7 / 8 / c.nvlink_bw
    return ([f"| checkpoint-engine Kimi-K2 FP8 broadcast, 256 H20 | 256 | {per_nic:.2f} | "
             f"{per_node:.2f}-{per_node + forward:.2f} | {per_node:.2f} (one copy per node) | - | "
             f"{model * 256 / 1e9:,.0f} | {model * 32 / 1e9:,.0f} | - | 16.0 s | - | "
             f"analytic ({model / 1e9:,.0f} GB FP8 model to every GPU); relay: the network "
             f"floor, up to the floor plus the forwards ({forward:.2f} s of NVLink per GPU) "
             "if they do not overlap; the 16 s includes H2D copies from pinned CPU memory "
             "and the engine's loads |"], {"case": "ckpt", "direct_s": per_nic,
                                          "relay_floor_s": per_node})


def case_scale(args) -> tuple[list[str], dict]:
    t = time.process_time()
    r = simulate("kimi_k2", "megatron:pp=16,ep=64", "vllm:tp=16,dp=64", "dgx-h100",
                 gpus=2048, schedule="direct", layout="stacked", progress=args.progress)
    cpu = time.process_time() - t
    # peak resident memory of this process (run the case alone for the case's own peak)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    s = r["schedules"]["direct"]
    return ([row("Kimi-K2 2,048 ranks (stacked), direct", r, "-",
                 f"CPU {cpu:.0f} s (bar 300 s), peak RSS {rss:.2f} GB, "
                 f"{s['num_messages']:,} messages in {s['num_rounds']:,} rounds "
                 f"({r['distinct_rounds']:,} distinct)")],
            {"case": "scale", "direct_s": r["seconds"], "cpu_s": cpu, "peak_rss_gb": rss})


def case_localhost(args) -> tuple[list[str], list]:
    from calibrate_localhost import run
    res = run(args.mib, args.reps, None)
    c = res["cluster"]
    out = [f"\nlocalhost (measured now, written to {res['path']}): pull "
           f"{c['nvlink_bw'] / 1e9:.2f} GB/s per process, host {c['host_bw'] / 1e9:.2f} GB/s, "
           f"{c['nvlink_latency'] * 1e3:.2f} ms per round, {c['message_cost'] * 1e3:.2f} ms per "
           f"message, {c['call_latency'] * 1e3:.1f} ms per call\n",
           "| layout | predicted s | measured s (median) | predicted / measured |",
           "|---|---:|---:|---:|"]
    for r in res["validation"] + res["beyond"]:
        tag = " (outside the model)" if r in res["beyond"] else ""
        out.append(f"| {r['layout']}{tag} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                   f"{r['ratio']:.2f} |")
    rows = [{k: r[k] for k in ("layout", "predicted_s", "measured_s")}
            for r in res["validation"]]
    return out, rows


CASES = {"m2n": case_m2n, "nemo": case_nemo, "kimi": case_kimi, "fp8": case_fp8,
         "delta": case_delta, "ckpt": case_ckpt, "scale": case_scale,
         "localhost": case_localhost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--json", action="store_true",
                        help="also print each case's figures as one JSON line")
    parser.add_argument("--mib", type=int, default=128, help="localhost: MiB per case")
    parser.add_argument("--reps", type=int, default=15, help="localhost: repetitions")
    args = parser.parse_args()
    print(HEADER)
    for name in args.case or [c for c in CASES if c != "localhost"]:
        lines, figures = CASES[name](args)
        for line in lines:
            print(line, flush=True)
        if args.json:
            print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
