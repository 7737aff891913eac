"""#40's layer beside the kernels vLLM runs it with on Hopper, same device, same shapes, same floors.

vLLM 0.26 serves DeepSeek-V3.2 on an H100 with DeepGEMM's ``fp8_fp4_paged_mqa_logits`` (the indexer's scores over
FP8 keys in pages of 64, the same 132-byte layout as ours), its own radix top-k (``_C.persistent_topk``; see
``Peer.topk``), a positions-to-slots step (here ours: vLLM has its own kernel for it), and FlashMLA's
``sparse_decode_fwd`` over an FP8 latent cache (656 bytes a token: 512 e4m3 values, four fp32 scales, the 64 rope
values in bf16). Verify rows run as vLLM runs them on sm90: each row its own one-token entry. This times each of
them and their chain in one CUDA graph, beside ``bench.sparse_attention``'s ``Case`` (our indexer, top-k and sparse
MLA over bf16 latents), and puts both against that bench's floors: the issue's read floor (keys over the context +
the selected latents as we store them, bf16, read once), the read floor of the peer's own bytes (FP8 latents), and
the attainable floor max(read, compute, launch).

The peer's kernels come from vLLM's wheel (nothing of vLLM is imported): ``--peer-dir`` holds its
``vllm/_C_stable_libtorch.abi3.so``, ``vllm/_flashmla_C.abi3.so`` and ``vllm/third_party/deep_gemm`` (which compiles
its kernels with nvcc at first use). Each peer stage is checked once per mode against a torch reference on the same
bytes (scores, the top-k's set, the MLA's output).

    python3 -m bench.sparse_attention_peers --peer-dir /tmp/peerk --out bench/results/sparse_attention/peers_h100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.common import command, commit, copy_bandwidth, device_name, out_path, write_json, write_markdown
from bench.sparse_attention import SHAPES, Case, count_kernels, knobs_for, launch_floor, matmul_rates, \
    physical_floors, timer
from workers.kernels import sparse_mla as sm

TOPK_WORKSPACE = 1 << 20  # bytes: vLLM's RADIX_TOPK_WORKSPACE_SIZE
FLASHMLA_TOKEN_BYTES = 656


class Peer:
    """vLLM's kernels for one ``Case``: their inputs built from the case's own tensors (the same keys, queries and
    pages), their outputs preallocated so that the chain captures into one graph."""

    def __init__(self, case: Case, dg, num_sms: int):
        s, self.case, self.dg = case.shape, case, dg
        page, rows = s["page"], case.rows
        pages = case.table.numel() + 1
        self.keys = case.keys.view(pages, page, 1, s["index_dim"] + 4)  # (ours is DeepGEMM's page layout)
        # every query row its own entry of one token, as vLLM runs verify rows on sm90 (DeepGEMM's paged logits
        # take 1 or 2 tokens a request there): its own length, its request's pages
        self.table = case.table[case.row_req.long()].contiguous()
        self.q_idx = case.q_idx.float().to(torch.float8_e4m3fn).view(rows, 1, s["index_heads"], s["index_dim"])
        self.w = case.w.float().contiguous()
        self.lens = case.row_len.view(rows, 1).contiguous()
        self.max_len = case.table.shape[1] * page
        self.schedule = dg.get_paged_mqa_logits_metadata(self.lens, page, num_sms)
        self.pos = torch.empty(case.rows, s["topk"], dtype=torch.int32, device="cuda")
        self.workspace = torch.zeros(TOPK_WORKSPACE, dtype=torch.uint8, device="cuda")
        self.slots = torch.empty_like(self.pos)
        self.logits = None
        # FlashMLA's cache: the case's latents as e4m3 with a scale per 128 values, rope kept in bf16 (in chunks:
        # at 128k x 32 the fp32 temporaries of the whole cache would not fit beside it)
        self.kv = torch.empty(pages * page, FLASHMLA_TOKEN_BYTES, dtype=torch.uint8, device="cuda")
        for a in range(0, pages * page, 1 << 20):
            chunk = case.cache[a:a + (1 << 20)]
            blocks = chunk[:, :s["latent"]].float().view(-1, s["latent"] // 128, 128)
            scale = (blocks.abs().amax(-1) / 448.0).clamp_min(1e-10)
            q8 = (blocks / scale[..., None]).to(torch.float8_e4m3fn)
            self.kv[a:a + len(chunk)] = torch.cat([q8.view(torch.uint8).view(len(chunk), -1), scale.view(torch.uint8),
                                                   chunk[:, s["latent"]:].contiguous().view(torch.uint8)], 1)
        self.kv = self.kv.view(pages, page, 1, FLASHMLA_TOKEN_BYTES)
        self.q = torch.cat([case.ql, case.qr], -1).view(rows, 1, s["mla_heads"], s["latent"] + s["rope"])
        self.out = torch.empty(rows, 1, s["mla_heads"], s["latent"], dtype=case.ql.dtype, device="cuda")
        self.sched = self.splits = None

    def indexer(self):
        self.logits = self.dg.fp8_fp4_paged_mqa_logits((self.q_idx, None), self.keys, self.w, self.lens,
                                                       self.table, self.schedule, self.max_len,
                                                       clean_logits=False)
        return self.logits

    def topk(self):
        # vLLM's sm90 path takes ``_C.cooperative_topk`` up to 32 rows, which does not capture into a graph here;
        # ``_C.persistent_topk`` (its path for more rows) does, and was the faster of the two eagerly at 8 rows
        torch.ops._C.persistent_topk(self.logits, self.lens, self.pos, self.workspace, self.case.shape["topk"],
                                     self.logits.shape[1])
        return self.pos

    def convert(self):
        self.slots.copy_(sm.positions_to_slots(self.pos, self.case.table, self.case.row_req, self.case.shape["page"]))
        return self.slots

    def mla(self):
        s = self.case.shape
        idx = self.slots.view(self.case.rows, 1, s["topk"])
        out, _, sched, splits = torch.ops._flashmla_C.sparse_decode_fwd(
            self.q, self.kv, idx, None, None, self.sched, self.splits, None, None, None, s["latent"],
            self.case.scale, self.out)
        if self.sched is None:  # the first call plans the tile schedule; later calls (and the graph) reuse it
            self.sched, self.splits = sched, splits
        return out

    def layer(self):
        self.indexer()
        self.topk()
        self.convert()
        return self.mla()

    def check(self) -> dict:
        """Each stage against torch on the same bytes: scores (rows' visible positions), the top-k's set vs
        ``torch.topk`` of the peer's own scores, the MLA vs the fp32 reference over the dequantized FP8 cache."""
        c, s = self.case, self.case.shape
        self.layer()
        torch.cuda.synchronize()
        keys = sm.dequantize_index_keys(c.keys, s["page"], s["index_dim"])  # [slots, dim] fp32
        cap = c.table.shape[1] * s["page"]
        t = torch.arange(cap, device="cuda")
        slot = c.table[c.row_req.long()].long()[:, t // s["page"]] * s["page"] + t % s["page"]  # [R, cap]
        q8 = self.q_idx.float().view(c.rows, s["index_heads"], s["index_dim"])
        ref = torch.einsum("rhd,rtd->rht", q8, keys[slot]).relu().mul(self.w[:, :, None]).sum(1)
        vis = t[None, :] < c.row_len[:, None]
        got = self.logits[:, :cap]
        err = torch.where(vis, got - ref, 0).abs().max() / torch.where(vis, ref, 0).abs().max()
        masked = got.masked_fill(~vis, float("-inf"))
        want = masked.topk(s["topk"], dim=1).indices
        overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(self.pos, want)) / want.numel()
        lat = s["latent"]
        raw = self.kv.view(-1, FLASHMLA_TOKEN_BYTES)[self.slots.long().clamp_min(0)]  # [R, K, 656]
        scale = raw[..., lat:lat + 16].contiguous().view(torch.float32)  # [R, K, 4]
        values = raw[..., :lat].contiguous().view(torch.float8_e4m3fn).float().view(*raw.shape[:2], -1, 128)
        rope = raw[..., lat + 16:].contiguous().view(torch.bfloat16).float()
        sel = torch.cat([(values * scale[..., None]).flatten(-2), rope], -1)  # the dequantized rows they read
        at = torch.arange(self.slots.numel(), device="cuda", dtype=torch.int32).view_as(self.slots)
        mla_ref = sm.sparse_mla_reference(c.ql.float(), c.qr.float(), sel.view(-1, sel.shape[-1]),
                                          torch.where(self.slots >= 0, at, -1), c.scale)
        mla_err = (self.out.view_as(mla_ref).float() - mla_ref).abs().max() / mla_ref.abs().max()
        return {"scores_max_rel_err": round(float(err), 5), "topk_overlap_vs_torch_topk": round(overlap, 4),
                "mla_max_rel_err_vs_fp32": round(float(mla_err), 5)}


def load_peer(root: Path):
    torch.ops.load_library(str(root / "vllm/_C_stable_libtorch.abi3.so"))
    torch.ops.load_library(str(root / "vllm/_flashmla_C.abi3.so"))
    sys.path.insert(0, str(root / "vllm/third_party"))  # (DeepGEMM's package imports itself relatively)
    import deep_gemm

    return deep_gemm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-dir", required=True, help="unpacked vLLM kernels (see the module's docstring)")
    ap.add_argument("--out", default="bench/results/sparse_attention/peers_h100")
    ap.add_argument("--contexts", default="16384,65536,131072")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out = out_path(args.out)
    if args.report_only:
        report(json.loads(out.with_suffix(".json").read_text()), out)
        return
    shape, nd = SHAPES["gpu"], args.draft_tokens
    graph, eager = timer("cuda")
    bw, rates = copy_bandwidth(), matmul_rates()
    dg = load_peer(Path(args.peer_dir))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = {"device": device_name("cuda"), "commit": commit(), "command": command(), "shape": shape,
            "draft_tokens": nd, "bandwidth_GBps": round(bw / 1e9, 1),
            "matmul_TFLOPs": {k: round(v / 1e12, 1) for k, v in rates.items() if isinstance(v, float)},
            "timing": "CUDA graph replay (and eager launches), L2 flushed before each (do_bench)", "rows": []}
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    for ctx in [int(x) for x in args.contexts.split(",")]:
        for bs in batch_sizes:
            for mode, per_req in (("decode", 1), ("verify", nd + 1)):
                case = Case(shape, ctx, bs, per_req, True, "cuda")
                knobs = knobs_for({}, bs)
                case.layer(knobs)
                peer = Peer(case, dg, sms)
                row = {"context": ctx, "batch_size": bs, "mode": mode, "rows": case.rows}
                try:
                    if bs == batch_sizes[0]:  # (each context and mode once)
                        row["peer_check"] = peer.check()
                    t = {"ours_indexer": graph(lambda: case.indexer(knobs)),
                         "ours_topk": graph(lambda: case.topk(knobs)), "ours_mla": graph(lambda: case.mla(knobs)),
                         "ours_layer": graph(lambda: case.layer(knobs)),
                         "ours_layer_eager": eager(lambda: case.layer(knobs)),
                         "peer_indexer": graph(peer.indexer), "peer_topk": graph(peer.topk),
                         "peer_convert": graph(peer.convert), "peer_mla": graph(peer.mla),
                         "peer_layer": graph(peer.layer), "peer_layer_eager": eager(peer.layer)}
                    key_b, lat_b = case.floor_bytes()
                    own_lat_b = lat_b // (2 * (shape["latent"] + shape["rope"])) * FLASHMLA_TOKEN_BYTES
                    n_ours, n_peer = count_kernels(lambda: case.layer(knobs)), count_kernels(peer.layer)
                    t["launch_floor_ours"] = launch_floor(n_ours, graph)
                    t["launch_floor_peer"] = launch_floor(n_peer, graph)
                    floors = physical_floors(case, key_b, lat_b, bw, rates, True, t["launch_floor_ours"])
                    read = (key_b + lat_b) / bw * 1e3
                    peer_read = (key_b + own_lat_b) / bw * 1e3
                    row.update({**{f"{k}_ms": round(v, 4) for k, v in t.items()},
                                "read_floor_ms": round(read, 5), "peer_own_read_floor_ms": round(peer_read, 5),
                                "attainable_floor_ms": round(floors["attainable_floor_ms"], 5),
                                "kernels_ours": n_ours, "kernels_peer": n_peer,
                                "ours_vs_read_floor": round(t["ours_layer"] / read, 2),
                                "peer_vs_read_floor": round(t["peer_layer"] / read, 2),
                                "peer_vs_own_read_floor": round(t["peer_layer"] / peer_read, 2),
                                "ours_vs_attainable": round(t["ours_layer"] / floors["attainable_floor_ms"], 2),
                                "peer_vs_attainable": round(t["peer_layer"] / max(
                                    floors["attainable_floor_ms"], peer_read, t["launch_floor_peer"]), 2),
                                "peer_over_ours": round(t["peer_layer"] / t["ours_layer"], 3),
                                "peer_over_ours_eager": round(t["peer_layer_eager"] / t["ours_layer_eager"], 3)})
                except Exception as e:  # noqa: BLE001 - recorded: a peer kernel refusing a shape is a result too
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                meta["rows"].append(row)
                print(row, flush=True)
                write_json(out, meta)
                case = peer = None
                torch.cuda.empty_cache()
    report(meta, out)


def report(meta: dict, out: Path) -> None:
    lines = [f"# #40's layer vs vLLM 0.26's kernels (DeepGEMM + vLLM top-k + FlashMLA), {meta['device']}", "",
             f"commit {meta['commit']}; `{meta['command']}`; {meta['timing']}; copy bandwidth "
             f"{meta['bandwidth_GBps']} GB/s; matmul TFLOP/s {meta['matmul_TFLOPs']}.", "",
             "read floor: indexer keys over the context + the selected latents in bf16 (ours), read once; peer's own: "
             "the same with FlashMLA's 656-byte FP8 latents. Times in ms, one layer.", "",
             "| ctx | bs | mode | ours: indexer / top-k / MLA = layer (eager) | peer: indexer / top-k / "
             "convert / MLA = layer (eager) | read floor (peer's own) | ours vs floor | peer vs floor (own) "
             "| peer / ours "
             "(eager) | check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in meta["rows"]:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['batch_size']} | {r['mode']} | | | | | | | {r['error'][:120]} |")
            continue
        chk = r.get("peer_check", "")
        lines.append(
            f"| {r['context']} | {r['batch_size']} | {r['mode']} | {r['ours_indexer_ms']} / {r['ours_topk_ms']} / "
            f"{r['ours_mla_ms']} = **{r['ours_layer_ms']}** ({r['ours_layer_eager_ms']}) | "
            f"{r['peer_indexer_ms']} / {r['peer_topk_ms']} / "
            f"{r['peer_convert_ms']} / {r['peer_mla_ms']} = **{r['peer_layer_ms']}** ({r['peer_layer_eager_ms']}) | "
            f"{r['read_floor_ms']} "
            f"({r['peer_own_read_floor_ms']}) | {r['ours_vs_read_floor']}x | {r['peer_vs_read_floor']}x "
            f"({r['peer_vs_own_read_floor']}x) | {r['peer_over_ours']} ({r['peer_over_ours_eager']}) | {chk} |")
    write_markdown(out, lines)
    try:
        from bench.common import pyplot

        plt = pyplot()
    except ImportError:
        return
    ok = [r for r in meta["rows"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['context'] // 1024}k b{r['batch_size']} {r['mode'][0]}" for r in ok]
    x = range(len(ok))
    ax.bar([i - 0.2 for i in x], [r["ours_vs_read_floor"] for r in ok], 0.4, label="ours")
    ax.bar([i + 0.2 for i in x], [r["peer_vs_read_floor"] for r in ok], 0.4, label="vLLM kernels")
    ax.axhline(1.3, color="k", ls="--", lw=0.8, label="goal 1.3x")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels, rotation=70, fontsize=7)
    ax.set_ylabel("layer / read floor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
