"""The sparse_flashinfer backend (``attention.sparse_flashinfer``) on a GPU with FlashInfer, bf16.

1. Its MLA over full selections (DeepSeek-V3.2's attention shape: 128 heads, latent 512 + rope 64, top-k 2048;
   pages of one token, planned once per row count) against the fp32 reference, on one plan with two different
   selections in turn (the plan reads the selection from its buffer at each run), with padding rows that select
   nothing (-1, read as slot 0), and a CUDA-graph replay equal to the eager run.
2. The engine on a tiny DeepSeek-V3.2 with the real MLA widths (16 heads, top-k 64), with CUDA graphs: decode
   backend ``flashinfer`` against ``triton``, no speculation and MTP chain / tree, on prompts whose contexts
   start under and grow past the long-rows bound: the long-rows graphs must replay, and the greedy tokens and
   their logprobs agree within bf16's rounding (kernels that sum in another order may part at a near tie: the
   tokens are compared up to each request's first difference, which is reported).

    python -m tests.gpu.check_sparse_flashinfer [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


def kernel_check() -> dict:
    from attention.sparse_flashinfer import SparseFlashInferBackend
    from attention.sparse_torch_native import SparseMLALayerSpec
    from workers.kernels.sparse_mla import sparse_mla_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, heads, topk, slots_n = 40, 128, 2048, 70_000
    spec = SparseMLALayerSpec(0, heads, 512, 64, 64, 128, topk, 576 ** -0.5)
    backend = SparseFlashInferBackend()
    wrapper, indices = backend.plan(rows, spec, torch.device("cuda"))
    cache = torch.randn(slots_n, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    ql = torch.randn(rows, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    qr = torch.randn(rows, heads, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    out = {}
    for trial in range(2):  # two selections on the same plan
        sel = torch.stack([torch.randperm(slots_n, device="cuda", generator=g)[:topk] for _ in range(rows)])
        sel = sel.to(torch.int32)
        sel[-3:] = -1  # padding rows (a graph's): nothing selected
        indices.copy_(sel)
        got = backend.attend(wrapper, indices, ql, qr, cache)
        ref = sparse_mla_reference(ql.float(), qr.float(), cache.float(), sel, spec.scaling)
        real = slice(0, rows - 3)
        out[f"selection {trial}: max abs diff vs fp32 reference"] = float((got[real].float() - ref[real]).abs().max())
        out[f"selection {trial}: reference max abs"] = float(ref[real].abs().max())
        out[f"selection {trial}: padding rows finite"] = bool(torch.isfinite(got[rows - 3:].float()).all())
    eager = backend.attend(wrapper, indices, ql, qr, cache).clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        backend.attend(wrapper, indices, ql, qr, cache)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        res = backend.attend(wrapper, indices, ql, qr, cache)
    graph.replay()
    torch.cuda.synchronize()
    out["graph replay equal to eager"] = bool(torch.equal(res, eager))
    out["ok"] = (all(v < 0.02 for k, v in out.items() if "diff" in k) and out["graph replay equal to eager"]
                 and all(v for k, v in out.items() if "finite" in k))
    return out


def engine_check(base: Path) -> tuple[list[dict], bool]:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from deployments.make_tiny import make_tiny
    from workers.config import EngineConfig, SpeculativeConfig

    target = make_tiny("deepseek_v32", base / "target", layers=2, hidden=256, vocab=512, heads=16,
                       max_position=2048, seed=3, dtype="bfloat16",
                       deepseek={"index_topk": 64, "num_nextn_predict_layers": 1, "kv_lora_rank": 512,
                                 "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
                                 "index_head_dim": 64, "q_lora_rank": 64})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (60, 100, 140, 200, 300, 90, 120, 250)]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, logprobs=True)
    cfg = dict(model=str(target), device="cuda", dtype="bfloat16", max_model_len=1024, kv_cache_tokens=16384,
               page_size=64, prefill_attention_backend="triton", cuda_graph_max_bs=8)
    rows, ok = [], True
    for name, spec in [("none", None), ("mtp chain", SpeculativeConfig(method="mtp", num_steps=3)),
                       ("mtp tree", SpeculativeConfig(method="mtp", num_steps=3, topk=2, num_draft_tokens=5))]:
        runs = {}
        for backend in ("triton", "flashinfer"):
            eng = Engine(EngineConfig(**cfg, decode_attention_backend=backend, speculative_config=spec))
            out = eng.generate(prompts, params)
            graphs = eng.executor.worker.graphs
            runs[backend] = (out, graphs.num_replays, graphs.long_replays, eng.executor.worker.graph_refusal)
            del eng
        (ref, *_), (got, replays, long_replays, refusal) = runs["triton"], runs["flashinfer"]
        agree, total, worst, equal = 0, 0, 0.0, 0
        for a, b in zip(ref, got):
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            agree, total, equal = agree + n, total + len(a.token_ids), equal + (n == len(a.token_ids))
            if n:
                worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])))
        row = {"case": name, "requests equal": f"{equal}/{len(prompts)}",
               "tokens before the first difference": f"{agree}/{total}",
               "max logprob diff there": round(worst, 4), "replays": replays, "long-rows replays": long_replays,
               "graph_refusal": refusal}
        good = refusal is None and long_replays > 0 and agree >= 0.9 * total and worst < 0.1
        row["ok"] = good
        ok &= good
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernel = kernel_check()
    print(json.dumps(kernel), flush=True)
    rows, ok = engine_check(Path(tempfile.mkdtemp()))
    ok &= kernel["ok"]
    if args.json:
        Path(args.json).write_text(json.dumps({"kernel": kernel, "engine": rows}, indent=2))
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
