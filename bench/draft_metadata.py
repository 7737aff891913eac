"""Draft-round metadata cost: built once per round (``ForwardBatch.build_steps``) vs rebuilt for every step
(``ForwardBatch.build`` per step), each followed by the attention backend's per-step ``init_forward_metadata``.
Host wall time per round (the GPU is synchronised at the end of every round), 4 draft steps.

    python bench/draft_metadata.py --device cuda --backend triton --out bench/results/draft_metadata_h100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention.registry import _make  # noqa: E402
from bench.engine_vs_hf import commit  # noqa: E402
from workers.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from workers.kv_cache import KVCache, PageTable  # noqa: E402


def round_inputs(b: int, k: int, steps: int, ctx: int, device):
    seq_lens = [[ctx + (s + 1) * k] * b for s in range(steps)]
    m = torch.full((b,), ctx - 1, device=device)
    positions = (m.unsqueeze(0) + torch.arange(steps, device=device).unsqueeze(1)).repeat_interleave(k, dim=1)
    return seq_lens, positions


def per_step(backend, kv, table, b, k, steps, ctx, masks):
    seq_lens, positions = round_inputs(b, k, steps, ctx, table.table.device)
    for s in range(steps):
        fb = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(b * k, dtype=torch.int64, device=positions.device),
                                list(range(b)), seq_lens[s], [k] * b, kv, table, positions=positions[s],
                                logits_indices=torch.arange(b * k, device=positions.device), tree_mask=masks[s])
        backend.init_forward_metadata(fb)


def once_per_round(backend, kv, table, b, k, steps, ctx, masks):
    seq_lens, positions = round_inputs(b, k, steps, ctx, table.table.device)
    for s, fb in enumerate(ForwardBatch.build_steps(ForwardMode.DECODE, list(range(b)), seq_lens, k, positions, kv,
                                                    table)):
        fb.tree_mask = masks[s]
        backend.init_forward_metadata(fb)


def measure(fn, device, iters: int) -> float:
    for _ in range(5):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        sync()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None, help="path prefix for .json and .md")
    args = ap.parse_args()
    device = torch.device(args.device)
    backend = _make(args.backend, "decode", device)
    ctx, page = 1024, 16
    rows = []
    for k in (1, 4):  # chain (no mask) and a top-4 tree (scratch mask per step)
        for b in (1, 8, 32):
            pages = b * (-(-(ctx + args.steps * k) // page)) + 1
            kv = KVCache(1, pages, page, 8, 128, torch.bfloat16, device)
            table = PageTable(b, pages // b, page, device)
            table.table.copy_((torch.arange(b * (pages // b)) % (pages - 1) + 1).view(b, -1).to(torch.int32))
            masks = [None if k == 1 else torch.ones(b, k, (s + 1) * k, dtype=torch.bool, device=device)
                     for s in range(args.steps)]
            a = (backend, kv, table, b, k, args.steps, ctx, masks)
            t_step = measure(lambda: per_step(*a), device, args.iters)
            t_once = measure(lambda: once_per_round(*a), device, args.iters)
            rows.append({"topk": k, "batch": b, "steps": args.steps, "per_step_ms": round(t_step, 4),
                         "once_per_round_ms": round(t_once, 4), "speedup": round(t_step / t_once, 2)})
            print(rows[-1], flush=True)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    meta = {"device": dev, "commit": commit(), "backend": args.backend,
            "command": "python " + " ".join(sys.argv), "rows": rows}
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(meta, indent=2))
        lines = [f"# Draft-round metadata, {args.steps} steps ({args.backend} backend)", "",
                 f"device: {dev} · commit: {meta['commit']} · command: `{meta['command']}`", "",
                 "| top-k | batch | per step (ms/round) | once per round (ms/round) | speedup |", "|---|---|---|---|---|"]
        lines += [f"| {r['topk']} | {r['batch']} | {r['per_step_ms']:.3f} | {r['once_per_round_ms']:.3f} | "
                  f"{r['speedup']:.2f}x |" for r in rows]
        Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
