"""DeepSeek-V3.2 sparse attention on the GPU, one layer, synthetic tensors (no model code): the lightning indexer
(64 heads x 128 over FP8 keys with a per-token scale, or bf16 keys), the exact top-k (2048) and the sparse MLA
(128 heads, latent 512 + rope 64, bf16) of ``workers/kernels/sparse_mla.py``, for DECODE (one query row a request)
and TARGET_VERIFY (4 draft tokens: 5 query rows a request, each with its own causal length and its own top-k), at
16k / 64k / 128k context and batch 1 / 8 / 32.

Reported per case: each kernel's time alone, and the layer's (indexer + top-k + sparse MLA, as ``indexer_topk``
and ``sparse_mla`` run them) replayed from one CUDA graph and launched eagerly, against the floor: the request's
indexer keys over the whole context plus the latents the rows selected (their union per request, 576 bf16 values
each), each read once at the device's copy bandwidth (measured in the same run, ``--bandwidth-tbps`` to give one
instead); and against the launch floor: as many empty dependent kernels as the layer launches, chained with PDL in
one graph (at bs 1 the read floor is a few microseconds, below what such a chain takes). Also: sparse vs dense MLA
verify at 64k (dense: the same sparse MLA kernel given every slot of the context), the draft round's row metadata
built once (``SparseDraftRows``) vs per step (host time), and a small launch sweep whose choices the table uses.

    python3 -m bench.sparse_attention --out bench/results/sparse_attention/sparse_attention_h100
    python3 -m bench.sparse_attention --cpu --out /tmp/sparse_smoke   # tiny shapes through Triton's interpreter

Timing: ``graph``: one replay of the captured launches with the L2 flushed before it (triton's do_bench), ``eager``:
Python launches, also do_bench. The synthetic indexer queries of one request's verify rows are one query plus 10%
noise each, so their selections overlap as consecutive tokens' do; the floor counts the union of what they select.
Writes <out>.json (after every case), <out>.md, <out>.png with device, commit and command.
"""

from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv:  # Triton's interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.common import (command, commit, copy_bandwidth, device_name, graph_ms, out_path, pyplot,  # noqa: E402
                          write_json, write_markdown)
from workers.kernels import sparse_mla as sm  # noqa: E402

H100_SXM_TBPS = 3.35
H100_BF16_TFLOPS = 989.0  # dense, datasheet (the CPU smoke run's stand-in for a measured rate)

if sm.triton is not None:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402

    from workers.kernels.launch import pdl_start  # noqa: E402

    @triton.jit
    def _empty_kernel(X, PDL: tl.constexpr = False):
        """Nothing but the PDL wait: a link of the launch-floor chain."""
        pdl_start(PDL)

SHAPES = {
    "gpu": dict(mla_heads=128, latent=512, rope=64, index_heads=64, index_dim=128, topk=2048, page=64),
    "cpu": dict(mla_heads=4, latent=32, rope=16, index_heads=4, index_dim=16, topk=64, page=64),
}


class Case:
    """One (context, batch, mode) layer: paged caches of ``bs`` requests at ``ctx`` positions (scattered pages),
    the query rows (decode: 1 a request at ctx; verify: 1 + draft tokens at ctx - draft .. ctx), and preallocated
    outputs, so the layer captures into a CUDA graph."""

    def __init__(self, shape: dict, ctx: int, bs: int, rows_per_req: int, fp8: bool, device: str, seed: int = 0,
                 mla_kernel: str = "triton"):
        s = shape
        # its own generator: the process's default one may be unusable after foreign kernel libraries load
        g = torch.Generator(device=device).manual_seed(seed)
        self.shape, self.ctx, self.bs, self.fp8 = s, ctx, bs, fp8
        self.rows_per_req = rows_per_req  # the indexer reads each request's keys once for all its rows
        page = s["page"]
        pages_per = -(-ctx // page)
        num_pages = bs * pages_per + 1
        perm = torch.randperm(num_pages - 1, device=device, generator=g)
        self.table = (perm[:bs * pages_per] + 1).view(bs, pages_per).to(torch.int32)
        slots = num_pages * page
        dt = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dot is unreliable
        keys = torch.randn(slots, s["index_dim"], device=device, dtype=dt, generator=g)
        self.keys = sm.quantize_index_keys(keys, page) if fp8 else keys
        self.keys_bf16 = keys
        self.cache = torch.randn(slots, s["latent"] + s["rope"], device=device, dtype=dt, generator=g)
        r = bs * rows_per_req
        self.rows = r
        self.row_req = torch.arange(bs, device=device, dtype=torch.int32).repeat_interleave(rows_per_req)
        self.row_len = (ctx - rows_per_req + 1 + torch.arange(rows_per_req, device=device)).repeat(bs).to(
            torch.int32)
        base = torch.randn(bs, 1, s["index_heads"], s["index_dim"], device=device, generator=g)
        noise = torch.randn(bs, rows_per_req, s["index_heads"], s["index_dim"], device=device, generator=g)
        self.q_idx = (base + 0.1 * noise).view(r, s["index_heads"], s["index_dim"]).to(dt)
        self.w = torch.randn(r, s["index_heads"], device=device, generator=g) * s["index_heads"] ** -0.5
        self.ql = torch.randn(r, s["mla_heads"], s["latent"], device=device, dtype=dt, generator=g)
        self.qr = torch.randn(r, s["mla_heads"], s["rope"], device=device, dtype=dt, generator=g)
        self.scale = (s["latent"] + s["rope"]) ** -0.5
        self.scores = torch.empty(r, pages_per * page, device=device)
        self.slots = torch.empty(r, s["topk"], dtype=torch.int32, device=device)
        self.out = torch.empty(r, s["mla_heads"], s["latent"], device=device, dtype=dt)
        self.planned = None  # FlashInfer's MLA (``mla_kernel``): its wrapper, planned once; the top-k writes its buffer
        if mla_kernel == "flashinfer":
            from attention.sparse_torch_native import SparseMLALayerSpec

            spec = SparseMLALayerSpec(0, s["mla_heads"], s["latent"], s["rope"], s["index_heads"], s["index_dim"],
                                      s["topk"], self.scale)
            backend = flashinfer_backend()
            if backend.uses_flashinfer(r, spec, dt):  # (as the backend runs them: one row stays on ours)
                self.planned, self.slots = backend.plan(r, spec, torch.device(device))

    def indexer(self, knobs: dict, bf16_keys: bool = False, per_row: bool = False):
        keys, fp8 = (self.keys_bf16, False) if bf16_keys else (self.keys, self.fp8)
        return sm.indexer_scores(self.q_idx, self.w, keys, self.table, self.row_req, self.row_len,
                                 self.shape["page"], fp8=fp8, rows_per_req=1 if per_row else self.rows_per_req,
                                 out=self.scores, **knobs.get("indexer", {}))

    def topk(self, knobs: dict):
        return sm.topk_slots(self.scores, self.table, self.row_req, self.row_len, self.shape["page"],
                             self.shape["topk"], out=self.slots, **knobs.get("topk", {}))

    def mla(self, knobs: dict, slots=None):
        if self.planned is not None and slots is None:
            self.out = flashinfer_backend().attend(self.planned, self.slots, self.ql, self.qr, self.cache)
            return self.out
        return sm.sparse_mla(self.ql, self.qr, self.cache, self.slots if slots is None else slots, self.scale,
                             rows_per_req=self.rows_per_req, out=self.out, **knobs.get("mla", {}))

    def layer(self, knobs: dict):
        """As ``indexer_topk`` then ``sparse_mla`` run them."""
        self.indexer(knobs)
        self.topk(knobs)
        return self.mla(knobs)

    def floor_bytes(self) -> tuple[int, int]:
        """(indexer key bytes, selected latent bytes): every request's keys up to its longest row, and the union of
        its rows' selected slots' latents, each read once."""
        keys = self.bs * int(self.row_len.max()) * sm.index_key_bytes(self.shape["index_dim"], self.fp8)
        per_req = self.slots.view(self.bs, -1).sort(1).values
        uniq = ((per_req[:, 1:] != per_req[:, :-1]) & (per_req[:, 1:] >= 0)).sum() + (per_req[:, 0] >= 0).sum()
        width = self.cache.shape[1] * 2  # bf16 on the GPU
        return keys, int(uniq) * width

    def flops(self) -> tuple[int, int]:
        """(indexer FLOPs, MLA FLOPs) of the layer's matmuls: each row's index queries against its visible keys
        (heads x dim multiply-adds a position), and each row's MLA heads over the slots it selected (QK over latent +
        rope, PV over the latent)."""
        s = self.shape
        idx = int(self.row_len.sum()) * s["index_heads"] * s["index_dim"] * 2
        mla = int((self.slots >= 0).sum()) * s["mla_heads"] * (2 * (s["latent"] + s["rope"]) + 2 * s["latent"])
        return idx, mla

    def all_slots(self) -> torch.Tensor:
        """Every visible slot of each row (dense attention through the sparse kernel), -1 past the row's length."""
        cap = self.table.shape[1] * self.shape["page"]
        pos = torch.arange(cap, device=self.table.device).expand(self.rows, cap)
        pos = torch.where(pos < self.row_len[:, None], pos, -1)
        return sm.positions_to_slots(pos, self.table, self.row_req, self.shape["page"])


_FLASHINFER = []


def flashinfer_backend():
    """One ``SparseFlashInferBackend`` for the run (its workspace shared by the cases' plans)."""
    if not _FLASHINFER:
        from attention.sparse_flashinfer import SparseFlashInferBackend

        _FLASHINFER.append(SparseFlashInferBackend())
        _FLASHINFER[0].full_selection = True  # (every row of a case selects its whole top-k: 16k contexts and more)
    return _FLASHINFER[0]


def matmul_rates(n: int = 8192) -> dict:
    """Dense matmul rates on this device (FLOP/s, the best of three do_bench timings of an n x n x n product): bf16
    (``torch.matmul``) and FP8 e4m3 x e4m3 (``torch._scaled_mm``, bf16 out; None where this torch lacks it). What
    the MLA's and the indexer's FLOPs can run at, at best: their compute floors use these."""
    import triton.testing

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n ** 3

    def best(fn):
        return flops / (min(triton.testing.do_bench(fn, warmup=10, rep=50) for _ in range(3)) * 1e-3)

    rates = {"bf16": best(lambda: a @ b), "fp8": None}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        rates["fp8"] = best(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except (RuntimeError, AttributeError, TypeError) as e:  # recorded: the indexer's compute floor then uses bf16's
        rates["fp8_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return rates


def physical_floors(case: Case, key_b: int, lat_b: int, bw: float, rates: dict, fp8: bool,
                    launch_ms: float) -> dict:
    """What physics allows the layer, in ms. Read: keys + selected latents at the copy bandwidth. Compute: the
    indexer's FLOPs at the FP8 rate (bf16 keys: the bf16 rate) + the MLA's at the bf16 rate. Launch: the empty
    chain. ``attainable``: max(read, compute, launch), every stage's reads, FLOPs and launches overlapped (a
    persistent kernel could overlap one row's MLA with another's indexer). ``stage``: the three stages in series
    (the top-k needs a row's every score, the MLA its top-k), each stage at max(its reads, its FLOPs) and the
    launches hidden under them: max(launch, max(keys, indexer FLOPs) + max(latents, MLA FLOPs))."""
    idx_f, mla_f = case.flops()
    idx_rate = rates["fp8"] if fp8 and rates.get("fp8") else rates["bf16"]
    idx_c, mla_c = idx_f / idx_rate * 1e3, mla_f / rates["bf16"] * 1e3
    key_r, lat_r = key_b / bw * 1e3, lat_b / bw * 1e3
    read, compute = key_r + lat_r, idx_c + mla_c
    attainable = max(read, compute, launch_ms)
    bound = "launch" if attainable == launch_ms else "read" if attainable == read else "compute"
    idx_floor, mla_floor = max(key_r, idx_c), max(lat_r, mla_c)
    return {"indexer_GFLOP": idx_f / 1e9, "mla_GFLOP": mla_f / 1e9, "compute_floor_ms": compute,
            "indexer_compute_ms": idx_c, "mla_compute_ms": mla_c, "indexer_floor_ms": idx_floor,
            "mla_floor_ms": mla_floor, "attainable_floor_ms": attainable, "bound": bound,
            "stage_floor_ms": max(launch_ms, idx_floor + mla_floor)}


def count_kernels(fn) -> int:
    """Kernels (and memsets / copies) one call of ``fn`` launches on the GPU, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def launch_floor(n: int, graph) -> float:
    """Graph-replay ms of ``n`` empty dependent Triton kernels (a program per SM each, launched with PDL as the
    layer's are: each waits for the one before it), timed as the layer is: what a chain of that many kernels costs
    however little they do."""
    from workers.kernels.launch import pdl_launch

    x = torch.zeros(1, device="cuda")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count

    def chain():
        for _ in range(n):
            _empty_kernel[(sms,)](x, **pdl_launch(x))

    return graph(chain)


def timer(device: str, rep: int = 50):
    """(graph ms, eager ms) functions for this device; on the CPU both are eager wall time (no graphs). Graphs are
    captured with PDL on, as the engine captures them; eager launches run without it, as the engine's do."""
    if device == "cuda":
        import triton.testing

        from workers.kernels.launch import pdl_launches

        def graph(fn):
            with pdl_launches():
                return graph_ms(fn, warmup=5, rep=rep)

        return graph, lambda fn: triton.testing.do_bench(fn, warmup=5, rep=rep)

    def wall(fn, n=2):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3

    return wall, wall


def sweep(shape: dict, ctx: int, batch_sizes, nd: int, fp8: bool, device: str, graph) -> dict:
    """Launch knobs per batch size, each component timed alone at ``ctx`` verify (graph replays): the indexer's
    tile, rows a dot, warps and programs per SM, the top-k's block and splits (1: a program per row, or from the
    shapes at 2 or 8 programs per SM), the MLA's head block, slot tile, latent split and splits (1 or 2 programs
    per SM, or at most 8)."""
    grids = {
        "indexer": [dict(block_n=bn, piece=pc, num_warps=nw, programs_per_sm=p)
                    for (bn, pc, nw), p in itertools.product(((64, 2, 4), (64, 1, 4), (128, 2, 8)), (4, 8))],
        "topk": [dict(block=b, num_warps=8, **split)
                 for b, split in itertools.product((1024, 4096), (dict(num_splits=1), dict(programs_per_sm=2),
                                                                  dict(programs_per_sm=8)))],
        "mla": [dict(block_h=bh, block_n=bn, lat_split=ls, **split)
                for (bh, bn, ls), split in itertools.product(((16, 64, 1), (64, 32, 1), (128, 32, 2)),
                                                             (dict(programs_per_sm=1), dict(programs_per_sm=2),
                                                              dict(max_splits=8)))],
    }
    if device != "cuda":
        grids = {k: v[:2] for k, v in grids.items()}
    chosen, results = {}, []
    for bs in batch_sizes:
        case = Case(shape, ctx, bs, nd + 1, fp8, device)
        case.layer({})
        best = {}
        for comp, grid in grids.items():
            for knobs in grid:
                kn = {comp: knobs}
                fn = {"indexer": lambda: case.indexer(kn), "topk": lambda: case.topk(kn),
                      "mla": lambda: case.mla(kn)}[comp]
                try:
                    ms, err = graph(fn), None
                except Exception as e:  # noqa: BLE001 - a tile that does not compile / fit is recorded, not fatal
                    ms, err = float("inf"), f"{type(e).__name__}: {str(e)[:160]}"
                results.append({"batch_size": bs, "component": comp, **knobs, "ms": round(ms, 4), "error": err})
                if ms < best.get(comp, (float("inf"),))[0]:
                    best[comp] = (ms, knobs)
        chosen[bs] = {comp: kn for comp, (_, kn) in best.items()}
        print(f"sweep bs={bs}: {chosen[bs]}", flush=True)
        case = None  # free its tensors before the next case
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"context": ctx, "chosen": chosen, "results": results}


MLA_TILES = [(16, 64, 1, 4, False), (16, 128, 1, 4, False), (32, 64, 1, 4, False), (32, 64, 2, 4, False),
             (64, 32, 1, 8, False), (64, 64, 1, 8, False), (128, 32, 2, 8, False),
             (16, 32, 1, 4, True), (16, 64, 1, 4, True), (32, 32, 1, 4, True), (32, 64, 1, 4, True),
             (32, 64, 2, 4, True),
             (64, 32, 1, 8, True), (64, 64, 2, 8, True)]  # (heads, slots, latent split, warps, heads on the N side)
MLA_SPLITS = [dict(programs_per_sm=1), dict(programs_per_sm=2), dict(programs_per_sm=4)]
MLA_KNOBS = ("block_h", "block_n", "lat_split", "num_warps", "heads_n", "programs_per_sm", "num_splits")


def mla_sweep(shape: dict, ctx: int, batch_sizes, nd: int, fp8: bool, device: str, graph) -> list[dict]:
    """The sparse MLA alone over every tile of ``MLA_TILES`` x split choice of ``MLA_SPLITS``, decode
    and verify rows at ``ctx`` (graph replays), each output checked against the fp32 reference (max abs diff)."""
    tiles = MLA_TILES if device == "cuda" else [(16, 16, 1, 4, False), (16, 16, 2, 4, True)]
    out = []
    for bs in batch_sizes:
        for mode, per_req in (("decode", 1), ("verify", nd + 1)):
            case = Case(shape, ctx, bs, per_req, fp8, device)
            case.layer({})
            ref = sm.sparse_mla_reference(case.ql.float(), case.qr.float(), case.cache.float(), case.slots,
                                          case.scale)
            default = graph(lambda: case.mla({}))
            best = None
            for (bh, bn, ls, nw, hn), split in itertools.product(tiles, MLA_SPLITS):
                kn = {"mla": dict(block_h=bh, block_n=bn, lat_split=ls, num_warps=nw, heads_n=hn, **split)}
                try:
                    ms = graph(lambda: case.mla(kn))
                    err = float((case.out.float() - ref).abs().max())
                    fail = None
                except Exception as e:  # noqa: BLE001 - a tile that does not compile / fit is recorded, not fatal
                    ms, err, fail = float("inf"), None, f"{type(e).__name__}: {str(e)[:120]}"
                rec = {"batch_size": bs, "mode": mode, "rows": case.rows, **kn["mla"], "ms": round(ms, 4),
                       "max_abs_diff": err, "error": fail}
                out.append(rec)
                if fail is None and (best is None or ms < best["ms"]):
                    best = rec
            if best is not None:  # the fastest setting again with the grid's former order (rows fastest): A/B
                kn = {"mla": {**{k: best[k] for k in MLA_KNOBS if k in best}, "row_fast": True}}
                out.append({**best, "row_fast": True, "ms": round(graph(lambda: case.mla(kn)), 4),
                            "max_abs_diff": float((case.out.float() - ref).abs().max())})
            print(f"mla sweep bs={bs} {mode}: default {default:.4f} ms, best {best}", flush=True)
            out.append({"batch_size": bs, "mode": mode, "rows": case.rows, "default": True, "ms": round(default, 4)})
            case = ref = None
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


# (keys a tile, warps, tiles fetched into L2 ahead)
INDEXER_TILES = [(64, 4, 2), (64, 4, 0), (64, 4, 4), (128, 4, 0), (128, 4, 2), (64, 8, 2)]
INDEXER_FILL = (4, 8, 16)  # programs an SM the splits aim at
INDEXER_KNOBS = ("block_n", "num_warps", "l2_ahead", "programs_per_sm")


def indexer_sweep(shape: dict, ctx: int, batch_sizes, nd: int, fp8: bool, device: str, graph) -> list[dict]:
    """The indexer alone over ``INDEXER_TILES`` x ``INDEXER_FILL``, decode and verify rows at ``ctx`` (graph
    replays), each one's scores checked against the launch default's (largest difference over the largest score)."""
    tiles = INDEXER_TILES if device == "cuda" else [(16, 4, 2), (16, 4, 0)]
    fills = INDEXER_FILL if device == "cuda" else (8,)
    out = []
    for bs in batch_sizes:
        for mode, per_req in (("decode", 1), ("verify", nd + 1)):
            case = Case(shape, ctx, bs, per_req, fp8, device)
            case.indexer({})
            visible = torch.arange(case.scores.shape[1], device=case.scores.device)[None, :] < case.row_len[:, None]
            ref = torch.where(visible, case.scores, 0.0)
            top = float(ref.abs().max()) or 1.0
            default = graph(lambda: case.indexer({}))
            first = len(out)
            for (bn, nw, ahead), fill in itertools.product(tiles, fills):
                kn = {"indexer": dict(block_n=bn, num_warps=nw, l2_ahead=ahead, programs_per_sm=fill)}
                try:
                    ms = graph(lambda: case.indexer(kn))
                    err, fail = float((torch.where(visible, case.scores, 0.0) - ref).abs().max()) / top, None
                except Exception as e:  # noqa: BLE001 - a tile that does not compile / fit is recorded, not fatal
                    ms, err, fail = float("inf"), None, f"{type(e).__name__}: {str(e)[:120]}"
                rec = {"batch_size": bs, "mode": mode, "rows": case.rows, **kn["indexer"], "ms": round(ms, 4),
                       "max_rel_diff": err, "error": fail}
                out.append(rec)
            out.append({"batch_size": bs, "mode": mode, "rows": case.rows, "default": True, "ms": round(default, 4)})
            print(f"indexer sweep bs={bs} {mode}: default {default:.4f} ms, chosen "
                  f"{indexer_choice(out[first:])[bs, mode] or 'the default'}", flush=True)
            case = ref = visible = None
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


def indexer_choice(records: list[dict]) -> dict:
    """(bs, mode) -> the knobs of ``indexer_sweep``'s fastest setting whose scores match the default's, or {} (the
    launch's default) where none is faster than the default's own timing (a tie keeps the default)."""
    default = {(r["batch_size"], r["mode"]): r["ms"] for r in records if r.get("default")}
    best = {key: (ms, {}) for key, ms in default.items()}
    for r in records:
        key = (r["batch_size"], r["mode"])
        if (not r.get("default") and r["error"] is None and r["max_rel_diff"] < 1e-2
                and r["ms"] < best.get(key, (float("inf"),))[0]):
            best[key] = (r["ms"], {k: r[k] for k in INDEXER_KNOBS})
    return {key: knobs for key, (_, knobs) in best.items()}


def sweep_cases(records: list[dict]):
    """Per (batch size, mode) of a sweep's records: (bs, mode, its records, the default's, the three fastest
    settings that ran, not the default nor an A/B rerun of the fastest)."""
    for bs, mode in dict.fromkeys((r["batch_size"], r["mode"]) for r in records):
        sel = [r for r in records if r["batch_size"] == bs and r["mode"] == mode]
        top = sorted((r for r in sel if not r.get("default") and not r.get("row_fast") and r["error"] is None),
                     key=lambda r: r["ms"])[:3]
        yield bs, mode, sel, next(r for r in sel if r.get("default")), top


def knobs_for(chosen: dict, bs: int) -> dict:
    if not chosen:
        return {}
    near = min(chosen, key=lambda b: (abs(b - bs), b))
    return chosen[near]


def draft_metadata(device: str, batch_sizes, steps: int, k: int, ctx: int, page: int, rounds: int) -> list[dict]:
    """Host time per draft round of the rows' metadata: ``SparseDraftRows`` filled once per round (one add and one
    page-row gather into static buffers; each step takes views) vs every step built from scratch
    (``draft_rows_per_step``: row_req, row_len, expanded page rows); and what the engine runs each eager round, the
    sparse backend's ``init_round_metadata`` over the round's stacked batch (``DraftSteps``, built outside the
    timing). Host time: the calls alone, each round started on an idle device; beside it the time until the device
    has run them too."""
    from attention.sparse_torch_native import SparseTorchNativeBackend
    from workers.forward_batch import DraftSteps
    from workers.kv_cache import MLAKVCache, PageTable
    from workers.messages import ForwardMode

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for bs in batch_sizes:
        pages = -(-(ctx + steps * k) // page)
        table = torch.randint(1, 1 << 20, (bs, pages), dtype=torch.int32, device=device)
        base = torch.full((bs,), ctx, dtype=torch.int32, device=device)
        rows = sm.SparseDraftRows(bs, k, steps, device, page_table=table)
        page_table = PageTable(bs, pages, page, device)
        page_table.table.copy_(table)
        rnd = DraftSteps.build(ForwardMode.DECODE, torch.arange(bs, device=device), base, k,
                               MLAKVCache(1, 1, page, 8, 16, torch.bfloat16, device), page_table, steps=steps,
                               positions=None if k == 1 else torch.zeros(steps, bs * k, dtype=torch.int64,
                                                                         device=device))
        backend = SparseTorchNativeBackend()

        def once():
            rows.fill(base)
            return [rows.step(i) for i in range(steps)]

        def per_step():
            return [sm.draft_rows_per_step(base, k, i, page_table=table) for i in range(steps)]

        def backend_round():
            backend.init_round_metadata(rnd)

        for i in range(steps):  # the same rows either way
            a, b = once()[i], per_step()[i]
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(rows.pages, b[2])
        times, done = {}, {}
        for name, fn in (("once_per_round", once), ("per_step", per_step),
                         ("backend_round", backend_round)) * 2:  # interleaved, second pass counts
            # host: the calls alone, each round from an idle device (the goal's host time); done: until the device
            # has run them too (a synchronisation's own latency included)
            host, total = [], []
            for _ in range(5):
                h = t = 0.0
                for _ in range(rounds):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    sync()
                    h, t = h + t1 - t0, t + time.perf_counter() - t0
                host.append(h / rounds * 1e6)
                total.append(t / rounds * 1e6)
            times[name], done[name] = statistics.median(host), statistics.median(total)
        captured = None
        if device == "cuda":  # the once-per-round fill replays from a graph with new base lengths
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                rows.fill(base)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                rows.fill(base)
            base.add_(7)
            g.replay()
            torch.cuda.synchronize()
            captured = bool(torch.equal(rows.step(steps - 1)[1], sm.draft_rows_per_step(base, k, steps - 1)[1]))
        out.append({"batch_size": bs, "steps": steps, "tokens_per_step": k,
                    "once_per_round_us": round(times["once_per_round"], 1), "per_step_us": round(times["per_step"], 1),
                    "speedup": round(times["per_step"] / times["once_per_round"], 2),
                    "backend_round_us": round(times["backend_round"], 1),
                    "done_us": {n: round(v, 1) for n, v in done.items()},
                    "graph_replay_equal": captured})
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/sparse_attention/sparse_attention_h100")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU through Triton's interpreter (smoke)")
    ap.add_argument("--contexts", default=None, help="default 16384,65536,131072 (--cpu: 200,300)")
    ap.add_argument("--batch-sizes", default=None, help="default 1,8,32 (--cpu: 1,2)")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--keys", choices=("fp8", "bf16"), default="fp8", help="indexer key cache of the main table")
    ap.add_argument("--mla-kernel", choices=("triton", "flashinfer"), default="triton",
                    help="the main table's MLA: ours, or FlashInfer's over the selected slots (the sparse_flashinfer "
                         "backend's long rows)")
    ap.add_argument("--dense-context", type=int, default=None, help="sparse vs dense verify here (default 65536)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--mla-sweep", action="store_true",
                    help="first the sparse MLA alone over tiles x splits at the dense context; the table's rows then "
                         "use each (batch, mode)'s fastest")
    ap.add_argument("--indexer-sweep", action="store_true",
                    help="first the indexer alone over tiles x programs an SM at the dense context; the table's rows "
                         "then use each (batch, mode)'s fastest")
    ap.add_argument("--bandwidth-tbps", type=float, default=None,
                    help="HBM bandwidth for the floor instead of measuring a device copy")
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    ap.add_argument("--metadata-only", action="store_true",
                    help="only the draft rows' host time (once per round vs per step), e.g. on a CPU")
    args = ap.parse_args()
    out = out_path(args.out)
    if args.report_only:
        report(json.loads(out.with_suffix(".json").read_text()), out)
        return
    device = "cpu" if args.cpu else "cuda"
    shape = SHAPES["cpu" if args.cpu else "gpu"]
    contexts = [int(x) for x in (args.contexts or ("200,300" if args.cpu else "16384,65536,131072")).split(",")]
    batch_sizes = [int(x) for x in (args.batch_sizes or ("1,2" if args.cpu else "1,8,32")).split(",")]
    dense_ctx = args.dense_context or (contexts[-1] if args.cpu else 65536)
    fp8, nd = args.keys == "fp8", args.draft_tokens
    if args.metadata_only:
        meta = {"device": device_name(device), "commit": commit(), "command": command(), "rows": [],
                "draft_metadata": draft_metadata(device, batch_sizes, steps=nd, k=1, ctx=contexts[-1],
                                                 page=shape["page"], rounds=50)}
        write_json(out, meta)
        report(meta, out)
        return
    graph, eager = timer(device)
    if args.bandwidth_tbps:
        bw, bw_note = args.bandwidth_tbps * 1e12, f"given: {args.bandwidth_tbps} TB/s"
    elif device == "cuda":
        bw = copy_bandwidth()
        bw_note = "measured: device copy, bytes read + written per second"
    else:
        bw, bw_note = H100_SXM_TBPS * 1e12, f"nominal H100 SXM {H100_SXM_TBPS} TB/s (CPU smoke run)"
    meta = {"device": device_name(device), "commit": commit(), "command": command(), "shape": shape,
            "keys": args.keys, "mla_kernel": args.mla_kernel, "draft_tokens": nd,
            "bandwidth_GBps": round(bw / 1e9, 1), "bandwidth": bw_note,
            "timing": "graph: CUDA graph replay (captured with PDL), L2 flushed before each (do_bench); eager: "
                      "Python launches"
            if device == "cuda" else "CPU interpreter wall time (smoke: not a measurement)"}
    if device == "cuda":
        rates = matmul_rates()
    else:  # the smoke run's floors: H100 SXM's dense datasheet rates
        rates = {"bf16": H100_BF16_TFLOPS * 1e12, "fp8": 2 * H100_BF16_TFLOPS * 1e12, "note": "nominal (CPU smoke)"}
    meta["matmul_TFLOPs"] = {k: round(v / 1e12, 1) if isinstance(v, float) else v for k, v in rates.items()}
    print(meta, flush=True)
    meta["sweep"] = None if args.no_sweep else sweep(shape, dense_ctx, batch_sizes, nd, fp8, device,
                                                     timer(device, rep=20)[0])
    if args.mla_sweep:
        meta["mla_sweep"] = mla_sweep(shape, dense_ctx, batch_sizes, nd, fp8, device, timer(device, rep=20)[0])
        write_json(out, meta)
    if args.indexer_sweep:
        meta["indexer_sweep"] = indexer_sweep(shape, dense_ctx, batch_sizes, nd, fp8, device,
                                              timer(device, rep=20)[0])
        write_json(out, meta)
    chosen = meta["sweep"]["chosen"] if meta["sweep"] else {}
    # (bs, mode) -> the MLA sweep's fastest knobs, which the table's rows then use
    mla_best = {}
    for r in meta.get("mla_sweep") or []:
        key = (r["batch_size"], r["mode"])
        if (not r.get("default") and not r.get("row_fast") and r["error"] is None
                and r["ms"] < mla_best.get(key, (float("inf"),))[0]):
            mla_best[key] = (r["ms"], {k: r[k] for k in MLA_KNOBS if k in r})
    indexer_best = indexer_choice(meta.get("indexer_sweep") or [])
    rows = meta["rows"] = []
    for ctx in contexts:
        for bs in batch_sizes:
            for mode, per_req in (("decode", 1), ("verify", nd + 1)):
                knobs = knobs_for(chosen, bs)
                if (bs, mode) in mla_best:
                    knobs = {**knobs, "mla": mla_best[(bs, mode)][1]}
                if (bs, mode) in indexer_best:
                    knobs = {**knobs, "indexer": indexer_best[(bs, mode)]}
                case = Case(shape, ctx, bs, per_req, fp8, device, mla_kernel=args.mla_kernel)
                ref_check = None
                case.layer(knobs)
                if ctx == contexts[0] and bs == batch_sizes[0]:  # the kernels against the references once per mode
                    ref = sm.indexer_topk_reference(case.q_idx, case.w, case.keys, case.table, case.row_req,
                                                    case.row_len, shape["page"], shape["topk"], fp8=fp8)
                    got = case.slots.sort(1).values
                    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, ref)) / ref.numel()
                    mla_ref = sm.sparse_mla_reference(case.ql.float(), case.qr.float(), case.cache.float(),
                                                      case.slots, case.scale)
                    ref_check = {"topk_overlap_vs_reference": round(overlap, 4),
                                 "mla_max_abs_diff_vs_fp32_reference": float((case.out.float() - mla_ref).abs().max())}
                t = {"indexer": graph(lambda: case.indexer(knobs)), "topk": graph(lambda: case.topk(knobs)),
                     "mla": graph(lambda: case.mla(knobs)), "layer": graph(lambda: case.layer(knobs)),
                     "layer_eager": eager(lambda: case.layer(knobs))}
                if fp8:
                    t["indexer_bf16_keys"] = graph(lambda: case.indexer(knobs, bf16_keys=True))
                if per_req > 1:  # the rows of a request each reading its keys (one row a program)
                    t["indexer_per_row"] = graph(lambda: case.indexer(knobs, per_row=True))
                key_b, lat_b = case.floor_bytes()
                floor_ms = (key_b + lat_b) / bw * 1e3
                if device == "cuda":  # the layer's chain of kernels, empty: what its launches alone cost
                    n_kernels = count_kernels(lambda: case.layer(knobs))
                    t["launch_floor"] = launch_floor(n_kernels, graph)
                floors = physical_floors(case, key_b, lat_b, bw, rates, fp8, t.get("launch_floor", 0.0))
                row = {"context": ctx, "batch_size": bs, "mode": mode, "rows": case.rows,
                       **{f"{k}_ms": round(v, 4) for k, v in t.items()},
                       "floor_ms": round(floor_ms, 5), "vs_floor": round(t["layer"] / floor_ms, 2),
                       **{k: round(v, 5) if isinstance(v, float) else v for k, v in floors.items()},
                       "vs_attainable": round(t["layer"] / floors["attainable_floor_ms"], 2),
                       "vs_stage_floor": round(t["layer"] / floors["stage_floor_ms"], 2),
                       "indexer_vs_floor": round(t["indexer"] / floors["indexer_floor_ms"], 2),
                       "mla_vs_floor": round(t["mla"] / floors["mla_floor_ms"], 2),
                       **({"kernels": n_kernels, "vs_launch_floor": round(t["layer"] / t["launch_floor"], 2)}
                          if "launch_floor" in t else {}),
                       "graph_speedup_vs_eager": round(t["layer_eager"] / t["layer"], 2),
                       "index_key_MB": round(key_b / 1e6, 2), "selected_latent_MB": round(lat_b / 1e6, 2),
                       "knobs": knobs, **({"reference_check": ref_check} if ref_check else {})}
                if ctx == dense_ctx and mode == "verify":
                    dense_slots = case.all_slots()
                    # the dense launch's own splits: the sparse launch's knobs are tuned for 2048 slots a row
                    dense = graph(lambda: case.mla({}, slots=dense_slots))
                    row.update({"dense_mla_ms": round(dense, 4),
                                "sparse_vs_dense_layer": round(dense / t["layer"], 2),
                                "sparse_vs_dense_mla_only": round(dense / t["mla"], 2)})
                    del dense_slots
                rows.append(row)
                print(row, flush=True)
                write_json(out, meta)
                case = None  # free its tensors before the next case
                if device == "cuda":
                    torch.cuda.empty_cache()
    try:
        meta["draft_metadata"] = draft_metadata(device, batch_sizes, steps=nd, k=1, ctx=contexts[-1],
                                                page=shape["page"], rounds=50 if device == "cuda" else 5)
    except ImportError as e:  # the engine's modules need the server's packages (pydantic); the kernels do not
        meta["draft_metadata"], meta["draft_metadata_skipped"] = [], f"{type(e).__name__}: {e}"
    write_json(out, meta)
    report(meta, out)


def report(meta: dict, out: Path) -> None:
    rows = meta["rows"]
    md = [f"# DeepSeek-V3.2 sparse attention, one layer ({meta['device']})", "",
          f"commit `{meta['commit']}`, command `{meta['command']}`", ""]
    if rows:
        mla = meta.get("mla_kernel", "triton")
        md += [f"Shape {meta['shape']}; indexer keys {meta['keys']}; MLA kernel "
               + ("FlashInfer's (over the selected slots, planned once per row count; ours for one row)"
                  if mla == "flashinfer" else "ours (Triton)") + "; "
               f"{meta['draft_tokens']} draft tokens (verify: "
               f"{meta['draft_tokens'] + 1} query rows a request, decode: 1). Bandwidth {meta['bandwidth_GBps']} "
               f"GB/s ({meta['bandwidth']}). Timing: {meta['timing']}.", "",
               "Floor: every request's indexer keys up to its longest row + the latents its rows selected (the "
               "union, bf16 latent + rope), each read once at that bandwidth. Launch floor: the layer's number of "
               "kernels (counted by the profiler), each empty, one program per SM, chained with PDL in one graph "
               "and replayed the same way: no layer of that many kernels can be faster. Times in ms per layer.", "",
               "| context | bs | mode | rows | indexer | top-k | sparse MLA | layer (graph) | floor | vs floor | "
               "kernels | launch floor | vs launch floor | "
               "layer (eager) | graph speedup | indexer, bf16 keys | indexer, one row a program | key MB | "
               "latent MB |",
               "|---" * 19 + "|"]
    md += [f"| {r['context']} | {r['batch_size']} | {r['mode']} | {r['rows']} | {r['indexer_ms']} | {r['topk_ms']} | "
           f"{r['mla_ms']} | {r['layer_ms']} | {r['floor_ms']} | **{r['vs_floor']}x** | {r.get('kernels', '')} | "
           f"{r.get('launch_floor_ms', '')} | {r.get('vs_launch_floor', '')} | {r['layer_eager_ms']} | "
           f"{r['graph_speedup_vs_eager']}x | {r.get('indexer_bf16_keys_ms', '')} | {r.get('indexer_per_row_ms', '')} | "
           f"{r['index_key_MB']} | "
           f"{r['selected_latent_MB']} |" for r in rows]
    phys = [r for r in rows if "attainable_floor_ms" in r]
    if phys:
        rt = meta.get("matmul_TFLOPs", {})
        md += ["", "## Against what physics allows", "",
               f"Matmul rates (n = 8192, measured in this run unless noted): bf16 {rt.get('bf16')} TFLOP/s, FP8 "
               f"{rt.get('fp8')} TFLOP/s{' (' + rt['note'] + ')' if rt.get('note') else ''}. Compute floor: the "
               "indexer's FLOPs (each row's queries against its visible keys) at the FP8 rate + the MLA's (each "
               "row's 128 heads over its selected slots, QK over 576 + PV over 512) at the bf16 rate. Attainable: "
               "max(read, compute, launch), everything overlapped. Stage floor: the dependent stages in series, "
               "max(launch, max(key read, indexer FLOPs) + max(latent read, MLA FLOPs)). The goal (<= 1.3x the "
               "read floor) is reachable only where the attainable (resp. stage) floor is <= 1.3x the read floor. "
               "Indexer / MLA: each kernel alone vs max(its reads, its FLOPs). Times in ms.", "",
               "| context | bs | mode | layer | read floor | compute floor (indexer + MLA) | launch floor | attainable "
               "| bound | vs attainable | goal reachable (attainable / stages) | stage floor | vs stage floor | "
               "indexer vs its floor | MLA vs its floor |",
               "|---" * 15 + "|"]
        md += [f"| {r['context']} | {r['batch_size']} | {r['mode']} | {r['layer_ms']} | {r['floor_ms']} | "
               f"{r['compute_floor_ms']} ({r['indexer_compute_ms']} + {r['mla_compute_ms']}) | "
               f"{r.get('launch_floor_ms', '')} | {r['attainable_floor_ms']} | {r['bound']} | "
               f"**{r['vs_attainable']}x** | "
               f"{'yes' if r['attainable_floor_ms'] <= 1.3 * r['floor_ms'] else 'no'} / "
               f"{'yes' if r['stage_floor_ms'] <= 1.3 * r['floor_ms'] else 'no'} | {r['stage_floor_ms']} | "
               f"{r['vs_stage_floor']}x | {r['indexer_vs_floor']}x | {r['mla_vs_floor']}x |" for r in phys]
    dense = [r for r in rows if "dense_mla_ms" in r]
    if dense:
        md += ["", f"## Sparse vs dense MLA verify at {dense[0]['context']}", "",
               "Dense: the same sparse MLA kernel given every slot of each row's context (no indexer, no top-k).", "",
               "| bs | rows | dense MLA | sparse layer (indexer + top-k + MLA) | speedup | sparse MLA only | speedup |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {r['batch_size']} | {r['rows']} | {r['dense_mla_ms']} | {r['layer_ms']} | "
               f"**{r['sparse_vs_dense_layer']}x** | {r['mla_ms']} | {r['sparse_vs_dense_mla_only']}x |" for r in dense]
    dm = meta.get("draft_metadata") or []
    if dm:
        md += ["", "## Draft-round row metadata: once per round vs per step (host µs a round)", "",
               "`SparseDraftRows.fill` (static buffers, every step's rows at once) vs `draft_rows_per_step` for each "
               "step (row_req, row_len, expanded page rows); the engine's round: the sparse backend's "
               "`init_round_metadata` over the round's stacked batch. Host: the calls alone, each round from an idle "
               "device; in brackets, until the device has run them too, a synchronisation included (files without "
               "the brackets measured that alone).", "",
               "| bs | steps | once per round | per step | speedup | engine's round (backend) | "
               "fill replayed from a graph equal |",
               "|---|---|---|---|---|---|---|"]

        def with_done(d, name, key):  # (host time, and in brackets the time to completion where the file has it)
            done = d.get("done_us", {}).get(name)
            return f"{d[key]}" + ("" if done is None else f" ({done})")
        md += [f"| {d['batch_size']} | {d['steps']} | {with_done(d, 'once_per_round', 'once_per_round_us')} | "
               f"{with_done(d, 'per_step', 'per_step_us')} | **{d['speedup']}x** | "
               f"{with_done(d, 'backend_round', 'backend_round_us') if 'backend_round_us' in d else '-'} | "
               f"{d['graph_replay_equal']} |" for d in dm]
    ms = meta.get("mla_sweep") or []
    if ms:
        md += ["", "## Sparse MLA alone: tiles x splits", "",
               "Graph replays of the MLA alone at the dense context; the default launch, and the three fastest "
               "settings that compiled (max abs diff vs the fp32 reference beside each). The tables above use each "
               "(bs, mode)'s fastest at every context (their rows' `knobs` in the JSON).", "",
               "| bs | mode | rows | default | fastest | 2nd | 3rd | fastest, rows fastest in the grid (former order) |",
               "|---|---|---|---|---|---|---|---|"]
        for bs, mode, sel, dflt, top in sweep_cases(ms):
            former = next((r["ms"] for r in sel if r.get("row_fast")), "")
            cell = ["{ms} ({block_h}x{block_n}, ls {lat_split}, w {num_warps}, ".format(**r)
                    + ("heads on N, " if r.get("heads_n") else "")
                    + ", ".join(f"{k} {r[k]}" for k in ("programs_per_sm", "num_splits") if k in r)
                    + f"; diff {r['max_abs_diff']:.1e})" for r in top]
            md.append(f"| {bs} | {mode} | {dflt['rows']} | {dflt['ms']} | " + " | ".join(cell) + f" | {former} |")
    ix = meta.get("indexer_sweep") or []
    if ix:
        md += ["", "## Indexer alone: tiles x programs an SM", "",
               "Graph replays of the indexer alone at the dense context; the default launch and the three fastest "
               "settings whose scores match the default's (largest difference over the largest score beside "
               "each). The tables above use each (bs, mode)'s fastest at every context.", "",
               "| bs | mode | rows | default | fastest | 2nd | 3rd |", "|---|---|---|---|---|---|---|"]
        for bs, mode, _, dflt, top in sweep_cases(ix):
            # (the sweeps before l2_ahead: none, or a ``prefetch`` knob)
            cell = [f"{r['ms']} ({r['block_n']} keys, w {r['num_warps']}, "
                    + (f"{r['l2_ahead']} into L2 ahead, " if "l2_ahead" in r else
                       f"prefetch {r['prefetch']}, " if "prefetch" in r else "")
                    + f"{r['programs_per_sm']} an SM; diff {r['max_rel_diff']:.1e})" for r in top]
            md.append(f"| {bs} | {mode} | {dflt['rows']} | {dflt['ms']} | " + " | ".join(cell) + " |")
    checks = [r for r in rows if "reference_check" in r]
    if checks:
        md += ["", "Reference checks (first case of each mode): "
               + "; ".join(f"{r['mode']}: {r['reference_check']}" for r in checks)]
    if meta.get("sweep"):
        md += ["", f"Launch knobs per batch size (swept at {meta['sweep']['context']} verify, each component "
               f"alone): {meta['sweep']['chosen']}"]
    write_markdown(out, md)
    if not rows:
        return
    try:
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, mode in zip(axes, ("decode", "verify")):
            for bs in sorted({r["batch_size"] for r in rows}):
                sel = [r for r in rows if r["batch_size"] == bs and r["mode"] == mode]
                xs = [r["context"] for r in sel]
                line = ax.plot(xs, [r["layer_ms"] for r in sel], "o-", label=f"bs={bs} layer")[0]
                ax.plot(xs, [r["floor_ms"] for r in sel], ":", color=line.get_color(), label=f"bs={bs} floor")
                ax.plot(xs, [r["topk_ms"] for r in sel], "x--", color=line.get_color(), alpha=0.5,
                        label=f"bs={bs} top-k")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("context")
            ax.set_ylabel("ms per layer")
            ax.set_title(f"{mode}: indexer + top-k + sparse MLA (graph replays)", fontsize=9)
            ax.legend(fontsize=6)
        fig.suptitle(f"{meta['device']} {meta['commit']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
