"""The DeepSeek-V3.2 sparse attention kernels (``workers.kernels.sparse_mla``) compiled on the GPU against their
PyTorch references, at the model's shapes (indexer 64 heads x 128, top-k 2048, MLA 128 heads, latent 512 + rope 64):

- indexer scores over bf16 keys and over FP8 keys (against the reference on the same FP8 values, and on the bf16
  keys by tolerance), decode and verify rows;
- the top-k, each path (radix passes in one program a row and split over programs, the sampled and the ordered
  candidates), equal to the reference's slots on the kernel's own scores (exact), and the whole ``indexer_topk``;
- sparse MLA in bf16 and fp32 against the fp32 reference, one split and several, -1 slots;
- the whole layer replayed from a CUDA graph equal to its eager run, bit for bit, with new lengths written in place.

    python -m tests.gpu.check_sparse_mla
    TRITON_INTERPRET=1 python -m tests.gpu.check_sparse_mla --device cpu --small   # the script itself, tiny shapes

Exit status 0 iff every check passed ("sparse kernels ok").
"""

from __future__ import annotations

import argparse
import sys

import torch

from workers.kernels import sparse_mla as sm


def case(device, small: bool, g):
    if small:
        dims = dict(hi=4, di=16, h=6, dl=32, dr=16, topk=64, page=64, lens=[300, 190])
    else:
        dims = dict(hi=64, di=128, h=128, dl=512, dr=64, topk=2048, page=64, lens=[9000, 3000])
    lens, page = dims["lens"], dims["page"]
    pages_per = -(-max(lens) // page) + 1
    num_pages = len(lens) * pages_per + 1
    table = (torch.randperm(num_pages - 1, generator=g)[:len(lens) * pages_per] + 1).view(len(lens), pages_per)
    spec = [(0, lens[0])] + [(0, lens[0] - 4 + j) for j in range(5)] + [(1, lens[1]), (1, 100), (1, 0)]
    t = dict(dims, table=table.to(torch.int32),
             row_req=torch.tensor([r for r, _ in spec], dtype=torch.int32),
             row_len=torch.tensor([n for _, n in spec], dtype=torch.int32),
             keys=torch.randn(num_pages * page, dims["di"], generator=g),
             cache=torch.randn(num_pages * page, dims["dl"] + dims["dr"], generator=g))
    r = len(spec)
    t["q"] = torch.randn(r, dims["hi"], dims["di"], generator=g)
    t["w"] = torch.randn(r, dims["hi"], generator=g) * dims["hi"] ** -0.5
    t["ql"] = torch.randn(r, dims["h"], dims["dl"], generator=g)
    t["qr"] = torch.randn(r, dims["h"], dims["dr"], generator=g)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()}


def check(name: str, ok: bool, detail="") -> bool:
    print(f"{name}: {'ok' if ok else 'FAIL'} {detail}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (the interpreter)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    c = case(args.device, args.small, g)
    dtypes = (torch.float32,) if args.device == "cpu" else (torch.bfloat16, torch.float32)
    page, topk = c["page"], c["topk"]
    results = []
    vis = torch.arange(c["table"].shape[1] * page, device=args.device)[None, :] < c["row_len"][:, None]
    for dt in dtypes:
        keys, q = c["keys"].to(dt), c["q"].to(dt)
        ref = sm.indexer_scores_reference(q, c["w"], keys, c["table"], c["row_req"], c["row_len"], page)
        got = sm.indexer_scores(q, c["w"], keys, c["table"], c["row_req"], c["row_len"], page)
        scale = ref[vis].abs().max()
        err = float((got[vis] - ref[vis]).abs().max() / scale)
        results.append(check(f"indexer scores {dt}", err < (1e-5 if dt == torch.float32 else 1e-2), f"rel {err:.2e}"))
        packed = sm.quantize_index_keys(c["keys"], page)
        got8 = sm.indexer_scores(q, c["w"], packed, c["table"], c["row_req"], c["row_len"], page, fp8=True)
        ref8 = sm.indexer_scores_reference(q, c["w"], packed, c["table"], c["row_req"], c["row_len"], page, fp8=True)
        err8 = float((got8[vis] - ref8[vis]).abs().max() / scale)
        err8b = float((got8[vis] - ref[vis]).abs().max() / scale)
        results.append(check(f"indexer scores FP8 keys, q {dt}", err8 < (1e-5 if dt == torch.float32 else 1e-2)
                             and err8b < 0.1, f"rel {err8:.2e} vs the same FP8, {err8b:.2e} vs bf16 keys"))
        want = sm.positions_to_slots(sm.topk_positions_reference(got, c["row_len"], topk), c["table"], c["row_req"],
                                     page)
        # (sampled, ordered: the threshold from a sample, small enough at the tiny shapes that their long rows are
        # sampled; ordered with its threshold from its own kernel and drawn by each split)
        paths = ((1, "radix", {}), (None, "radix", {}), (7, "radix", {}), (1, "sampled", {}), (None, "sampled", {}),
                 (7, "sampled", {}), (1, "ordered", {}), (None, "ordered", {}),
                 (7, "ordered", {"fused_threshold": False}), (7, "ordered", {"fused_threshold": True}))
        if args.small:  # (the interpreter: every path once; the differential test covers their splits)
            paths = paths[1:3] + paths[5:6] + paths[7:]
        for splits, method, kw in paths:
            sel = sm.topk_slots(got, c["table"], c["row_req"], c["row_len"], page, topk, num_splits=splits,
                                method=method, sample=64 if args.small else 1024, **kw)
            results.append(check(f"top-k {dt} splits={splits} {method} {kw}", torch.equal(sel, want),
                                 f"{int((sel != want).sum())} slots differ"))
        whole = sm.indexer_topk(q, c["w"], keys, c["table"], c["row_req"], c["row_len"], page, topk)
        results.append(check(f"indexer_topk {dt}", torch.equal(whole, want)))
        # rows grouped by request (3 a program: the rows are request 0's 6 then request 1's 3), each key tile read
        # once for the group: the same scores as one row a program, with and without tree bits, bf16 and FP8 keys
        bits = torch.tensor([1, 1, 3, 5, 9, 15, 1, 2, 0], dtype=torch.int64, device=args.device)
        for kname, k, fp8 in (("bf16", keys, False), ("FP8", packed, True)):
            for tree in (None, bits):
                one = sm.indexer_scores(q, c["w"], k, c["table"], c["row_req"], c["row_len"], page, fp8=fp8,
                                        tree_bits=tree, tree_len=4)
                grp = sm.indexer_scores(q, c["w"], k, c["table"], c["row_req"], c["row_len"], page, fp8=fp8,
                                        tree_bits=tree, tree_len=4, rows_per_req=3, min_groups=1)
                same_inf = torch.equal(torch.isinf(one[vis]), torch.isinf(grp[vis]))
                fin = vis & torch.isfinite(one)
                err = float((grp[fin] - one[fin]).abs().max() / scale)
                results.append(check(f"indexer grouped rows {dt} {kname} keys tree={tree is not None}",
                                     same_inf and err < 1e-6,
                                     f"rel {err:.2e}, exact {torch.equal(grp[vis], one[vis])}"))
        grouped = sm.indexer_topk(q, c["w"], keys, c["table"], c["row_req"], c["row_len"], page, topk, rows_per_req=3)
        own = sm.indexer_scores(q, c["w"], keys, c["table"], c["row_req"], c["row_len"], page, rows_per_req=3)
        want_g = sm.positions_to_slots(sm.topk_positions_reference(own, c["row_len"], topk), c["table"],
                                       c["row_req"], page)
        results.append(check(f"indexer_topk grouped rows {dt}", torch.equal(grouped, want_g)))
        # sparse MLA over the selection, -1 holes punched in
        slots = want.clone()
        slots[:, ::5] = -1
        ql, qr, cache = c["ql"].to(dt), c["qr"].to(dt), c["cache"].to(dt)
        mref = sm.sparse_mla_reference(ql.float(), qr.float(), cache.float(), slots, 0.07)
        tol = 1e-4 if dt == torch.float32 else 2e-2
        # the wide head blocks are the bf16 launch's (fp32 tiles of 128 heads pass the shared memory an SM has)
        wide = not args.small and dt != torch.float32
        tiles = [dict()] + ([dict(block_h=16, block_n=64, lat_split=1), dict(block_h=32, block_n=64, lat_split=2),
                             dict(block_h=64, block_n=32, lat_split=1), dict(block_h=128, block_n=32, lat_split=2),
                             dict(block_h=16, block_n=64, lat_split=1, heads_n=True),
                             dict(block_h=32, block_n=64, lat_split=2, heads_n=True)]
                            if wide else [dict(heads_n=True)])
        for splits, kw in [(s, kw) for s in (1, None) for kw in tiles]:
            out = sm.sparse_mla(ql, qr, cache, slots, 0.07, num_splits=splits, **kw)
            err = float((out.float() - mref).abs().max())
            results.append(check(f"sparse MLA {dt} splits={splits} {kw}", err < tol, f"max abs {err:.2e}"))
    if args.device == "cuda":  # the layer in a CUDA graph: same bits as eager, lengths read on the device
        keys, q = c["keys"].bfloat16(), c["q"].bfloat16()
        ql, qr, cache = c["ql"].bfloat16(), c["qr"].bfloat16(), c["cache"].bfloat16()
        row_len = c["row_len"].clone()

        def layer():
            sel = sm.indexer_topk(q, c["w"], keys, c["table"], c["row_req"], row_len, page, topk, rows_per_req=3)
            return sm.sparse_mla(ql, qr, cache, sel, 0.07)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer()
        row_len.sub_(50).clamp_(min=0)
        graph.replay()
        torch.cuda.synchronize()
        results.append(check("graph replay == eager", torch.equal(out, layer())))
    if all(results):
        print("sparse kernels ok")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
