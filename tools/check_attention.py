"""Attention backends against the torch-native fp32 reference, on random paged KV, for every forward mode.

    python tools/check_attention.py --device cuda --backends triton [--dtype bfloat16] [--json out.json]
    TRITON_INTERPRET=1 python tools/check_attention.py --device cpu --backends triton --small   # CPU, interpreter

Cases: EXTEND (with a cached prefix, chunked), DRAFT_EXTEND, DECODE, TARGET_VERIFY (chain and tree, decode- and
prefill-style kernels), and a multi-step draft step (queries against a scratch block). Page sizes 1 and 16, GQA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention.base import AttentionLayerSpec  # noqa: E402
from attention.registry import _make  # noqa: E402
from speculative.tree import ancestor_mask  # noqa: E402
from workers.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from workers.kv_cache import KVCache, PageTable  # noqa: E402


def random_tree_parents(b: int, d: int, g: torch.Generator) -> torch.Tensor:
    parents = torch.full((b, d), -1, dtype=torch.int64)
    for i in range(1, d):
        parents[:, i] = torch.randint(0, i, (b,), generator=g)
    return parents


def make_case(mode: str, page_size: int, seq_lens: list[int], n_new: list[int], heads: int, kv_heads: int, dim: int,
              device, dtype, g: torch.Generator):
    b = len(seq_lens)
    max_pages = max(-(-s // page_size) for s in seq_lens) + 1
    num_pages = b * max_pages + 1
    kv = KVCache(1, num_pages, page_size, kv_heads, dim, dtype, device)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g).to(dtype))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g).to(dtype))
    table = PageTable(b, max_pages, page_size, device)
    perm = torch.randperm(num_pages - 1, generator=g)[: b * max_pages] + 1  # scattered pages
    table.table.copy_(perm.view(b, max_pages).to(torch.int32))
    tree_mask = None
    fmode = {"extend": ForwardMode.EXTEND, "draft_extend": ForwardMode.DRAFT_EXTEND, "decode": ForwardMode.DECODE,
             "verify_chain": ForwardMode.TARGET_VERIFY, "verify_tree": ForwardMode.TARGET_VERIFY,
             "draft_step": ForwardMode.DECODE}[mode]
    if mode == "verify_tree":
        d = n_new[0]
        tree_mask = ancestor_mask(random_tree_parents(b, d, g), d).to(device)
    elif mode == "draft_step":  # k queries against a scratch block of 3k entries: self + a random earlier subset
        k = n_new[0]
        blk = 3 * k
        tree_mask = torch.rand(b, k, blk, generator=g) < 0.4
        tree_mask[:, :, blk - k:] = torch.eye(k, dtype=torch.bool)
        tree_mask = tree_mask.to(device)
    t = sum(n_new)
    fb = ForwardBatch.build(fmode, torch.zeros(t, dtype=torch.int64), list(range(b)), seq_lens, n_new, kv, table,
                            tree_mask=tree_mask)
    q = torch.randn(t, heads, dim, generator=g).to(device=device, dtype=dtype)
    return fb, q


CASES = {  # name: (mode, seq_lens, new tokens per request)
    "extend": ("extend", [40, 300, 17], [40, 120, 5]),
    "draft_extend": ("draft_extend", [64, 129], [4, 4]),
    "decode": ("decode", [1, 77, 1000, 4097], [1, 1, 1, 1]),
    "verify_chain": ("verify_chain", [5, 300, 2000], [5, 5, 5]),
    "verify_tree": ("verify_tree", [8, 520, 3000], [8, 8, 8]),
    "draft_step": ("draft_step", [40, 700], [4, 4]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--small", action="store_true", help="short sequences (interpreter)")
    ap.add_argument("--min-chunk", type=int, default=None, help="Triton: fewest KV positions per split (small values "
                    "give short sequences several splits, some of them empty)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim**-0.5)
    ref_backend = _make("torch_native", "decode", "cpu")
    results, ok = [], True
    for backend_name in args.backends.split(","):
        for verify_mode in ("decode", "prefill"):
            backend = _make(backend_name, verify_mode, device) if device.type == "cuda" else _load_cpu(backend_name,
                                                                                                          verify_mode)
            if args.min_chunk is not None and hasattr(backend, "min_chunk"):
                backend.min_chunk = args.min_chunk
            for name, (mode, seqs, news) in CASES.items():
                if verify_mode == "prefill" and not name.startswith("verify"):
                    continue
                if args.small:
                    seqs = [min(s, 150) for s in seqs]
                    news = [min(n, s) for n, s in zip(news, seqs)]
                for page_size in (1, 16):
                    fb, q = make_case(mode, page_size, seqs, news, heads, kv_heads, dim, device, dtype, g)
                    backend.init_forward_metadata(fb)
                    out = backend.forward(q, None, None, layer, fb).float()
                    # reference: fp32 copies of the same data on the CPU
                    fb32, q32 = _to_fp32_cpu(fb, q)
                    ref_backend.init_forward_metadata(fb32)
                    ref = ref_backend.forward(q32, None, None, layer, fb32)
                    err = ((out.cpu() - ref).norm() / ref.norm()).item()
                    tol = 2e-2 if dtype != torch.float32 else 1e-4
                    passed = err < tol and torch.isfinite(out).all().item()
                    ok &= passed
                    results.append({"backend": backend_name, "verify_mode": verify_mode, "case": name,
                                    "page_size": page_size, "rel_err": err, "pass": passed})
                    print(f"{backend_name:8s} verify={verify_mode:7s} {name:13s} page={page_size:2d} "
                          f"rel_err={err:.2e} {'ok' if passed else 'FAIL'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "dtype": args.dtype, "results": results},
                                              indent=2))
    sys.exit(0 if ok else 1)


def _load_cpu(name: str, verify_mode: str):
    """Backends on the CPU only exist through Triton's interpreter (TRITON_INTERPRET=1)."""
    import importlib

    from attention.registry import BACKENDS

    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(verify_attention_mode=verify_mode)


def _to_fp32_cpu(fb: ForwardBatch, q: torch.Tensor):
    cpu = torch.device("cpu")
    kv = KVCache(1, fb.kv_cache.num_pages, fb.kv_cache.page_size, fb.kv_cache.k[0].shape[1],
                 fb.kv_cache.k[0].shape[2], torch.float32, cpu)
    kv.k[0].copy_(fb.kv_cache.k[0].float().cpu())
    kv.v[0].copy_(fb.kv_cache.v[0].float().cpu())
    table = PageTable(fb.page_table.table.shape[0], fb.page_table.table.shape[1], fb.page_table.page_size, cpu)
    table.table.copy_(fb.page_table.table.cpu())
    fb32 = ForwardBatch.build(fb.mode, fb.input_ids.cpu(), fb.req_slots.cpu(), fb.seq_lens_cpu, fb.extend_lens_cpu, kv,
                              table, tree_mask=None if fb.tree_mask is None else fb.tree_mask.cpu())
    return fb32, q.float().cpu()


if __name__ == "__main__":
    main()
