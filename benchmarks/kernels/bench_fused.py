"""Device timing of the fused elementwise Triton kernels vs the torch eager path (needs a CUDA GPU).

Qwen3-0.6B shapes (hidden 1024, intermediate 3072, 16 q / 8 kv heads, head_dim 128), bf16,
N = 1, 256, 16384 tokens. For each kernel: torch path (`forward_native`; RotaryEmbedding's forward) and
fused times as triton.testing.do_bench medians, run eagerly and replayed inside a CUDA
graph (what decode sees), and the fused kernel's GB/s over the bytes that must move
(inputs read once + outputs written once), also as % of the HBM copy bandwidth
(benchmarks/harness/probes.py).
The `layer` rows add one decoder layer's four calls (2 x add_rms_norm, qk_norm_rope,
silu_and_mul); `x28` is the whole 0.6B model's elementwise cost per step.

    python -m benchmarks.kernels.bench_fused [--json PATH]

`--fp8-silu`: the FP8 down projection's input instead, per token and per 128-column group, at the
intermediate widths of Qwen3-0.6B / -8B and Llama-3.1-8B, graph-replayed medians: the activation
quantization alone, SiLU-and-mul then it (two kernels), and `silu_and_mul_fp8` (one kernel per
group; per token it is the two kernels).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from benchmarks.harness.engine_options import require_cuda
from benchmarks.harness.probes import measure_bandwidth
from benchmarks.harness.timing import median_s
from nanovllm.kernels.fp8_quant import RowQuant, quantize
from nanovllm.kernels.fused_activation import silu_and_mul, silu_and_mul_fp8
from nanovllm.kernels.fused_norm import add_rms_norm, rms_norm
from nanovllm.kernels.fused_rope import qk_norm_rope
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding

H, INTER, HQ, HKV, D = 1024, 3072, 16, 8, 128  # Qwen3-0.6B
NUM_LAYERS = 28
MAX_POS, THETA, EPS = 40960, 1e6, 1e-6
DT = torch.bfloat16
DEV = "cuda"
NS = (1, 256, 16384)


def bench_graph(fn):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3
    except Exception:  # noqa: BLE001 - report eager numbers only
        return float("nan")


def cases(n, gen):
    """name -> (torch fn, fused fn, bytes moved) for n tokens."""
    def randn(*shape):
        return torch.randn(shape, device=DEV, generator=gen).to(DT)

    norm, q_norm, k_norm = RMSNorm(H, EPS).to(DEV, DT), RMSNorm(D, EPS).to(DEV, DT), RMSNorm(D, EPS).to(DEV, DT)
    rot = RotaryEmbedding(D, MAX_POS, THETA).to(DEV)  # cos_sin_cache stays float32
    x, res, gate_up = randn(n, H), randn(n, H), randn(n, 2 * INTER)
    q, k, _ = randn(n, (HQ + 2 * HKV) * D).split([HQ * D, HKV * D, HKV * D], -1)
    q, k = q.view(n, HQ, D), k.view(n, HKV, D)
    pos = torch.randint(0, MAX_POS, (n,), device=DEV, generator=gen)
    e = x.element_size()
    return {
        "rms_norm": (lambda: norm.forward_native(x), lambda: rms_norm(x, norm.weight, EPS),
                     2 * n * H * e + H * e),
        "add_rms_norm": (lambda: norm.forward_native(x, res), lambda: add_rms_norm(x, res, norm.weight, EPS),
                         4 * n * H * e + H * e),
        "silu_and_mul": (lambda: SiluAndMul.forward_native(gate_up), lambda: silu_and_mul(gate_up),
                         3 * n * INTER * e),
        "qk_norm_rope": (lambda: rot(pos, q_norm.forward_native(q), k_norm.forward_native(k)),
                         lambda: qk_norm_rope(q, k, q_norm.weight, k_norm.weight, pos, rot.cos_sin_cache, EPS),
                         2 * n * (HQ + HKV) * D * e + n * (D * 4 + 8) + 2 * D * e),
    }


LAYER_CALLS = {"add_rms_norm": 2, "qk_norm_rope": 1, "silu_and_mul": 1}  # per decoder layer


def run_n(n, bw):
    gen = torch.Generator(DEV).manual_seed(n)
    rows = []
    for name, (torch_fn, fused_fn, nbytes) in cases(n, gen).items():
        r = {"kernel": name, "n": n, "bytes": nbytes,
             "torch_us": median_s(torch_fn) * 1e6, "fused_us": median_s(fused_fn) * 1e6,
             "torch_graph_us": bench_graph(torch_fn) * 1e6, "fused_graph_us": bench_graph(fused_fn) * 1e6}
        r["speedup"] = r["torch_us"] / r["fused_us"]
        r["graph_speedup"] = r["torch_graph_us"] / r["fused_graph_us"]
        r["GB/s"] = nbytes / (r["fused_us"] * 1e-6) / 1e9
        r["pct_bw"] = 100 * r["GB/s"] / bw
        rows.append(r)
        print(r, flush=True)
    layer = {"kernel": "layer", "n": n}
    for col in ("torch_us", "fused_us", "torch_graph_us", "fused_graph_us"):
        layer[col] = sum(LAYER_CALLS.get(r["kernel"], 0) * r[col] for r in rows)
    layer["speedup"] = layer["torch_us"] / layer["fused_us"]
    layer["graph_speedup"] = layer["torch_graph_us"] / layer["fused_graph_us"]
    rows.append(layer)
    rows.append({"kernel": f"x{NUM_LAYERS}", "n": n, **{c: NUM_LAYERS * layer[c] for c in
                 ("torch_us", "fused_us", "torch_graph_us", "fused_graph_us")},
                 "speedup": layer["speedup"], "graph_speedup": layer["graph_speedup"]})
    return rows


def print_table(rows, bw):
    print(f"\n== Qwen3-0.6B elementwise kernels, bf16 | HBM copy {bw:.0f} GB/s | times in us (do_bench median) ==")
    print(f"{'kernel':>14} {'N':>6} | {'torch':>8} {'fused':>8} {'x':>6} | {'torch/g':>8} {'fused/g':>8} {'x':>6} "
          f"| {'GB/s':>6} {'%bw':>5}")
    nan = float("nan")
    for r in rows:
        print(f"{r['kernel']:>14} {r['n']:>6} | {r['torch_us']:8.1f} {r['fused_us']:8.1f} {r['speedup']:6.2f} | "
              f"{r['torch_graph_us']:8.1f} {r['fused_graph_us']:8.1f} {r['graph_speedup']:6.2f} | "
              f"{r.get('GB/s', nan):6.0f} {r.get('pct_bw', nan):5.1f}")
    print("(/g = replayed in a CUDA graph; x = torch / fused; layer = 2 add_rms_norm + qk_norm_rope + silu_and_mul)")


FP8_SILU_WIDTHS = (3072, 12288, 14336)  # Qwen3-0.6B, Qwen3-8B, Llama-3.1-8B intermediate sizes
FP8_SILU_ROWS = (64, 256, 1024, 8192)
FP8_QUANTS = {"token": RowQuant(), "group": RowQuant(128)}


def run_fp8_silu(bw):
    """us per call, graph-replayed: the quantization alone, SiLU-and-mul then it, and the fused kernel."""
    rows = []
    print(f"\n== SiLU-and-mul + FP8 quantization, bf16 in | HBM copy {bw:.0f} GB/s | us (graph replay median) ==")
    for mode, how in FP8_QUANTS.items():
        for inter in FP8_SILU_WIDTHS:
            for n in FP8_SILU_ROWS:
                gen = torch.Generator(DEV).manual_seed(n)
                x = torch.randn(n, 2 * inter, device=DEV, generator=gen).to(DT)
                y = silu_and_mul(x)
                r = {"mode": mode, "inter": inter, "n": n,
                     "quantize": bench_graph(lambda: quantize(y, how)) * 1e6,
                     "two_kernels": bench_graph(lambda: quantize(silu_and_mul(x), how)) * 1e6,
                     "silu_and_mul_fp8": bench_graph(lambda: silu_and_mul_fp8(x, how)) * 1e6}
                r["pct_bw_quantize"] = 100 * n * inter * 3 / (r["quantize"] * 1e-6) / 1e9 / bw  # bf16 in, 1 byte out
                r["pct_bw_fused"] = 100 * n * inter * 5 / (r["silu_and_mul_fp8"] * 1e-6) / 1e9 / bw  # 2 bf16 in
                rows.append(r)
                print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                      flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--fp8-silu", action="store_true", help="the FP8 SiLU-and-mul table only")
    args = ap.parse_args()
    require_cuda("bench_fused.py", "kernel time")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    bw = measure_bandwidth() / 1e9
    if args.fp8_silu:
        rows = run_fp8_silu(bw)
    else:
        rows = [r for n in NS for r in run_n(n, bw)]
        print_table(rows, bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
