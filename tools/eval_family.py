"""Acceptance and speed of the trained family on held-out Python (the installed `pip` package's sources, never in
training data): our engine (no speculation, EAGLE-3, standalone draft, n-gram; greedy) beside HF transformers
(`generate` and assisted generation with the same draft).

    python3 -m tools.eval_family --models models --out bench/results/family/family_cpu [--device cpu] [--prompts 8]

Accept length = 1 + accepted / rounds from the engine's own per-request metrics. HF assisted generation exposes no
counter, so its accept length is new tokens / target forward passes (counted with a hook).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import (
    command,
    commit,
    device_name,
    held_out_package,
    held_out_prompts,
    out_path,
    write_json,
    write_markdown,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-steps", type=int, default=4)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--out", default="bench/results/family/family_cpu")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig, SpeculativeConfig

    m = Path(args.models)
    target, draft, eagle = m / "specserve-tiny", m / "specserve-tiny-draft", m / "specserve-tiny-eagle3"
    tok = AutoTokenizer.from_pretrained(target)
    prompts = held_out_prompts(tok, args.prompts, args.prompt_len)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows, reference, eng = [], None, None
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    for name, spec in [("none", None),
                       ("eagle3", SpeculativeConfig(method="eagle3", model=str(eagle), num_steps=args.num_steps,
                                                         adaptive=False)),
                       ("draft", SpeculativeConfig(method="draft", model=str(draft), num_steps=args.num_steps,
                                                       adaptive=False)),
                       ("ngram", SpeculativeConfig(method="ngram", num_steps=args.num_steps, adaptive=False))]:
        del eng  # free the previous engine's KV cache first
        if args.device == "cuda":
            torch.cuda.empty_cache()
        eng = Engine(EngineConfig(model=str(target), device=args.device, dtype=dtype, max_model_len=1024,
                                  kv_cache_tokens=32768, speculative_config=spec))
        eng.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        outs = [eng.generate([p], params)[0] for p in prompts]  # bs=1, one after another
        dt = time.perf_counter() - t0
        toks = [o.token_ids for o in outs]
        if reference is None:
            reference = toks
        drafts = sum(o.spec["num_drafts"] for o in outs) if spec else 0
        acc = sum(o.spec["num_accepted_tokens"] for o in outs) if spec else 0
        rows.append({"system": "specserve", "method": name, "accept_length": round(1 + acc / drafts, 3) if drafts else None,
                     "tokens_per_s": round(len(prompts) * args.new_tokens / dt, 1),
                     "greedy_equal_to_no_spec": toks == reference})
        print(rows[-1], flush=True)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    hf_t = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype).to(args.device).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(draft, dtype=torch_dtype).to(args.device).eval()
    calls = {"n": 0}
    hf_t.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    for name, extra in [("none", {}), ("assisted-draft", {"assistant_model": hf_d})]:
        if extra:
            hf_d.generation_config.num_assistant_tokens = args.num_steps
            hf_d.generation_config.num_assistant_tokens_schedule = "constant"
            hf_d.generation_config.assistant_confidence_threshold = 0.0
        calls["n"], new, t0 = 0, 0, time.perf_counter()
        same = True
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=args.device)
            with torch.no_grad():
                o = hf_t.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.eos_token_id,
                                  **extra)
            gen = o[0, len(p):].tolist()
            new += len(gen)
            same &= gen == reference[i]
        dt = time.perf_counter() - t0
        rows.append({"system": "hf-transformers", "method": name,
                     "accept_length": round(new / calls["n"], 3) if extra else None,
                     "tokens_per_s": round(new / dt, 1), "greedy_equal_to_no_spec": same})
        print(rows[-1], flush=True)
    meta = {"device": device_name(args.device), "commit": commit(), "command": command(),
            "held_out": f"first {len(prompts)} {held_out_package()} source files with >= {args.prompt_len + 64} tokens",
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "num_steps": args.num_steps,
            "batch_size": 1, "dtype": dtype, "rows": rows}
    out = out_path(args.out)
    write_json(out, meta)
    md = [f"# Trained tiny family on held-out code ({meta['device']})", "",
          f"commit `{meta['commit']}`, command `{meta['command']}`; {meta['held_out']}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy, bs=1, {dtype}, chain of {args.num_steps} drafts", "",
          "| system | method | accept length | tokens/s | greedy == no-spec |", "|---|---|---|---|---|"]
    md += [f"| {r['system']} | {r['method']} | {r['accept_length'] or '-'} | {r['tokens_per_s']} | "
           f"{r['greedy_equal_to_no_spec']} |" for r in rows]
    write_markdown(out, md)


if __name__ == "__main__":
    main()
