"""The served TP path on GPUs: an Engine over Ray worker actors (placement group, compiled graph, NCCL, custom
all-reduce with widened GPU visibility) at tensor_parallel_size N, with and without speculative decoding, against the
in-process TP=1 engine without speculation on the same checkpoint: greedy tokens, accept length, and decode ms per
token (steps after the first token, overlap schedule on, the start-up heap frozen out of the garbage collector as
the serving controller's is).

Speculative modes (``--spec``, comma-separated): ``none``; ``draft`` / ``draft-tp1`` (the target itself as the
standalone draft, sharded over the TP ranks / replicated on each: every draft is accepted unless TP's rounding parts
the two, so the accept path runs at full length); ``eagle3-tree`` (a random EAGLE-3 head, a tree of 3 steps x topk 2:
almost every draft is rejected, so the reject path runs); ``eagle3-chain`` / ``eagle3-1step`` (the same head, a chain of
3 / 1 steps, the round in one graph). In fp32 every mode's tokens must equal the TP=1 reference's. With
``--simulated-accept-length`` the chains accept that many tokens per round on average whatever the drafts (a speed
benchmark of speculation under TP; ``--tp1-spec`` runs the same modes at TP=1 for the ratio).

    python -m tests.gpu.check_ray_tp --ckpt /tmp/llama8b-random --tp 2 --json OUT.json
    python -m tests.gpu.check_ray_tp --ckpt /tmp/l1 --tp 2 --dtype float32 --spec none,draft,eagle3-tree --json OUT.json
    python -m tests.gpu.check_ray_tp --ckpt /tmp/l8 --spec none,eagle3-chain --simulated-accept-length 3 --tp1-spec \
        --json OUT.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

SPEC_MODES = ("none", "draft", "draft-tp1", "eagle3-tree", "eagle3-chain", "eagle3-1step")


def spec_config(mode: str, ckpt: str, head: str | None, tp: int,
                simulated: float | None = None) -> tuple[dict | None, bool]:
    """(speculative_config, fuse_speculative_round) of a ``--spec`` mode; ``simulated``: the chains' forced mean
    accept length (a benchmark: the tokens are then the drafts forced through, not the model's)."""
    if mode == "none":
        return None, True
    if mode in ("draft", "draft-tp1"):
        spec, fuse = {"method": "draft", "model": ckpt, "num_steps": 3,
                      "draft_tensor_parallel_size": tp if mode == "draft" else 1}, True
    elif mode == "eagle3-tree":
        if simulated is not None:
            raise ValueError("simulated acceptance works on chains; drop eagle3-tree or --simulated-accept-length")
        return {"method": "eagle3", "model": head, "num_steps": 3, "topk": 2, "num_draft_tokens": 6}, False
    elif mode == "eagle3-chain":
        spec, fuse = {"method": "eagle3", "model": head, "num_steps": 3}, True
    elif mode == "eagle3-1step":
        spec, fuse = {"method": "eagle3", "model": head, "num_steps": 1}, True
    else:
        raise ValueError(f"unknown --spec mode {mode!r}; one of {', '.join(SPEC_MODES)}")
    if simulated is not None:
        spec["simulated_accept_length"] = simulated
    return spec, fuse


def run(ckpt: str, tp: int, new_tokens: int, backend: str, dtype: str, spec: dict | None = None,
        fuse_round: bool = True, device: str = "cuda") -> dict:
    from deployments.cli import build_engine
    from deployments.engine.engine import freeze_startup_heap
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    cfg = EngineConfig(model=ckpt, device=device, dtype=dtype, tensor_parallel_size=tp, max_model_len=2048,
                       max_num_seqs=8, kv_cache_tokens=16384, prefill_attention_backend=backend,
                       decode_attention_backend=backend, speculative_config=spec, fuse_speculative_round=fuse_round)
    t0 = time.perf_counter()
    eng = build_engine(cfg)
    start_s = time.perf_counter() - t0
    freeze_startup_heap()  # as the serving controller does: no full collection scans the start-up heap mid-decode
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
        result = {"tokens": list(req.output_ids), "error": req.error, "start_s": round(start_s, 1)}
        if spec is not None:
            result["accept_length"] = round(req.spec.accept_length, 3)
        if first is not None and len(req.output_ids) > first[1]:
            result["decode_ms_per_token"] = round((end - first[0]) / (len(req.output_ids) - first[1]) * 1e3, 3)
        return result
    finally:
        eng.shutdown()
        del eng
        gc.unfreeze()  # the dropped engine's objects go back to the collector
        # ... and are collected now: the engine sits in reference cycles, and an in-process one holds the GPU's
        # weights, KV cache and graphs (``torch.cuda.empty_cache`` releases only blocks nothing holds)
        gc.collect()


def save_partial(path: str, runs: dict) -> None:
    """Each run as it ends, with its first token differing from the TP=1 reference's where that has run (a call cut
    short keeps what it measured)."""
    ref = runs.get((1, "none"))
    rows = {}
    for (tp, mode), r in runs.items():
        rows[f"tp{tp}_{mode}"] = row = {k: v for k, v in r.items() if k != "tokens"}
        if ref is not None:
            row["first_difference_from_tp1"] = first_difference(ref["tokens"], r["tokens"])
    Path(path).with_suffix(".partial.json").write_text(json.dumps(rows, indent=2))


def report(result: dict, out: Path) -> None:
    """``out``.md (one row per run) and ``out``.png (decode ms per token per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.compare_runs import bar_plot

    sim = result.get("simulated_accept_length")
    lines = [f"# Ray TP path, {result['dtype']}" + (f", simulated accept length {sim}" if sim else ""), "",
             f"device: {result['device']}; commit: {result['commit']}; `{result['command']}`", "",
             "| run | accept length | decode ms/token | vs TP=1 no-spec | vs same-TP no-spec | tokens vs TP=1 |",
             "|---|---|---|---|---|---|"]
    rows = []
    for name, r in result["runs"].items():
        tp = name.split("_")[1]
        diff = r.get("first_difference_from_tp1", "n/a")
        tokens = "equal" if diff is None else "n/a (forced drafts)" if diff == "n/a" else f"differ at {diff}"
        lines.append(f"| {name} | {r.get('accept_length', '-')} | {r.get('decode_ms_per_token', '-')} | "
                     f"{r.get('ms_over_tp1_nospec', '-')} | {r.get(f'ms_over_{tp}_nospec', '-')} | {tokens} |")
        if "decode_ms_per_token" in r:
            rows.append({"label": name, "ms": r["decode_ms_per_token"]})
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    tp1 = (result["runs"].get("local_tp1_none") or result.get("local_tp1") or {}).get("decode_ms_per_token")
    bar_plot(out, plt, rows, "ms", "decode ms per token", f"{result['device']}: Ray TP path, bs=1",
             [(tp1, dict(color="k", ls="--"), f"TP=1 no-spec {tp1} ms")] if tp1 else [], None)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--spec", default="none", help=f"comma-separated, of: {', '.join(SPEC_MODES)}")
    ap.add_argument("--simulated-accept-length", type=float, help="BENCHMARK: force this mean accept length on the "
                    "chain modes (their tokens are then not compared)")
    ap.add_argument("--tp1-spec", action="store_true", help="also run the speculative modes in-process at TP=1")
    ap.add_argument("--head", help="EAGLE-3 head for the eagle3 modes (default: a random one, in a temporary folder)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the same over gloo (a dry run)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--report", action="store_true", help="only rewrite the .md and .png of the --json result")
    args = ap.parse_args()
    if args.report:
        report(json.loads(Path(args.json).read_text()), Path(args.json))
        return
    import ray
    import torch

    from bench.common import commit, device_name

    modes = args.spec.split(",")
    head = args.head
    made_head = head is None and any(m.startswith("eagle3") for m in modes)
    if made_head:
        from deployments.make_heads import make_head

        vocab = json.loads((Path(args.ckpt) / "config.json").read_text())["vocab_size"]
        head = str(make_head("eagle3", args.ckpt, Path(tempfile.mkdtemp(prefix="eagle3_head_")), seed=5,
                             draft_vocab=min(32000, vocab)))
    simulated = args.simulated_accept_length
    configs = {mode: spec_config(mode, args.ckpt, head, args.tp, simulated) for mode in modes}
    device = f"{torch.cuda.device_count()}x {device_name('cuda')}" if args.device == "cuda" else "cpu"
    result = {"device": device, "commit": commit(), "command": " ".join(sys.argv), "checkpoint": args.ckpt,
              "dtype": args.dtype, "simulated_accept_length": simulated, "runs": {}}
    runs = {}  # (TP size, mode) -> run
    # the TP=1 reference first, so that each TP run's comparison is saved as it ends (a call cut short keeps it);
    # the in-process engine's memory goes back before the worker actors take the GPUs
    local_modes = ["none"] + [m for m in modes if args.tp1_spec and m not in ("none", "draft-tp1")]
    for mode in local_modes:
        print(f"== local tp1 {mode}", flush=True)
        spec, fuse_round = spec_config(mode, args.ckpt, head, 1, simulated)
        runs[1, mode] = run(args.ckpt, 1, args.new_tokens, args.backend, args.dtype, spec, fuse_round, args.device)
        save_partial(args.json, runs)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    for mode, (spec, fuse_round) in configs.items():
        print(f"== ray tp{args.tp} {mode}", flush=True)
        runs[args.tp, mode] = run(args.ckpt, args.tp, args.new_tokens, args.backend, args.dtype, spec, fuse_round,
                                  args.device)
        save_partial(args.json, runs)
    ray.shutdown()
    if made_head:
        shutil.rmtree(head)
    reference = runs[1, "none"]
    failed = False
    for (tp, mode), r in runs.items():
        row = {k: v for k, v in r.items() if k != "tokens"}
        if simulated is None or mode == "none":  # forced drafts are not the model's tokens
            row["first_difference_from_tp1"] = first_difference(reference["tokens"], r["tokens"])
            if args.dtype == "float32":
                failed |= row["first_difference_from_tp1"] is not None
        for base_tp in sorted({1, tp}):
            base = runs.get((base_tp, "none"))
            if base is not None and "decode_ms_per_token" in r and "decode_ms_per_token" in base:
                row[f"ms_over_tp{base_tp}_nospec"] = round(r["decode_ms_per_token"] / base["decode_ms_per_token"], 3)
        result["runs"][f"{'ray' if tp > 1 else 'local'}_tp{tp}_{mode}"] = row
        failed |= bool(r["error"]) or len(r["tokens"]) != args.new_tokens
    result["num_tokens"] = args.new_tokens
    result["ok"] = not failed
    Path(args.json).write_text(json.dumps(result, indent=2))
    report(result, Path(args.json))
    print(json.dumps(result, indent=2))
    if failed:
        sys.exit(1)

if __name__ == "__main__":
    main()
