"""Tensor parallelism on GPUs: TP=2 vs TP=1 on a Llama-3.1-8B-shaped random-weight checkpoint — greedy tokens over
N decode steps must be equal, and the bs=1 decode step time is compared (goal TP=2 <= 0.6x TP=1).

    python3 -m bench.tp_decode --out bench/results/tensor_parallel/tp_decode_h200x2 [--steps 64]

Workers are the engine's own (workers.worker.Worker), one process per rank, NCCL; every rank executes the same
WorkerStep, as the controller sends it. The checkpoint (HF names, bf16 safetensors) is written to --ckpt first.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.common import (command, commit, describe_checkpoint, device_name, out_path, write_checkpoint, write_json,
                          write_markdown)


def run_rank(rank: int, tp: int, ckpt: str, steps: int, port: int, backend: str, result_file: str,
             dtype: str = "bfloat16", cuda_graph: bool = True, custom_all_reduce: bool = True,
             profile_file: str | None = None, isolated: bool = False) -> None:
    from workers.config import EngineConfig
    from workers.messages import ForwardMode, WorkerStep
    from workers.worker import Worker

    if os.environ.get("SPECSERVE_HANG_DUMP_S"):  # diagnose a hang: every rank prints its Python stack, then exits
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["SPECSERVE_HANG_DUMP_S"]), exit=True)
    import logging

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"rank {rank} %(name)s: %(message)s")
    if isolated:  # as under Ray: this rank sees only its own GPU; the Worker widens the visibility itself
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    else:
        os.environ["LOCAL_RANK"] = str(rank)
        torch.cuda.set_device(rank)
    cfg = EngineConfig(model=ckpt, device="cuda", dtype=dtype, tensor_parallel_size=tp, page_size=16,
                       max_model_len=2048, kv_cache_tokens=4096, max_num_seqs=4,
                       prefill_attention_backend=backend, decode_attention_backend=backend,
                       disable_cuda_graph=not cuda_graph, disable_custom_all_reduce=not custom_all_reduce)
    w = Worker(cfg, rank, ("127.0.0.1", port) if tp > 1 else None)
    w.allocate_kv(w.kv_capacity_pages())
    prompt = list(range(1000, 1128))
    pages = list(range(1, 1 + -(-(len(prompt) + 2 * steps + 16) // 16)))

    def step(mode, ids, seq_len, ext, updates):
        return WorkerStep.pack(mode, req_slots=[0], input_ids=ids, seq_lens=[seq_len], extend_lens=[ext],
                              page_updates=updates, temperature=[0.0], top_k=[0], top_p=[1.0], min_p=[0.0], seeds=[0],
                              counters=[0])

    res = w.execute(step(ForwardMode.EXTEND, prompt, len(prompt), len(prompt),
                         ([0] * len(pages), list(range(len(pages))), pages)))
    tokens = [res.tokens[0]]
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = w.execute(step(ForwardMode.DECODE, [], len(prompt) + i + 1, 1, ([], [], [])))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
        tokens.append(res.tokens[0])
    # as the engine runs by default: each step launched before the previous one's token is read (overlap)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps, 2 * steps):
        for res in w.step(step(ForwardMode.DECODE, [], len(prompt) + i + 1, 1, ([], [], [])), keep=1):
            tokens.append(res.tokens[0])
    tokens += [res.tokens[0] for res in w.step(None, keep=0)]
    overlapped_ms = (time.perf_counter() - t0) * 1000 / steps
    if rank == 0:
        Path(result_file).write_text(json.dumps({"tokens": tokens, "step_ms": times, "overlapped_step_ms": overlapped_ms,
                                                 "custom_all_reduce": w.tp.custom_all_reduce is not None,
                                                 "norms_in_linears": {str(b): f
                                                                      for b, f in sorted(w.graphs.norm_fusion.items())},
                                                 "norms_folded": w.target.model.norms_folded}))
    if profile_file:  # GPU time per kernel over 8 more steps (kernels replayed from graphs included), rank 0's table
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(2 * steps, 2 * steps + 8):
                w.execute(step(ForwardMode.DECODE, [], len(prompt) + i + 1, 1, ([], [], [])))
            torch.cuda.synchronize()
        if rank == 0:
            Path(profile_file).write_text(prof.key_averages().table(sort_by="device_time_total", row_limit=30))
    w.shutdown()


def markdown(meta: dict) -> str:
    """The result table (``python3 -m bench.tp_decode --markdown RESULT.json`` rewrites it from a JSON)."""
    text = (f"# TP=2 vs TP=1 decode ({meta['device']})\n\ncommit `{meta['commit']}`, command `{meta['command']}`; "
            f"{meta['model']}, {meta['dtype']}, bs=1, {meta['steps']} greedy steps, {meta['attention_backend']} "
            f"attention, {'CUDA graphs' if meta['cuda_graphs'] else 'eager'}\n\n"
            "| TP=1 ms/step | TP=2 ms/step | TP=2 / TP=1 | TP=2, NCCL only | NCCL only / TP=1 | greedy tokens equal | "
            "first difference |\n|---|---|---|---|---|---|---|\n"
            f"| {meta['tp1_median_step_ms']} | {meta['tp2_median_step_ms']} | {meta['tp2_over_tp1']} | "
            f"{meta.get('tp2_nccl_only_median_step_ms', '-')} | {meta.get('tp2_nccl_only_over_tp1', '-')} | "
            f"{meta['greedy_tokens_equal']} | {meta['first_difference_at']} |\n\n"
            "Step time above: each step launched, then its token read. Overlapped (launched before the previous "
            "step's token is read, as the engine runs), ms per step: "
            + ", ".join(f"{k} {v}" for k, v in meta.get("overlapped_step_ms", {}).items())
            + (f"; TP=2 / TP=1 {meta['overlapped_tp2_over_tp1']}.\n\n" if "overlapped_tp2_over_tp1" in meta
               else ".\n\n")
            +
            f"TP=2 used the one-shot custom all-reduce: {meta['tp2_custom_all_reduce']}.\n")
    if "norms" in meta:
        text += "\nNorm weights folded / norms inside the linears by batch bucket: " + "; ".join(
            f"{k} {v['folded']} / {v['inside_linears_by_bucket']}" for k, v in meta["norms"].items()) + ".\n"
    if "tp2_isolated_median_step_ms" in meta:
        text += (f"\nTP=2 with each rank started seeing only its own GPU (as under Ray): "
                 f"{meta['tp2_isolated_median_step_ms']} ms/step, custom all-reduce: "
                 f"{meta['tp2_isolated_custom_all_reduce']}.\n")
    return text


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/llama8b-random")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (the checkpoint is bf16)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--variants", default="tp1,tp2_nccl,tp2",
                    help="tp1: one GPU; tp2: two, one-shot custom all-reduce for small tensors; tp2_nccl: NCCL only; "
                    "tp2_isolated: as tp2, each rank started seeing only its own GPU (as under Ray)")
    ap.add_argument("--profile", action="store_true", help="also write each variant's kernel table (.prof_*.txt)")
    ap.add_argument("--out", default="bench/results/tensor_parallel/tp_decode_h200x2")
    ap.add_argument("--markdown", default=None, help="only rewrite the table of this result JSON next to it")
    args = ap.parse_args()
    if args.markdown:
        Path(args.markdown).with_suffix(".md").write_text(markdown(json.loads(Path(args.markdown).read_text())))
        return
    if not (Path(args.ckpt) / "config.json").is_file():
        t0 = time.time()
        write_checkpoint(Path(args.ckpt), "llama-3.1-8b", args.layers)
        print(f"checkpoint written in {time.time() - t0:.0f}s", flush=True)
    out = out_path(args.out)
    # TP=1; TP=2 with every all-reduce on NCCL; TP=2 with the one-shot custom all-reduce for small tensors
    variants = {"tp1": (1, True, False), "tp2_nccl": (2, False, False), "tp2": (2, True, False),
                "tp2_isolated": (2, True, True)}
    variants = {name: variants[name] for name in args.variants.split(",")}
    if not {"tp1", "tp2"} <= variants.keys():
        raise SystemExit("--variants must include tp1 and tp2")
    results = {}
    for port, (name, (tp, custom, isolated)) in enumerate(variants.items(), start=29601):
        rf = f"/tmp/{name}.json"
        prof = str(out.with_suffix(f".prof_{name}.txt")) if args.profile else None
        run_args = (tp, args.ckpt, args.steps, port, args.backend, rf, args.dtype, not args.eager, custom, prof,
                    isolated)
        if tp == 1:
            run_rank(0, *run_args)
        else:
            mp.spawn(run_rank, args=run_args, nprocs=tp, join=True)
        results[name] = json.loads(Path(rf).read_text())
        times = results[name]["step_ms"][8:]
        print(f"{name}: median decode step {sorted(times)[len(times) // 2]:.2f} ms", flush=True)
        out.with_suffix(".partial.json").write_text(json.dumps(results))  # kept if a later variant is cut off
    med = {name: sorted(r["step_ms"][8:])[len(r["step_ms"][8:]) // 2] for name, r in results.items()}
    equal = results["tp1"]["tokens"] == results["tp2"]["tokens"]
    first_diff = next((i for i, (a, b) in enumerate(zip(results["tp1"]["tokens"], results["tp2"]["tokens"]))
                       if a != b), None)
    meta = {"device": f"{torch.cuda.device_count()}x {device_name('cuda')}", "commit": commit(),
            "command": command(), "model": describe_checkpoint(args.ckpt),
            "attention_backend": args.backend, "dtype": args.dtype, "batch_size": 1, "prompt_len": 128, "steps": args.steps,
            "tp1_median_step_ms": round(med["tp1"], 3), "tp2_median_step_ms": round(med["tp2"], 3),
            "tp2_over_tp1": round(med["tp2"] / med["tp1"], 3),
            "overlapped_step_ms": {name: round(r["overlapped_step_ms"], 3) for name, r in results.items()},
            "overlapped_tp2_over_tp1": round(results["tp2"]["overlapped_step_ms"]
                                             / results["tp1"]["overlapped_step_ms"], 3),
            "tp2_custom_all_reduce": results["tp2"]["custom_all_reduce"],
            # per variant: whether the norm weights were folded, and each batch bucket's choice of the norms inside
            # the linears (DecodeGraphs._capture_faster_fusion; empty: no bucket timed them, the fused forward where folded)
            "norms": {name: {"folded": r.get("norms_folded"), "inside_linears_by_bucket": r.get("norms_in_linears")}
                      for name, r in results.items()},
            "greedy_tokens_equal": equal, "first_difference_at": first_diff, "cuda_graphs": not args.eager}
    if "tp2_isolated" in results:
        r = results["tp2_isolated"]
        meta.update(tp2_isolated_median_step_ms=round(med["tp2_isolated"], 3),
                    tp2_isolated_custom_all_reduce=r["custom_all_reduce"],
                    tp2_isolated_tokens_equal_tp2=r["tokens"] == results["tp2"]["tokens"])
    if "tp2_nccl" in results:
        meta.update(tp2_nccl_only_median_step_ms=round(med["tp2_nccl"], 3),
                    tp2_nccl_only_over_tp1=round(med["tp2_nccl"] / med["tp1"], 3),
                    tp2_nccl_only_tokens_equal_tp2=results["tp2_nccl"]["tokens"] == results["tp2"]["tokens"])
    write_json(out, meta)
    out.with_suffix(".partial.json").unlink()
    write_markdown(out, markdown(meta))
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
