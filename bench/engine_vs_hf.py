"""Engine-only decode throughput vs HF transformers `generate` on the same checkpoint (same process, same weights).

    python3 -m bench.engine_vs_hf --out bench/results/decode/cpu_engine_vs_hf \\
        [--model DIR | --arch llama --hidden 256 ...]

Writes <out>.json, <out>.md and <out>.png, each stamped with device, commit and command.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import command, commit, device_name, out_path, pyplot, write_json, write_markdown


def run_engine(model: str, device: str, prompts: list[list[int]], new_tokens: int, dtype: str, **engine_kw) -> float:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    engine = Engine(EngineConfig(model=model, device=device, dtype=dtype, max_num_seqs=max(64, len(prompts)),
                                 **engine_kw))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == new_tokens for o in out)
    return len(prompts) * new_tokens / dt


def run_hf(model: str, device: str, prompts: list[list[int]], new_tokens: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF batching needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    with torch.no_grad():
        m.generate(ids[:1], attention_mask=mask[:1], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(ids, attention_mask=mask, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return len(prompts) * new_tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/decode/cpu_engine_vs_hf")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = args.model
    if model is None:
        from deployments.make_tiny import make_tiny

        model = str(make_tiny(args.arch, Path(tempfile.mkdtemp()) / "model", layers=args.layers, hidden=args.hidden,
                              vocab=args.vocab, heads=max(4, args.hidden // 64), kv_heads=max(2, args.hidden // 256),
                              max_position=4096))
    rows = []
    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [torch.randint(10, args.vocab - 10, (args.prompt_len,)).tolist() for _ in range(bs)]
        ours = run_engine(model, args.device, prompts, args.new_tokens, args.dtype)
        hf = run_hf(model, args.device, prompts, args.new_tokens, args.dtype)
        rows.append({"batch_size": bs, "specserve_tok_s": round(ours, 1), "hf_generate_tok_s": round(hf, 1),
                     "speedup": round(ours / hf, 2)})
        print(rows[-1], flush=True)
    meta = {"device": device_name(args.device), "commit": commit(), "command": command(),
            "model": model if args.model else f"make_tiny {args.arch} layers={args.layers} hidden={args.hidden} "
                                              f"vocab={args.vocab}",
            "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": rows}
    out = out_path(args.out)
    write_json(out, meta)
    md = [f"# Engine vs HF generate ({meta['device']})", "",
          f"commit `{meta['commit']}`, command `{meta['command']}`, model {meta['model']}, {args.dtype}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy", "",
          "| batch | specserve tok/s | HF generate tok/s | ratio |", "|---|---|---|---|"]
    md += [f"| {r['batch_size']} | {r['specserve_tok_s']} | {r['hf_generate_tok_s']} | {r['speedup']}x |" for r in rows]
    write_markdown(out, md)
    try:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["specserve_tok_s"] for r in rows], 0.4, label="specserve")
        ax.bar([x + 0.2 for x in xs], [r["hf_generate_tok_s"] for r in rows], 0.4, label="HF generate")
        ax.set_xticks(list(xs), [f"bs={r['batch_size']}" for r in rows])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{meta['device']}\n{meta['commit']}", fontsize=8)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG (pip install 'specserve[bench]')")


if __name__ == "__main__":
    main()
