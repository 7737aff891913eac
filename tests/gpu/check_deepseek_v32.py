"""DeepSeek-V3.2 (sparse MLA) on the GPU path: the Triton sparse backend with CUDA graphs, without speculation and
with every drafter (MTP chain and tree, a standalone DeepSeek draft, EAGLE-3, n-gram), against the torch-native
sparse backend run eagerly, in fp32, on a tiny checkpoint whose indexer keeps 4 tokens (selection matters); then
with FP8 indexer keys and under YaRN rope scaling (no speculation, MTP chain and tree), each against torch-native
with the same setting.

    python -m tests.gpu.check_deepseek_v32 [--device cuda] [--json F]

Greedy tokens must equal the reference's (the exit status says so). ``--device cpu``: a dry run of the script
(torch-native on both sides, no graphs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from deployments.make_heads import make_head
    from deployments.make_tiny import DEEPSEEK_YARN, make_tiny
    from tests.helpers import mixed_prompts
    from workers.config import EngineConfig, SpeculativeConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp())
    target = make_tiny("deepseek_v32", base / "target", layers=2, hidden=64, vocab=512, heads=4, max_position=1024,
                       seed=3, deepseek={"index_topk": 4, "num_nextn_predict_layers": 1})
    draft = make_tiny("deepseek_v32", base / "draft", layers=1, hidden=64, vocab=512, heads=4, max_position=1024,
                      seed=7, tokenizer_from=str(target), deepseek={"index_topk": 4})
    head = make_head("eagle3", target, base / "eagle3", seed=2, draft_vocab=200)
    prompts = mixed_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cfg = dict(model=str(target), device=args.device, dtype="float32", max_model_len=512, kv_cache_tokens=8192,
               page_size=64)
    ref = Engine(EngineConfig(**cfg, prefill_attention_backend="torch_native", decode_attention_backend="torch_native",
                              disable_cuda_graph=True))
    ref_ids = [o.token_ids for o in ref.generate(prompts, params)]
    del ref
    gpu = {"prefill_attention_backend": "triton", "decode_attention_backend": "triton"} if args.device == "cuda" else {}
    cases = [("none", None),
             ("mtp chain", SpeculativeConfig(method="mtp", num_steps=3)),
             ("mtp tree", SpeculativeConfig(method="mtp", num_steps=3, topk=2, num_draft_tokens=5)),
             ("draft chain", SpeculativeConfig(method="draft", model=str(draft), num_steps=3)),
             ("draft tree", SpeculativeConfig(method="draft", model=str(draft), num_steps=3, topk=2,
                                              num_draft_tokens=5)),
             ("target as draft", SpeculativeConfig(method="draft", model=str(target), num_steps=3)),
             ("eagle3 chain", SpeculativeConfig(method="eagle3", model=str(head), num_steps=3)),
             ("ngram", SpeculativeConfig(method="ngram", num_steps=3))]
    rows, ok = [], True
    for name, spec in cases:
        eng = Engine(EngineConfig(**cfg, **gpu, speculative_config=spec))
        out = eng.generate(prompts, params)
        worker = eng.executor.worker
        same = sum(o.token_ids == r for o, r in zip(out, ref_ids))
        acc = [o.spec["accept_length"] for o in out] if spec is not None else []
        row = {"case": name, "equal": f"{same}/{len(prompts)}", "graph_refusal": worker.graph_refusal,
               "replays": worker.graphs.num_replays if worker.graphs is not None else 0,
               "accept_length": round(sum(acc) / len(acc), 3) if acc else None}
        rows.append(row)
        ok &= same == len(prompts)
        print(json.dumps(row), flush=True)
        del eng
    # FP8 indexer keys (each side quantizes the same keys; the Triton indexer scales q.k8, the reference dequantizes
    # k8 first) and YaRN rope scaling (the released checkpoints'), each against its own torch-native eager reference
    yarn = make_tiny("deepseek_v32", base / "yarn", layers=2, hidden=64, vocab=512, heads=4, max_position=1024,
                     seed=3, rope_scaling=dict(DEEPSEEK_YARN), deepseek={"index_topk": 4, "num_nextn_predict_layers": 1})
    variants = [("fp8 keys", {"indexer_key_dtype": "fp8"}), ("yarn", {"model": str(yarn)})]
    for variant, kw in variants:
        vcfg = {**cfg, **kw}
        ref = Engine(EngineConfig(**vcfg, prefill_attention_backend="torch_native",
                                  decode_attention_backend="torch_native", disable_cuda_graph=True))
        want = [o.token_ids for o in ref.generate(prompts, params)]
        del ref
        for name, spec in cases[:3]:  # none, mtp chain, mtp tree
            eng = Engine(EngineConfig(**vcfg, **gpu, speculative_config=spec))
            out = eng.generate(prompts, params)
            same = sum(o.token_ids == r for o, r in zip(out, want))
            row = {"case": f"{variant}: {name}", "equal": f"{same}/{len(prompts)}",
                   "replays": eng.executor.worker.graphs.num_replays if eng.executor.worker.graphs is not None else 0}
            rows.append(row)
            ok &= same == len(prompts)
            print(json.dumps(row), flush=True)
            del eng
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
