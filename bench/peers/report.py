"""The peer table from one session's JSONs (``bench.peers.run`` outputs): JSON + markdown + PNG.

    python3 -m bench.peers.report --tiny-prompts P.json              # write the tiny family's held-out prompts
    python3 -m bench.peers.report --runs DIR --out bench/results/peers/peers_h100
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import out_path, pyplot, write_json, write_markdown


def _key(r: dict) -> tuple:
    return r["mode"], Path(r["model"]).name, r["spec"]


def rows(runs: list[dict]) -> list[dict]:
    """One row per (setting, metric): vLLM's figure, ours, and how many times faster we are."""
    by = {}
    for r in runs:
        by.setdefault(_key(r), {})[r["engine"]] = r
    out = []

    def add(setting, metric, v, s, lower_is_better):
        if v is None or s is None:
            return
        ratio = v / s if lower_is_better else s / v
        out.append({"setting": setting, "metric": metric, "vllm": v, "specserve": s, "ours_faster_x": round(ratio, 3)})

    for (mode, model, spec), pair in sorted(by.items()):
        v, s = pair.get("vllm", {}), pair.get("specserve", {})
        name = model + ("" if spec == "none" else f" + {spec}")
        if mode == "decode":
            add(name, "bs=1 decode ms/token", v.get("bs1", {}).get("decode_ms_per_token"),
                s.get("bs1", {}).get("decode_ms_per_token"), True)
            for bs in sorted(set(v.get("throughput", {})) | set(s.get("throughput", {})), key=int):
                add(name, f"{bs} requests x (128 in, 256 out), output tok/s",
                    v.get("throughput", {}).get(bs, {}).get("output_tok_s"),
                    s.get("throughput", {}).get(bs, {}).get("output_tok_s"), False)
        else:
            for bs in ("1", "16"):
                n = s.get("tiny", {}).get(bs, {}).get("requests", "all")
                add(name, f"{n} held-out prompts at bs {bs}, tok/s", v.get("tiny", {}).get(bs, {}).get("tok_s"),
                    s.get("tiny", {}).get(bs, {}).get("tok_s"), False)
                add(name, f"decode step at bs {bs}, ms", v.get("tiny_decode", {}).get(bs, {}).get("ms_per_step"),
                    s.get("tiny_decode", {}).get(bs, {}).get("ms_per_step"), True)
            vt, st = (p.get("tiny", {}).get("1", {}).get("token_ids") for p in (v, s))
            if vt and st:  # bf16 greedy: equal until the engines' rounding first picks another token
                out.append({"setting": name, "metric": f"greedy outputs equal at bs 1 (of {len(vt)})", "vllm": "—",
                            "specserve": sum(a == b for a, b in zip(vt, st)), "ours_faster_x": None})
            if spec != "none":
                va, sa = (p.get("tiny", {}).get("1", {}).get("accept_length") for p in (v, s))
                if va and sa:
                    out.append({"setting": name, "metric": "accept length (bs 1)", "vllm": va, "specserve": sa,
                                "ours_faster_x": None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny-prompts", default=None, help="write the held-out prompts of the tiny family here")
    ap.add_argument("--tokenizer", default="models/specserve-tiny")
    ap.add_argument("--runs", default=None, help="folder of bench.peers.run JSONs")
    ap.add_argument("--out", default="bench/results/peers/peers")
    args = ap.parse_args()
    if args.tiny_prompts:
        from bench.peers.workload import write_tiny_prompts

        write_tiny_prompts(args.tokenizer, Path(args.tiny_prompts))
        return
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.runs).glob("*.json"))]
    runs = [r for r in runs if "engine" in r and "mode" in r]
    table = rows(runs)
    meta = {}
    for r in runs:
        meta.setdefault(r["engine"], {"version": r.get("version"), "commit": r.get("commit"), "device": r["device"],
                                      "torch": r.get("torch")})
    commands = sorted({r["command"] for r in runs})
    out = out_path(args.out)
    write_json(out, {"engines": meta, "rows": table, "commands": commands,
                     "runs": [{k: v for k, v in r.items() if k not in ("tiny",)} for r in runs]})
    lines = [f"# specserve vs vLLM, same GPU ({meta.get('specserve', meta.get('vllm', {})).get('device')})", "",
             "Engines: " + "; ".join(f"{e}: {m['version']} (commit {m['commit']}, torch {m['torch']})"
                                     for e, m in meta.items()), "",
             "| setting | metric | vLLM | specserve | specserve faster |", "|---|---|---|---|---|"]
    for r in table:
        x = "—" if r["ours_faster_x"] is None else f"{r['ours_faster_x']:.2f}x"
        v, s = (f"{r[k]:,}" if isinstance(r[k], (int, float)) else r[k] for k in ("vllm", "specserve"))
        lines.append(f"| {r['setting']} | {r['metric']} | {v} | {s} | {x} |")
    lines += ["", "Commands (one process per engine and setting):", ""] + [f"    {c}" for c in commands]
    write_markdown(out, lines)
    plotted = [r for r in table if r["ours_faster_x"] is not None]
    if plotted:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(12, 0.35 * len(plotted) + 1.2))
        labels = [f"{r['setting']}: {r['metric']}" for r in plotted]
        ax.barh(range(len(plotted)), [r["ours_faster_x"] for r in plotted], color="tab:blue")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(range(len(plotted)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("specserve speed / vLLM speed (same GPU)")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
