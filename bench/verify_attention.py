"""Verify attention on the GPU: decode-style split-KV kernel vs the prefill-style launch of the same kernel family,
and vs the KV-read floor (KV bytes ÷ device copy bandwidth measured in the same run). Llama-3.1-8B head shape
(32 query heads, 8 KV heads, head dim 128), bf16, one layer, paged KV (page 16), chain verify.

``--backend flashinfer`` times FlashInfer's kernels as the engine's flashinfer backend runs them: decode-style is
the XQA kernel (device lengths, as in CUDA-graph rounds), prefill-style the BatchPrefillWithPagedKVCacheWrapper
(verify_attention_mode "prefill"), and a third launch, the BatchDecodeWithPagedKVCacheWrapper with tensor cores and
q_len_per_req = draft tokens (decode mode with host lengths, as without graphs).

Each launch is timed two ways: called eagerly (Python launches of the split and merge kernels, as without CUDA
graphs) and replayed from a CUDA graph, which is how the engine runs TARGET_VERIFY; the sweep tunes on graph replays.

    python3 -m bench.verify_attention --out bench/results/attention/verify_attention_h100
    python3 -m bench.verify_attention --layers --backend flashinfer \
        --out bench/results/attention/verify_attention_flashinfer_layers_h100

Writes <out>.json, <out>.md, <out>.png with device, commit and command.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from attention.base import AttentionLayerSpec
from attention.registry import _make
from bench.common import (command, commit, copy_bandwidth, device_name, graph_ms, graph_replay_ms, out_path, pyplot,
                          write_json, write_markdown)
from workers.forward_batch import ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode

LAUNCH_KNOBS = ("block_n", "num_warps", "num_stages", "decode_launch")


def verify_case(ctx: int, bs: int, nd: int, heads: int, kv_heads: int, dim: int, page: int, layers: int = 1):
    """A verify batch of ``bs`` requests at context ``ctx`` with ``nd`` draft tokens, KV pages scattered (the same
    pages in each of ``layers`` layers' caches); its lengths are on the host too (see ``device_lengths``)."""
    pages_per = -(-(ctx + 16) // page)
    kv = KVCache(layers, bs * pages_per + 1, page, kv_heads, dim, torch.bfloat16, "cuda")
    for i in range(layers):
        kv.k[i].normal_()
        kv.v[i].normal_()
    table = PageTable(bs, pages_per, page, "cuda")
    table.table.copy_((torch.randperm(bs * pages_per) + 1).view(bs, pages_per).to(torch.int32))
    fb = ForwardBatch.build(ForwardMode.TARGET_VERIFY, torch.zeros(bs * nd, dtype=torch.int64),
                            list(range(bs)), [ctx] * bs, [nd] * bs, kv, table)
    q = torch.randn(bs * nd, heads, dim, dtype=torch.bfloat16, device="cuda")
    return fb, q


def device_lengths(fb: ForwardBatch) -> ForwardBatch:
    """The same verify batch with its sequence lengths only on the device, as a CUDA-graph round has them."""
    bs = len(fb.extend_lens_cpu)
    lens = torch.tensor(fb.seq_lens_cpu, dtype=torch.int32, device="cuda")
    return ForwardBatch.build(ForwardMode.TARGET_VERIFY, fb.input_ids, list(range(bs)), lens, fb.extend_lens_cpu,
                              fb.kv_cache, fb.page_table)


def sweep_decode_launch(backend, layer, bw: float, ctx: int = 50000, batch_sizes=(1, 4, 8, 32)) -> dict:
    """Time the decode-style launch knobs at ``ctx`` for each batch size x 4/8 draft tokens, replayed from CUDA
    graphs. The tiles (block_n, warps, stages) are one choice for all batches: the lowest mean (time / KV-read floor)
    when every batch size runs its own best programs per SM; then each batch size gets that best."""
    import itertools

    tiles = list(itertools.product((64, 128), (4, 8), (2, 3, 4)))
    per_sm = (1, 2, 4, 8, 16, 32)
    results = []
    for bs in batch_sizes:
        for nd in (4, 8):
            fb, q = verify_case(ctx, bs, nd, layer.num_heads, layer.num_kv_heads, layer.head_dim, 16)
            floor_ms = 2 * bs * ctx * layer.num_kv_heads * layer.head_dim * 2 / bw * 1e3
            backend.init_forward_metadata(fb)
            for (block_n, warps, stages), pps in itertools.product(tiles, per_sm):
                backend.block_n, backend.num_warps, backend.num_stages = block_n, warps, stages
                backend.decode_launch = ((bs, 64, pps, block_n),)
                try:
                    ms = graph_ms(lambda: backend.forward(q, None, None, layer, fb), warmup=5, rep=40)
                except Exception as e:  # e.g. a tile needing more shared memory than the SM has
                    ms, err = float("inf"), f"{type(e).__name__}: {str(e)[:120]}"
                else:
                    err = None
                results.append({"block_n": block_n, "num_warps": warps, "num_stages": stages,
                                "programs_per_sm": pps, "batch_size": bs, "draft_tokens": nd, "ms": round(ms, 4),
                                "vs_floor": round(ms / floor_ms, 3), "error": err})
            print(f"sweep bs={bs} nd={nd}: best", min((r for r in results if r["batch_size"] == bs
                                                       and r["draft_tokens"] == nd), key=lambda r: r["ms"]), flush=True)
            del fb, q
            torch.cuda.empty_cache()

    def mean(tile, bs, pps):
        v = [r["vs_floor"] for r in results if (r["block_n"], r["num_warps"], r["num_stages"]) == tile
             and r["batch_size"] == bs and r["programs_per_sm"] == pps]
        return sum(v) / len(v)

    def best_per_sm(tile, bs):
        return min(per_sm, key=lambda pps: mean(tile, bs, pps))

    score = {t: sum(mean(t, bs, best_per_sm(t, bs)) for bs in batch_sizes) / len(batch_sizes) for t in tiles}
    tile = min(score, key=score.get)
    chosen = dict(zip(("block_n", "num_warps", "num_stages"), tile),
                  decode_launch=tuple((bs, 64, best_per_sm(tile, bs), tile[0]) for bs in batch_sizes))
    print("sweep chose", chosen, "mean vs floor", round(score[tile], 3), flush=True)
    return {"context": ctx, "chosen": chosen, "chosen_mean_vs_floor": round(score[tile], 3), "results": results}


def layers_graph_ms(backend, q: torch.Tensor, fb: ForwardBatch, specs: list, replays: int = 20) -> float:
    """Per layer: one CUDA graph running the attention of every layer in ``specs`` back to back (each its own KV
    cache, as a model's layers run, with no launch or L2 flush between them), replayed ``replays`` times between
    two events, after warm-up replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for spec in specs:
            backend.forward(q, None, None, spec, fb)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for spec in specs:
            backend.forward(q, None, None, spec, fb)
    for _ in range(3):
        graph.replay()
    ms = graph_replay_ms(graph, replays) / len(specs)
    del graph
    return ms


def layers_for(kv_bytes_per_layer: int) -> int:
    """Layers per back-to-back graph: together at least four times the L2 (so no layer's KV is still cached when
    its turn comes round again), between 2 and 64."""
    l2 = torch.cuda.get_device_properties().L2_cache_size
    return max(2, min(64, -(-4 * l2 // kv_bytes_per_layer)))


def sweep_short_contexts(backend, layer, bw: float, contexts=(256, 1024, 4096, 50000), draft_tokens=(1, 4)) -> dict:
    """bs=1 decode (1 token) and verify (4) at short contexts, where a layer's attention is launch and latency bound
    (the KV is a few MB): KV tile, pipeline stages, programs per SM and the fewest positions per split
    (``min_chunk``: how many splits a short sequence really uses), replayed from CUDA graphs."""
    import itertools

    grid = list(itertools.product((32, 64, 128), (1, 2, 3), (1, 2, 4), (32, 64, 128, 256)))
    results = []
    for ctx in contexts:
        for nd in draft_tokens:
            fb, q = verify_case(ctx, 1, nd, layer.num_heads, layer.num_kv_heads, layer.head_dim, 16)
            floor_ms = 2 * ctx * layer.num_kv_heads * layer.head_dim * 2 / bw * 1e3
            for block_n, stages, pps, min_chunk in grid:
                backend.num_stages, backend.min_chunk = stages, min_chunk
                backend.decode_launch = ((1, 64, pps, block_n),)
                backend.init_forward_metadata(fb)
                try:
                    ms, err = graph_ms(lambda: backend.forward(q, None, None, layer, fb), warmup=5, rep=40), None
                except Exception as e:  # noqa: BLE001
                    ms, err = float("inf"), f"{type(e).__name__}: {str(e)[:120]}"
                results.append({"context": ctx, "draft_tokens": nd, "block_n": block_n, "num_stages": stages,
                                "programs_per_sm": pps, "min_chunk": min_chunk, "ms": round(ms, 4),
                                "vs_floor": round(ms / floor_ms, 3), "error": err})
            case = sorted((r for r in results if r["context"] == ctx and r["draft_tokens"] == nd),
                          key=lambda r: r["ms"])
            print(f"short sweep ctx={ctx} nd={nd}: best", case[:3], flush=True)
            del fb, q
            torch.cuda.empty_cache()
    return {"results": results}


def page_major_timing(backend, layer, fb: ForwardBatch, q: torch.Tensor, out_token_major: torch.Tensor) -> dict:
    """The decode-style launch replayed from a CUDA graph on a copy of the KV cache laid out [pages, kv heads, page
    size, dim], and whether its output equals the token-major one bit for bit."""
    kv = fb.kv_cache
    token_major = kv.k[0], kv.v[0]
    kv.k[0], kv.v[0] = (t.view(kv.num_pages, kv.page_size, *t.shape[1:]).permute(0, 2, 1, 3).contiguous()
                        for t in token_major)
    try:
        backend.init_forward_metadata(fb)
        ms = graph_ms(lambda: backend.forward(q, None, None, layer, fb))
        same = bool(torch.equal(backend.forward(q, None, None, layer, fb), out_token_major))
    finally:
        kv.k[0], kv.v[0] = token_major
    return {"decode_style_page_major_graph_ms": round(ms, 4), "page_major_output_equal": same}


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/attention/verify_attention_h100")
    ap.add_argument("--backend", default="triton", choices=("triton", "flashinfer"),
                    help="whose kernels: our Triton split-KV family, or FlashInfer's (XQA, decode and prefill "
                         "wrappers)")
    ap.add_argument("--contexts", default="1024,8192,50000")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--draft-tokens", default="4,8")
    ap.add_argument("--sweep", action="store_true", help="tune the decode-style launch at 50k first (see JSON)")
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    ap.add_argument("--min-chunk", type=int, default=None,
                    help="fewest KV positions per decode-style split (default: the backend's); short contexts get "
                         "more splits with a smaller value (--draft-tokens 1 times plain decode)")
    ap.add_argument("--layers", action="store_true",
                    help="also time each launch as a model runs it: a graph of many layers back to back (each its "
                         "own KV, together 4x the L2), no launch or L2 flush between them")
    ap.add_argument("--page-major", action="store_true",
                    help="also time the decode-style launch on a copy of the KV laid out [pages, kv heads, page size, "
                         "dim] (each head's tokens of a page contiguous) instead of KVCache's [slots, kv heads, dim]")
    ap.add_argument("--sweep-short", action="store_true",
                    help="only: sweep the bs=1 launch at short contexts (sweep_short_contexts) into <out>.json")
    args = ap.parse_args()
    if args.backend != "triton" and (args.sweep or args.sweep_short or args.page_major or args.min_chunk is not None):
        ap.error("--sweep, --sweep-short, --page-major and --min-chunk tune the triton launch")
    out = out_path(args.out)
    if args.report_only:
        report(json.loads(out.with_suffix(".json").read_text()), out)
        return
    heads, kv_heads, dim, page = 32, 8, 128, 16
    layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim**-0.5)
    bw = copy_bandwidth()
    decode, prefill = _make(args.backend, "decode", "cuda"), _make(args.backend, "prefill", "cuda")
    if args.min_chunk is not None:
        decode.min_chunk = prefill.min_chunk = args.min_chunk
    if args.sweep_short:
        res = {"device": device_name("cuda"), "commit": commit(), "command": command(),
               "copy_bandwidth_GBps": round(bw / 1e9, 1), **sweep_short_contexts(decode, layer, bw)}
        write_json(out, res)
        return
    sweep = sweep_decode_launch(decode, layer, bw) if args.sweep else None
    if sweep:
        # the same tiles for the prefill-style launch (fair comparison); the sweep covers query tiles of up to 64
        # rows, so the backend's one-tile entries (from --sweep-short, max rows < 64) stay in front
        one_tile = tuple(e for e in decode.decode_launch if e[1] < 64)
        for key, value in sweep["chosen"].items():
            setattr(decode, key, one_tile + value if key == "decode_launch" else value)
            setattr(prefill, key, value)
    rows = []
    for ctx in [int(x) for x in args.contexts.split(",")]:
        for bs in [int(x) for x in args.batch_sizes.split(",")]:
            for nd in [int(x) for x in args.draft_tokens.split(",")]:
                kv_bytes = 2 * bs * ctx * kv_heads * dim * 2
                nl = layers_for(kv_bytes) if args.layers else 1
                fb, q = verify_case(ctx, bs, nd, heads, kv_heads, dim, page, layers=nl)
                launches = [("decode_style", decode, fb), ("prefill_style", prefill, fb)]
                if args.backend == "flashinfer":  # XQA takes the device-length batch; the wrapper the host one
                    launches = [("decode_style", decode, device_lengths(fb)), *launches[1:],
                                ("decode_style_wrapper", decode, fb)]
                res, outs, kernels = {}, {}, {}
                for name, be, batch in launches:
                    be.init_forward_metadata(batch)
                    kernels[name] = batch.attn_metadata.kernel
                    res[name] = triton.testing.do_bench(lambda: be.forward(q, None, None, layer, batch), warmup=10,
                                                        rep=100)
                    res[name + "_graph"] = graph_ms(lambda: be.forward(q, None, None, layer, batch))
                    if args.layers:
                        specs = [AttentionLayerSpec(i, heads, kv_heads, dim, dim**-0.5) for i in range(nl)]
                        res[name + "_layers"] = layers_graph_ms(be, q, batch, specs)
                    outs[name] = (be.init_forward_metadata(batch), be.forward(q, None, None, layer, batch))[1]
                out_d, out_p = outs["decode_style"], outs["prefill_style"]
                page_major = page_major_timing(decode, layer, fb, q, out_d) if args.page_major else {}
                floor_ms = kv_bytes / bw * 1e3
                rows.append({"context": ctx, "batch_size": bs, "draft_tokens": nd,
                             "decode_style_ms": round(res["decode_style"], 4),
                             "prefill_style_ms": round(res["prefill_style"], 4),
                             "speedup_vs_prefill_style": round(res["prefill_style"] / res["decode_style"], 2),
                             "kv_read_floor_ms": round(floor_ms, 4),
                             "decode_style_vs_floor": round(res["decode_style"] / floor_ms, 2),
                             "decode_style_graph_ms": round(res["decode_style_graph"], 4),
                             "prefill_style_graph_ms": round(res["prefill_style_graph"], 4),
                             "graph_speedup_vs_prefill_style": round(res["prefill_style_graph"]
                                                                     / res["decode_style_graph"], 2),
                             "decode_style_graph_vs_floor": round(res["decode_style_graph"] / floor_ms, 2),
                             "max_abs_diff_decode_vs_prefill": float((out_d.float() - out_p.float()).abs().max()),
                             **page_major})
                if args.backend != "triton":
                    rows[-1]["kernels"] = kernels
                if "decode_style_wrapper" in res:
                    w = res["decode_style_wrapper_graph"]
                    rows[-1].update({"decode_style_wrapper_graph_ms": round(w, 4),
                                     "decode_style_wrapper_graph_vs_floor": round(w / floor_ms, 2),
                                     "max_abs_diff_wrapper_vs_prefill":
                                         float((outs["decode_style_wrapper"].float() - out_p.float()).abs().max())})
                    if args.layers:
                        w = res["decode_style_wrapper_layers"]
                        rows[-1].update({"decode_style_wrapper_layers_ms": round(w, 4),
                                         "decode_style_wrapper_layers_vs_floor": round(w / floor_ms, 2)})
                if args.layers:
                    rows[-1].update({
                        "layers_per_graph": nl, "decode_style_layers_ms": round(res["decode_style_layers"], 4),
                        "prefill_style_layers_ms": round(res["prefill_style_layers"], 4),
                        "layers_speedup_vs_prefill_style": round(res["prefill_style_layers"]
                                                                 / res["decode_style_layers"], 2),
                        "decode_style_layers_vs_floor": round(res["decode_style_layers"] / floor_ms, 2)})
                if page_major:
                    rows[-1]["page_major_graph_vs_floor"] = round(page_major["decode_style_page_major_graph_ms"]
                                                                  / floor_ms, 2)
                print(rows[-1], flush=True)
                del fb, q
                torch.cuda.empty_cache()
    launch = ({k: getattr(decode, k) for k in LAUNCH_KNOBS + ("min_chunk",)} if args.backend == "triton"
              else rows[0]["kernels"] if rows else {})
    meta = {"device": device_name("cuda"), "commit": commit(), "command": command(), "backend": args.backend,
            "copy_bandwidth_GBps": round(bw / 1e9, 1), "shape": "32 q heads, 8 KV heads, dim 128, bf16, page 16",
            "decode_style_launch": launch, "sweep": sweep, "rows": rows}
    write_json(out, meta)
    report(meta, out)


def report(meta: dict, out: Path) -> None:
    """<out>.md and <out>.png from the run's record (``meta``, as written to <out>.json)."""
    rows, launch, sweep = meta["rows"], meta["decode_style_launch"], meta["sweep"]
    backend = meta.get("backend", "triton")
    md = [f"# Verify attention{'' if backend == 'triton' else ', ' + backend} ({meta['device']})", "",
          f"commit `{meta['commit']}`, command `{meta['command']}`; {meta['shape']}; copy bandwidth "
          f"{meta['copy_bandwidth_GBps']} GB/s (read + write); "
          + (f"decode-style launch {launch}" if backend == "triton" else f"kernels: {launch}")
          + (" (chosen by the sweep in the JSON)" if sweep else ""), "",
          "Times per layer in ms; *graph*: one layer's launch replayed from a CUDA graph, timed per replay with the "
          "L2 flushed before each (triton's do_bench), *eager*: "
          "launched from Python" + ("; *layers back to back*: one graph of that many layers' attention (each its own "
          "KV cache, together at least 4x the L2) replayed, time / layers, as the kernels run inside a model's step"
          if any("decode_style_layers_ms" in r for r in rows) else "") + ".", "",
          "| context | bs | draft tokens | KV floor | decode-style graph | prefill-style graph | speedup | vs floor | "
          "decode-style eager | prefill-style eager | speedup | vs floor |" + (pm_head := (
              " page-major KV: decode-style graph | vs floor | equal |" if any(
                  "decode_style_page_major_graph_ms" in r for r in rows) else ""))
          + (ly_head := (" layers per graph | decode-style, layers back to back | prefill-style, layers back to back "
                         "| speedup | vs floor |" if any("decode_style_layers_ms" in r for r in rows) else ""))
          + (wr_head := (" decode wrapper graph | vs floor |" + (" decode wrapper, layers back to back | vs floor |"
                                                                  if ly_head else "")
                         if any("decode_style_wrapper_graph_ms" in r for r in rows) else "")),
          "|---" * (12 + pm_head.count("|") + ly_head.count("|") + wr_head.count("|")) + "|"]
    md += [f"| {r['context']} | {r['batch_size']} | {r['draft_tokens']} | {r['kv_read_floor_ms']} | "
           f"{r['decode_style_graph_ms']} | {r['prefill_style_graph_ms']} | {r['graph_speedup_vs_prefill_style']}x | "
           f"**{r['decode_style_graph_vs_floor']}x** | {r['decode_style_ms']} | {r['prefill_style_ms']} | "
           f"{r['speedup_vs_prefill_style']}x | {r['decode_style_vs_floor']}x |"
           + (f" {r.get('decode_style_page_major_graph_ms', '')} | {r.get('page_major_graph_vs_floor', '')}x | "
              f"{r.get('page_major_output_equal', '')} |" if pm_head else "")
           + (f" {r['layers_per_graph']} | {r['decode_style_layers_ms']} | {r['prefill_style_layers_ms']} | "
              f"{r['layers_speedup_vs_prefill_style']}x | **{r['decode_style_layers_vs_floor']}x** |"
              if ly_head else "")
           + (f" {r['decode_style_wrapper_graph_ms']} | {r['decode_style_wrapper_graph_vs_floor']}x |"
              + (f" {r['decode_style_wrapper_layers_ms']} | {r['decode_style_wrapper_layers_vs_floor']}x |"
                 if ly_head else "") if wr_head else "") for r in rows]
    write_markdown(out, md)
    try:
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, nd in zip(axes, sorted({r["draft_tokens"] for r in rows})):
            for bs in sorted({r["batch_size"] for r in rows}):
                sel = [r for r in rows if r["batch_size"] == bs and r["draft_tokens"] == nd]
                xs = [r["context"] for r in sel]
                ax.plot(xs, [r["decode_style_graph_ms"] for r in sel], "o-", label=f"decode-style bs={bs}")
                ax.plot(xs, [r["prefill_style_graph_ms"] for r in sel], "x--", label=f"prefill-style bs={bs}")
                ax.plot(xs, [r["kv_read_floor_ms"] for r in sel], ":", color="gray")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("context")
            ax.set_ylabel("ms per layer")
            ax.set_title(f"verify, {nd} draft tokens, CUDA graph replays (dotted: KV-read floor)", fontsize=9)
            ax.legend(fontsize=6)
        fig.suptitle(f"{meta['device']} {meta['commit']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
