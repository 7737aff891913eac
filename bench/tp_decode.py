"""Tensor parallelism on GPUs: TP=2 vs TP=1 on a Llama-3.1-8B-shaped random-weight checkpoint — greedy tokens over
N decode steps must be equal, and the bs=1 decode step time is compared (goal TP=2 <= 0.6x TP=1).

    python bench/tp_decode.py --out bench/results/tp_decode_h200x2 [--steps 64]

Workers are the engine's own (workers.worker.Worker), one process per rank, NCCL; every rank executes the same
WorkerStep, as the controller sends it. The checkpoint (HF names, bf16 safetensors) is written to --ckpt first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0)


def write_checkpoint(path: Path, layers: int) -> None:
    """Random bf16 weights under HF Llama names, one shard per layer, written from the GPU."""
    from safetensors.torch import save_file

    cfg = dict(LLAMA_8B, num_hidden_layers=layers, architectures=["LlamaForCausalLM"], model_type="llama",
               torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
    path.mkdir(parents=True, exist_ok=True)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g, device="cuda") * s[-1] ** -0.5).to(torch.bfloat16).cpu()  # noqa: E731
    weight_map = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, str(path / name))
        weight_map.update({k: name for k in tensors})

    save("embed.safetensors", {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                               "lm_head.weight": rnd(v, h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        save(f"layer{i:02d}.safetensors", {
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def run_rank(rank: int, tp: int, ckpt: str, steps: int, port: int, backend: str, result_file: str,
             dtype: str = "bfloat16") -> None:
    from deployments.config import EngineConfig
    from workers.forward_batch import ForwardMode
    from workers.worker import Worker, WorkerStep

    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(rank)
    cfg = EngineConfig(model=ckpt, device="cuda", dtype=dtype, tensor_parallel_size=tp, page_size=16,
                       max_model_len=2048, kv_cache_tokens=4096, max_num_seqs=4,
                       prefill_attention_backend=backend, decode_attention_backend=backend)
    w = Worker(cfg, rank, ("127.0.0.1", port) if tp > 1 else None)
    w.allocate_kv(w.kv_capacity_pages())
    prompt = list(range(1000, 1128))
    pages = list(range(1, 1 + -(-(len(prompt) + steps + 1) // 16)))

    def step(mode, ids, seq_len, ext, updates):
        return WorkerStep(mode=mode, req_slots=[0], input_ids=ids, seq_lens=[seq_len], extend_lens=[ext],
                          page_updates=updates, temperature=[0.0], top_k=[0], top_p=[1.0], min_p=[0.0], seeds=[0],
                          counters=[0])

    res = w.execute(step(ForwardMode.EXTEND, prompt, len(prompt), len(prompt),
                         ([0] * len(pages), list(range(len(pages))), pages)))
    tokens = [res.tokens[0][0]]
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = w.execute(step(ForwardMode.DECODE, [tokens[-1]], len(prompt) + i + 1, 1, ([], [], [])))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
        tokens.append(res.tokens[0][0])
    if rank == 0:
        Path(result_file).write_text(json.dumps({"tokens": tokens, "step_ms": times}))
    w.shutdown()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/llama8b-random")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (the checkpoint is bf16)")
    ap.add_argument("--out", default="bench/results/tp_decode_h200x2")
    args = ap.parse_args()
    from bench.engine_vs_hf import commit, device_name

    if not (Path(args.ckpt) / "config.json").is_file():
        t0 = time.time()
        write_checkpoint(Path(args.ckpt), args.layers)
        print(f"checkpoint written in {time.time() - t0:.0f}s", flush=True)
    results = {}
    for tp in (1, 2):
        rf = f"/tmp/tp{tp}.json"
        port = 29600 + tp
        if tp == 1:
            run_rank(0, 1, args.ckpt, args.steps, port, args.backend, rf, args.dtype)
        else:
            mp.spawn(run_rank, args=(tp, args.ckpt, args.steps, port, args.backend, rf, args.dtype), nprocs=tp,
                     join=True)
        results[tp] = json.loads(Path(rf).read_text())
        med = sorted(results[tp]["step_ms"][8:])[len(results[tp]["step_ms"][8:]) // 2]
        print(f"TP={tp}: median decode step {med:.2f} ms", flush=True)
    med = {tp: sorted(r["step_ms"][8:])[len(r["step_ms"][8:]) // 2] for tp, r in results.items()}
    equal = results[1]["tokens"] == results[2]["tokens"]
    first_diff = next((i for i, (a, b) in enumerate(zip(results[1]["tokens"], results[2]["tokens"])) if a != b), None)
    meta = {"device": f"{torch.cuda.device_count()}x {device_name('cuda')}", "commit": commit(),
            "command": " ".join(sys.argv), "model": f"Llama-3.1-8B shape, {args.layers} layers, random bf16 weights",
            "attention_backend": args.backend, "dtype": args.dtype, "batch_size": 1, "prompt_len": 128, "steps": args.steps,
            "tp1_median_step_ms": round(med[1], 3), "tp2_median_step_ms": round(med[2], 3),
            "tp2_over_tp1": round(med[2] / med[1], 3), "greedy_tokens_equal": equal, "first_difference_at": first_diff,
            "note": "eager PyTorch (no CUDA graphs yet): both runs are bound by kernel launches as much as by HBM"}
    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    out.with_suffix(".md").write_text(
        f"# TP=2 vs TP=1 decode ({meta['device']})\n\ncommit `{meta['commit']}`, command `{meta['command']}`; "
        f"{meta['model']}, {args.dtype}, bs=1, {args.steps} greedy steps, {args.backend} attention, eager\n\n"
        "| TP=1 ms/step | TP=2 ms/step | TP=2 / TP=1 | greedy tokens equal | first difference |\n|---|---|---|---|---|\n"
        f"| {meta['tp1_median_step_ms']} | {meta['tp2_median_step_ms']} | {meta['tp2_over_tp1']} | {equal} | "
        f"{first_diff} |\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
