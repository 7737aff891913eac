"""Where a decode step's GPU time goes: kernel time by name under torch.profiler (eager engine steps), and each of
the model's linear shapes at M=1 timed alone against its weight-read floor.

    python bench/profile_decode.py --ckpt /tmp/llama-3.1-8b-random --out bench/results/profile_decode_8b_h100
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_vs_hf import commit, device_name  # noqa: E402
from bench.verify_attention import copy_bandwidth  # noqa: E402


def linear_table(cfg: dict, bw: float) -> list[dict]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    rows = []
    for name, (n, k) in {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter),
                         "lm_head": (v, h)}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        from triton.testing import do_bench

        t_linear = do_bench(lambda: F.linear(x, w), warmup=20, rep=200)
        t_mv = do_bench(lambda: torch.mv(w, x[0]), warmup=20, rep=200)
        floor = n * k * 2 / bw * 1e3
        rows.append({"linear": name, "n": n, "k": k, "F.linear_ms": round(t_linear, 4), "torch.mv_ms": round(t_mv, 4),
                     "floor_ms": round(floor, 4), "F.linear_vs_floor": round(t_linear / floor, 2),
                     "mv_vs_floor": round(t_mv / floor, 2)})
        print(rows[-1], flush=True)
        del w
    return rows


def kernel_profile(ckpt: str, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from deployments.config import EngineConfig
    from deployments.engine import Engine
    from deployments.request import SamplingParams

    eng = Engine(EngineConfig(model=ckpt, device="cuda", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
                              disable_cuda_graph=True, prefill_attention_backend="triton",
                              decode_attention_backend="triton", gpu_memory_utilization=0.5))
    eng.add_request(list(range(1000, 1128)), SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    by = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name[:90]] += e.device_time_total / 1e3 / steps
    total = sum(by.values())
    rows = [{"kernel": k, "ms_per_step": round(v, 4), "share": round(v / total, 3)}
            for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:20]]
    for r in rows:
        print(r, flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return [{"total_ms_per_step": round(total, 3)}] + rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
    bw = copy_bandwidth()
    res = {"device": device_name("cuda"), "commit": commit(), "command": "python " + " ".join(sys.argv),
           "copy_bandwidth_gb_s": round(bw / 1e9, 1), "linears_m1": linear_table(cfg, bw),
           "kernels_bs1_eager": kernel_profile(args.ckpt, args.steps)}
    Path(args.out + ".json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
