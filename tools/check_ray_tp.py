"""The served TP path on GPUs: an Engine over Ray worker actors (placement group, compiled graph, NCCL, custom
all-reduce with widened GPU visibility) at tensor_parallel_size N, against the in-process TP=1 engine on the same
checkpoint: greedy tokens and decode ms per token (steps after the first token, overlap schedule on).

    python tools/check_ray_tp.py --ckpt /tmp/llama8b-random --tp 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(ckpt: str, tp: int, new_tokens: int, backend: str) -> dict:
    from deployments.cli import build_engine
    from deployments.config import EngineConfig
    from deployments.request import SamplingParams

    cfg = EngineConfig(model=ckpt, device="cuda", dtype="bfloat16", tensor_parallel_size=tp, max_model_len=2048,
                       max_num_seqs=8, kv_cache_tokens=16384, prefill_attention_backend=backend,
                       decode_attention_backend=backend)
    t0 = time.perf_counter()
    eng = build_engine(cfg)
    start_s = time.perf_counter() - t0
    prompt = list(range(1000, 1128))
    try:
        eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # warm-up
        req = eng.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        first = None
        while eng.has_work():
            eng.step()
            if first is None and req.output_ids:
                first = (time.perf_counter(), len(req.output_ids))
        end = time.perf_counter()
        result = {"tokens": req.output_ids, "error": req.error, "start_s": round(start_s, 1)}
        if first is not None and len(req.output_ids) > first[1]:
            result["decode_ms_per_token"] = round((end - first[0]) / (len(req.output_ids) - first[1]) * 1e3, 3)
        return result
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    import ray
    import torch

    from bench.engine_vs_hf import commit, device_name

    result = {"device": f"{torch.cuda.device_count()}x {device_name('cuda')}", "commit": commit(),
              "command": " ".join(sys.argv), "checkpoint": args.ckpt}
    ray_tp = run(args.ckpt, args.tp, args.new_tokens, args.backend)
    ray.shutdown()
    local = run(args.ckpt, 1, args.new_tokens, args.backend)
    a, b = local["tokens"], ray_tp["tokens"]
    result.update({f"ray_tp{args.tp}": {k: v for k, v in ray_tp.items() if k != "tokens"},
                   "local_tp1": {k: v for k, v in local.items() if k != "tokens"}, "num_tokens": len(b),
                   "first_difference": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None),
                   "tp_over_tp1": round(ray_tp["decode_ms_per_token"] / local["decode_ms_per_token"], 3)
                   if "decode_ms_per_token" in ray_tp and "decode_ms_per_token" in local else None})
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if ray_tp["error"] or local["error"] or len(b) != args.new_tokens:
        sys.exit(1)


if __name__ == "__main__":
    main()
