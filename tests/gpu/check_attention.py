"""Attention backends against the torch-native fp32 reference, on random paged KV, for every forward mode.

    python -m tests.gpu.check_attention --device cuda --backends triton,flashinfer [--dtype bfloat16] [--json out.json]
    TRITON_INTERPRET=1 python -m tests.gpu.check_attention --device cpu --backends triton --small --dtype float32
    # (CPU, Triton's interpreter: float32 only; in bfloat16 its outputs are wrong there)

Cases: EXTEND (with a cached prefix, chunked), DRAFT_EXTEND, DECODE, TARGET_VERIFY (chain and tree, decode- and
prefill-style kernels), and a multi-step draft step (queries against a scratch block). Page sizes 1 and 16, GQA.
Every line names the kernel that ran (for flashinfer: ``xqa`` or one of its plan-based wrappers).

flashinfer runs every case twice: with host lengths, and with the lengths on the device only (``seq_lens_cpu``
None, as in CUDA-graph capture/replay and speculative rounds). Where its XQA kernel runs (sm90/100/120), XQA must
take every forward it serves (DECODE, uniform DRAFT_EXTEND, draft steps, decode-mode verify; page size 16) with
device-only lengths, and the planned wrappers those with host lengths; the forwards XQA does not serve must refuse
device-only lengths with a ValueError (printed ``n/a``).

On CUDA a graph check follows for every graph-capable backend (``supports_cuda_graph``): one DECODE and one
TARGET_VERIFY (tree) forward captured in a ``torch.cuda.CUDAGraph`` over static device lengths, replayed after the
lengths (and the tree) changed, against an eager run at the new lengths and the reference. Exit status 0 iff every
line passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

from attention.base import AttentionLayerSpec
from attention.flashinfer_xqa import XQA_PAGE_SIZES
from attention.registry import _make
from speculative.tree import ancestor_mask
from workers.forward_batch import ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode


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
    "draft_extend": ("draft_extend", [64, 129], [4, 4]),  # uniform, few tokens (Triton: the split-KV launch)
    "draft_extend_ragged": ("draft_extend", [50, 300], [6, 20]),  # ragged (Triton: the prefill launch)
    "decode": ("decode", [1, 77, 1000, 4097], [1, 1, 1, 1]),
    "decode_one": ("decode", [3000], [1]),  # a lone request: the Triton backend's own launch (small KV tiles)
    "verify_chain": ("verify_chain", [5, 300, 2000], [5, 5, 5]),
    "verify_one": ("verify_chain", [2500], [4]),
    "verify_tree": ("verify_tree", [8, 520, 3000], [8, 8, 8]),
    "draft_step": ("draft_step", [40, 700], [4, 4]),
}


def expects_xqa(backend, mode: str, verify_mode: str, page_size: int, dtype, news: list[int]) -> bool:
    """Whether the flashinfer backend must run this case on XQA (see the module docstring of its backend): XQA
    takes one count of new tokens per batch, so a ragged batch (a draft catch-up after prompts of different
    lengths, which the engine runs with host lengths) is not its."""
    return (backend.xqa_available and page_size in XQA_PAGE_SIZES
            and dtype in (torch.float16, torch.bfloat16) and mode != "extend" and len(set(news)) == 1
            and not (verify_mode == "prefill" and mode.startswith("verify")))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref).norm() / ref.norm()).item()


def reference(fb: ForwardBatch, q: torch.Tensor, layer: AttentionLayerSpec) -> torch.Tensor:
    """torch-native on fp32 CPU copies of the same data (needs host lengths)."""
    ref_backend = _make("torch_native", "decode", "cpu")
    fb32, q32 = _to_fp32_cpu(fb, q)
    ref_backend.init_forward_metadata(fb32)
    return ref_backend.forward(q32, None, None, layer, fb32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--small", action="store_true", help="short sequences (interpreter)")
    ap.add_argument("--min-chunk", type=int, default=None, help="Triton: fewest KV positions per split (small values "
                    "give short sequences several splits, some of them empty)")
    ap.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--page-sizes", default="1,16", help="comma-separated page sizes (XQA: 16, 32, 64, 128)")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph capture/replay check")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    cases = CASES if args.cases is None else {c: CASES[c] for c in args.cases.split(",")}
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim**-0.5)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    results, graph_rows, xqa_info = [], [], {}
    for backend_name in args.backends.split(","):
        for verify_mode in ("decode", "prefill"):
            backend = _make(backend_name, verify_mode, device) if device.type == "cuda" else _load_cpu(backend_name,
                                                                                                          verify_mode)
            if args.min_chunk is not None and backend_name == "triton":
                backend.min_chunk = args.min_chunk
            if backend_name == "flashinfer" and verify_mode == "decode":
                xqa_info = {"available": backend.xqa_available, "unavailable_because": backend.xqa_unavailable}
                print(f"# {backend_name}: XQA " + ("available" if backend.xqa_available else
                                                   f"unavailable ({backend.xqa_unavailable})")
                      + f", supports_cuda_graph={backend.supports_cuda_graph}", flush=True)
            lens_variants = ("host", "device") if backend_name == "flashinfer" else ("host",)
            for name, (mode, seqs, news) in cases.items():
                if verify_mode == "prefill" and not name.startswith("verify"):
                    continue
                if args.small:
                    seqs = [min(s, 150) for s in seqs]
                    news = [min(n, s) for n, s in zip(news, seqs)]
                for page_size in page_sizes:
                    fb, q = make_case(mode, page_size, seqs, news, heads, kv_heads, dim, device, dtype, g)
                    ref = reference(fb, q, layer)
                    xqa_can = backend_name == "flashinfer" and expects_xqa(backend, mode, verify_mode, page_size,
                                                                           dtype, news)
                    for lens in lens_variants:
                        want_xqa = xqa_can and lens == "device"  # host lengths run on the planned wrappers
                        if lens == "device":
                            fb.seq_lens_cpu = None  # as in CUDA-graph replay: lengths on the device only
                        tag = (f"{backend_name:8s} verify={verify_mode:7s} {name:13s} page={page_size:2d} "
                               f"lens={lens:6s}")
                        row = {"backend": backend_name, "verify_mode": verify_mode, "case": name,
                               "page_size": page_size, "lens": lens, "expected_kernel": "xqa" if want_xqa else None}
                        kernel = None
                        try:
                            backend.init_forward_metadata(fb)
                            kernel = fb.attn_metadata.kernel
                            out = backend.forward(q, None, None, layer, fb)
                            if device.type == "cuda":
                                torch.cuda.synchronize()
                        except Exception as e:  # noqa: BLE001 - report and go on with the other cases
                            if isinstance(e, ValueError) and kernel is None and lens == "device" and not want_xqa:
                                # refused by the metadata builder, as it must be: no host lengths
                                results.append({**row, "pass": None, "refused": str(e)})
                                print(f"{tag} kernel=-{'':25s} n/a (refused: {e})", flush=True)
                                continue
                            results.append({**row, "kernel": kernel, "pass": False, "error": repr(e)})
                            print(f"{tag} kernel={kernel} ERROR {e!r} FAIL", flush=True)
                            traceback.print_exc()
                            continue
                        err = rel_err(out, ref)
                        right_kernel = not want_xqa or kernel == "xqa"
                        passed = bool(err < tol and torch.isfinite(out).all().item() and right_kernel)
                        results.append({**row, "kernel": kernel, "rel_err": err, "pass": passed})
                        print(f"{tag} kernel={kernel:26s} rel_err={err:.2e}"
                              f"{'' if right_kernel else ' (expected xqa)'} {'ok' if passed else 'FAIL'}", flush=True)
    if device.type == "cuda" and not args.no_graph:
        for backend_name in args.backends.split(","):
            graph_rows += graph_check(backend_name, device, dtype, layer, heads, kv_heads, dim, g, tol)
    checked = [r for r in results + graph_rows if r.get("pass") is not None]
    failed = [r for r in checked if not r["pass"]]
    ok = not failed and bool(checked)
    print(f"SUMMARY: {len(checked) - len(failed)} ok, {len(failed)} FAIL, "
          f"{sum(r.get('pass') is None for r in results + graph_rows)} n/a -> {'PASS' if ok else 'FAIL'}", flush=True)
    if args.json:
        from bench.common import commit

        meta = {"commit": commit(), "command": " ".join(["python3", "-m", "tests.gpu.check_attention"] + sys.argv[1:]),
                "device": str(device),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "dtype": args.dtype,
                "torch": torch.__version__, "flashinfer": _flashinfer_version(), "xqa": xqa_info}
        Path(args.json).write_text(json.dumps({**meta, "pass": ok, "results": results, "graph": graph_rows},
                                              indent=2))
    sys.exit(0 if ok else 1)


# ---- CUDA graphs -----------------------------------------------------------------------------------------------------
GRAPH_CASES = {"decode": ("decode", 1), "verify_tree": ("verify_tree", 8)}  # name: (make_case mode, new tokens)
GRAPH_PAGE_SIZE = 16
GRAPH_LENS = {  # per request: the page table is sized for "capacity"; captured at "capture", replayed at each of
    "capacity": [700, 2100, 64],  # "replays" (every request's length changes, some across pages)
    "capture": [300, 2000, 40],
    "replays": [[700, 45, 64], [17, 2100, 9]],
}


def graph_check(backend_name: str, device, dtype, layer, heads, kv_heads, dim, g, tol) -> list[dict]:
    """One DECODE and one TARGET_VERIFY forward of the backend captured in a CUDA graph over static device lengths
    (and tree mask), replayed at other lengths (and another tree): each replay against an eager run of the same
    backend at those lengths, and against the reference."""
    backend = _make(backend_name, "decode", device)
    if not backend.supports_cuda_graph:
        why = backend.graph_refusal(GRAPH_PAGE_SIZE, dtype, dim) or "supports_cuda_graph is False"
        print(f"graph    {backend_name:8s} n/a (not graph-capable: {why})", flush=True)
        return [{"backend": backend_name, "graph": True, "pass": None, "refused": why}]
    rows = []
    for name, (mode, n) in GRAPH_CASES.items():
        try:
            rows += _graph_case(backend, backend_name, name, mode, n, device, dtype, layer, heads, kv_heads, dim, g,
                                tol)
        except Exception as e:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            rows.append({"backend": backend_name, "graph": True, "case": name, "pass": False, "error": repr(e)})
            print(f"graph    {backend_name:8s} {name:13s} ERROR {e!r} FAIL", flush=True)
    return rows


def _graph_case(backend, backend_name, name, mode, n, device, dtype, layer, heads, kv_heads, dim, g, tol):
    b = len(GRAPH_LENS["capture"])
    alloc, q = make_case(mode, GRAPH_PAGE_SIZE, GRAPH_LENS["capacity"], [n] * b, heads, kv_heads, dim, device,
                         dtype, g)
    kv, table, fmode = alloc.kv_cache, alloc.page_table, alloc.mode
    lens = torch.tensor(GRAPH_LENS["capture"], dtype=torch.int32, device=device)  # the graph's static inputs
    tree = None if alloc.tree_mask is None else alloc.tree_mask.clone()
    ids = torch.zeros(b * n, dtype=torch.int64, device=device)
    slots = torch.arange(b, device=device)

    kernels = []

    def step():  # as the engine's graph runner: the batch is built inside the capture, from the static inputs
        fb = ForwardBatch.build(fmode, ids, slots, lens, [n] * b, kv, table, tree_mask=tree)
        assert fb.seq_lens_cpu is None
        backend.init_forward_metadata(fb)
        kernels.append(fb.attn_metadata.kernel)
        return backend.forward(q, None, None, layer, fb)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (JIT builds, workspace) outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    kernel = kernels[-1]
    graph.replay()
    torch.cuda.synchronize()
    at_capture = out.float().clone()
    rows = []
    for i, new_lens in enumerate(GRAPH_LENS["replays"]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        if tree is not None:
            tree.copy_(ancestor_mask(random_tree_parents(b, n, g), n).to(device))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.float().clone()
        # eager with the lengths on the device only, as in the graph (flashinfer: the same XQA kernel; host lengths
        # would take its planned wrappers); the fp32 reference takes them from the host
        eager_fb = ForwardBatch.build(fmode, ids, list(range(b)), torch.tensor(new_lens, dtype=torch.int32,
                                                                               device=device), [n] * b, kv, table,
                                      tree_mask=None if tree is None else tree.clone())
        backend.init_forward_metadata(eager_fb)
        eager_kernel = eager_fb.attn_metadata.kernel
        eager = backend.forward(q, None, None, layer, eager_fb).float()
        torch.cuda.synchronize()
        ref_fb = ForwardBatch.build(fmode, ids, list(range(b)), new_lens, [n] * b, kv, table,
                                    tree_mask=None if tree is None else tree.clone())
        err = rel_err(replayed, reference(ref_fb, q, layer))
        vs_eager = ((replayed - eager).norm() / eager.norm()).item()
        moved = ((replayed - at_capture).norm() / at_capture.norm()).item()  # the replay read the new lengths
        right_kernel = backend_name != "flashinfer" or kernel == eager_kernel == "xqa"
        passed = bool(torch.isfinite(replayed).all().item() and err < tol and vs_eager < 1e-3 and moved > 1e-2
                      and right_kernel)
        rows.append({"backend": backend_name, "graph": True, "case": name, "page_size": GRAPH_PAGE_SIZE,
                     "capture_lens": GRAPH_LENS["capture"], "replay_lens": new_lens, "kernel": kernel,
                     "eager_kernel": eager_kernel, "rel_err": err, "rel_diff_vs_eager": vs_eager,
                     "bitwise_equal_eager": bool(torch.equal(replayed, eager)), "rel_change_vs_capture": moved,
                     "pass": passed})
        print(f"graph    {backend_name:8s} {name:13s} page={GRAPH_PAGE_SIZE:2d} replay={i} lens={new_lens} "
              f"kernel={kernel} rel_err={err:.2e} vs_eager={vs_eager:.1e} moved={moved:.1e} "
              f"{'ok' if passed else 'FAIL'}", flush=True)
    return rows


def _flashinfer_version():
    try:
        import flashinfer

        return flashinfer.__version__
    except Exception:  # noqa: BLE001
        return None


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
