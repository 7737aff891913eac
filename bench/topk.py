"""The sparse attention's exact top-k (``topk_slots``) alone, each path at DeepSeek-V3.2's shapes: top-k 2048 over
the lightning indexer's scores (64 heads x 128, bf16 keys, computed once per case by ``indexer_scores``) at 16k /
64k / 128k context, DECODE (one row a request) and TARGET_VERIFY (1 + 4 draft rows a request, each its own causal
length) at batch 1 / 8 / 32, so 1 to 160 rows.

Each path (``--methods``: "radix", "sampled", "ordered", and "auto", the launcher's default for the shape) is timed
as one CUDA graph replay captured with PDL, the L2 flushed before each (triton's do_bench), as
``bench.sparse_attention`` times its kernels; "ordered" also at the split counts of ``--ordered-splits``, the
select warps of ``--select-warps`` and with its threshold drawn by each split or by a kernel of its own
(``--fused``). Every result is checked against the stable-sort reference on the same scores
(``equal``). Writes <out>.json (after every case) and <out>.md with device, commit and command.

    python3 -m bench.topk --out bench/results/sparse_attention/topk_h100
    python3 -m bench.topk --cpu --out /tmp/topk_smoke     # tiny shapes through Triton's interpreter (smoke)
"""

from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv:  # Triton's interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from bench.common import command, commit, device_name, out_path, pyplot, write_json, write_markdown  # noqa: E402,E501
from bench.sparse_attention import timer  # noqa: E402
from workers.kernels import sparse_mla as sm  # noqa: E402

SHAPES = {"gpu": dict(index_heads=64, index_dim=128, topk=2048, page=64, sample=1024),
          "cpu": dict(index_heads=4, index_dim=16, topk=16, page=16, sample=32)}


def scores_case(shape: dict, ctx: int, bs: int, rows_per_req: int, device: str, seed: int = 0) -> dict:
    """The indexer's scores of ``bs`` requests at ``ctx`` positions (scattered pages), rows as the verify / decode
    rows of ``bench.sparse_attention``, and what ``topk_slots`` reads besides."""
    g = torch.Generator(device=device).manual_seed(seed)
    page = shape["page"]
    pages_per = -(-ctx // page)
    perm = torch.randperm(bs * pages_per + 1, device=device, generator=g)
    table = perm[:bs * pages_per].view(bs, pages_per).to(torch.int32)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    keys = torch.randn((bs * pages_per + 1) * page, shape["index_dim"], device=device, dtype=dt, generator=g)
    r = bs * rows_per_req
    row_req = torch.arange(bs, device=device, dtype=torch.int32).repeat_interleave(rows_per_req)
    row_len = (ctx - rows_per_req + 1 + torch.arange(rows_per_req, device=device)).repeat(bs).to(torch.int32)
    base = torch.randn(bs, 1, shape["index_heads"], shape["index_dim"], device=device, generator=g)
    noise = torch.randn(bs, rows_per_req, shape["index_heads"], shape["index_dim"], device=device, generator=g)
    q = (base + 0.1 * noise).view(r, shape["index_heads"], shape["index_dim"]).to(dt)
    w = torch.randn(r, shape["index_heads"], device=device, generator=g) * shape["index_heads"] ** -0.5
    scores = sm.indexer_scores(q, w, keys, table, row_req, row_len, page)
    return {"scores": scores, "table": table, "row_req": row_req, "row_len": row_len,
            "slots": torch.empty(r, shape["topk"], dtype=torch.int32, device=device)}


def variants(methods: list[str], ordered_splits: list[str], select_warps: list[int],
             fused: list[str]) -> list[tuple[str, dict]]:
    """(label, topk_slots keywords) per timed path."""
    out = []
    for m in methods:
        if m == "auto":
            out.append(("auto", {}))
        elif m == "ordered":
            for sp, wp, fu in itertools.product(ordered_splits, select_warps, fused):
                kw = {"method": "ordered", "select_warps": wp, **({} if sp == "auto" else {"num_splits": int(sp)}),
                      **({} if fu == "auto" else {"fused_threshold": fu == "1"})}
                many = len(ordered_splits) * len(select_warps) * len(fused) > 1
                out.append((f"ordered s={sp} w={wp} f={fu}" if many else "ordered", kw))
        else:
            out.append((m, {"method": m}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/sparse_attention/topk_h100")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU through Triton's interpreter (smoke)")
    ap.add_argument("--contexts", default=None, help="default 16384,65536,131072 (--cpu: 300)")
    ap.add_argument("--batch-sizes", default=None, help="default 1,8,32 (--cpu: 2)")
    ap.add_argument("--modes", default="decode,verify")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--methods", default="auto,radix,sampled,ordered")
    ap.add_argument("--ordered-splits", default="auto", help="split counts for 'ordered' (auto: topk_splits)")
    ap.add_argument("--select-warps", default="16", help="warps of the 'ordered' select program")
    ap.add_argument("--sort-sample", action="store_true", help="the sampled paths' threshold from a sort of the "
                                                                 "sample (default: by counts)")
    ap.add_argument("--fused", default="auto", help="'ordered': threshold drawn by each split (1), by its own "
                                                   "kernel (0), or as the launcher decides (auto); e.g. auto,0,1")
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    args = ap.parse_args()
    out = out_path(args.out)
    if args.report_only:
        meta = json.loads(out.with_suffix(".json").read_text())
        report(meta, out, list(meta["rows"][0]["ms"]))
        return
    device = "cpu" if args.cpu else "cuda"
    shape = SHAPES["cpu" if args.cpu else "gpu"]
    contexts = [int(x) for x in (args.contexts or ("300" if args.cpu else "16384,65536,131072")).split(",")]
    batch_sizes = [int(x) for x in (args.batch_sizes or ("2" if args.cpu else "1,8,32")).split(",")]
    vs = variants(args.methods.split(","), args.ordered_splits.split(","),
                  [int(x) for x in args.select_warps.split(",")], args.fused.split(","))
    graph, _ = timer(device)
    meta = {"device": device_name(device), "commit": commit(), "command": command(), "shape": shape,
            "timing": "CUDA graph replay captured with PDL, L2 flushed before each (do_bench)" if device == "cuda"
            else "CPU interpreter wall time (smoke: not a measurement)", "rows": []}
    for ctx in contexts:
        for mode in args.modes.split(","):
            per = 1 if mode == "decode" else 1 + args.draft_tokens
            for bs in batch_sizes:
                c = scores_case(shape, ctx, bs, per, device)
                r = c["scores"].shape[0]
                want = sm.positions_to_slots(sm.topk_positions_reference(c["scores"], c["row_len"], shape["topk"]),
                                             c["table"], c["row_req"], shape["page"])
                cap = c["scores"].shape[1]
                method = sm.topk_method(r, cap, shape["topk"])  # topk_slots' defaults
                splits = sm.topk_splits(r, cap, 2048, sm._num_sms(c["scores"]), 8, sm.ordered_max_splits(method))
                row = {"context": ctx, "mode": mode, "batch_size": bs, "rows": r,
                       "auto_method": method, "auto_splits": splits,
                       "auto_fused": r * splits <= sm._num_sms(c["scores"]), "ms": {}, "equal": {}}
                for label, kw in vs:
                    def fn(kw=kw):
                        return sm.topk_slots(c["scores"], c["table"], c["row_req"], c["row_len"], shape["page"],
                                             shape["topk"], out=c["slots"], sample=shape["sample"],
                                             sort_sample=args.sort_sample, **kw)
                    row["equal"][label] = bool(torch.equal(fn(), want))
                    row["ms"][label] = round(graph(fn), 4)
                meta["rows"].append(row)
                print(row, flush=True)
                write_json(out, meta)
                del c, want
    report(meta, out, [label for label, _ in vs])


def report(meta: dict, out, labels: list[str]) -> None:
    md = [f"# Sparse top-k paths, {meta['device']}", "",
          f"commit {meta['commit']}; `{meta['command']}`; {meta['timing']}. Top-k {meta['shape']['topk']} over the "
          "indexer's scores; ms per call; `auto` is the launcher's default (its path in brackets); `splits`: the "
          "launcher's split count for the shape (and whether 'ordered' then fuses its threshold); a cell marked "
          "`!` differs from the stable-sort reference.", "",
          "| context | mode | bs | rows | splits | " + " | ".join(labels) + " |",
          "|---|---|---|---|---|" + "---|" * len(labels)]
    for r in meta["rows"]:
        cells = []
        for lb in labels:
            cell = f"{r['ms'][lb]}" + ("" if r["equal"][lb] else " !")
            cells.append(cell + (f" ({r['auto_method']})" if lb == "auto" else ""))
        fused = " fused" if r["auto_fused"] else ""
        md.append(f"| {r['context']} | {r['mode']} | {r['batch_size']} | {r['rows']} | {r['auto_splits']}{fused} | "
                  + " | ".join(cells) + " |")
    write_markdown(out, md)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(meta["rows"]) * len(labels) / 2), 4.5))
    width = 0.8 / len(labels)
    for i, lb in enumerate(labels):
        ax.bar([j + i * width for j in range(len(meta["rows"]))], [r["ms"][lb] for r in meta["rows"]], width,
               label=lb)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(meta["rows"]))])
    ax.set_xticklabels([f"{r['context'] // 1024}k {r['mode'][0]} {r['rows']}r" for r in meta["rows"]], rotation=60,
                       fontsize=7)
    ax.set_ylabel("ms per call")
    ax.set_title(f"{meta['device']}: sparse top-k paths (k {meta['shape']['topk']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
