"""The peer tables from one session's JSONs: JSON + markdown + PNG.

    python3 -m bench.peers.report --tiny-prompts P.json              # write the tiny family's held-out prompts
    python3 -m bench.peers.report --runs DIR --out bench/results/peers/peers_h100

DIR holds ``bench.peers.run`` outputs (the offline table: <out>.json/.md/.png), ``bench.peers.served`` outputs
(served_<engine>_<tag>.json: the served table, <out>_served.json/.md/.png) and the profile sections of the decode
runs with the floor (floor_*.json: <out>_profile.json/.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import out_path, pyplot, write_json, write_markdown
from bench.peers.profile import profile_markdown


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
                if spec == "none":  # with a drafter, tokens 129-256 accept unlike 1-128: the difference is no step
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


def served_rows(served: list[dict]) -> list[dict]:
    """Per model and concurrency: both engines' output tok/s, how many times faster we are, and the latencies
    (medians). A level only one engine ran keeps its figures, with no ratio."""
    by: dict[str, dict] = {}
    for s in served:
        by.setdefault(s["model_id"], {})[s["engine"]] = {r["concurrency"]: r for r in s["rows"]}
    out = []
    for model, pair in sorted(by.items()):
        v, s = pair.get("vllm", {}), pair.get("specserve", {})
        for c in sorted(set(v) | set(s)):
            a, b = v.get(c), s.get(c)
            row = {"model": model, "concurrency": c, "requests": (a or b)["num_requests"]}
            for eng, r in (("vllm", a), ("specserve", b)):
                row[f"{eng}_tok_s"] = r["output_tok_s"] if r else None
                for k in ("ttft", "itl", "tpot"):
                    row[f"{eng}_{k}_p50_ms"] = r[k]["median_ms"] if r else None
            row["ours_faster_x"] = round(b["output_tok_s"] / a["output_tok_s"], 3) if a and b else None
            out.append(row)
    return out


def served_markdown(table: list[dict], served: list[dict]) -> list[str]:
    if not table:
        return []
    fmt = lambda x, d=1: "—" if x is None else f"{x:,.{d}f}"  # noqa: E731
    lines = ["| model | C (requests) | vLLM output tok/s | specserve output tok/s | specserve faster | "
             "TTFT p50 ms (vLLM / ours) | ITL p50 ms (vLLM / ours) | TPOT p50 ms (vLLM / ours) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        x = "—" if r["ours_faster_x"] is None else f"{r['ours_faster_x']:.2f}x"
        lat = " | ".join(f"{fmt(r[f'vllm_{k}_p50_ms'], 2)} / {fmt(r[f'specserve_{k}_p50_ms'], 2)}"
                         for k in ("ttft", "itl", "tpot"))
        lines.append(f"| {r['model']} | {r['concurrency']} ({r['requests']}) | {fmt(r['vllm_tok_s'])} | "
                     f"{fmt(r['specserve_tok_s'])} | {x} | {lat} |")
    s0 = served[0]
    lines += ["", f"Each level: {s0.get('waves', 2)}C requests at once with C in flight, {s0['input_len']} prompt tokens (random ids) and "
              f"{s0['output_len']} new tokens each (ignore_eos), greedy, streamed over HTTP (SSE) by python3 -m "
              "bench.serving; tok/s = output tokens / the level's wall time; TPOT = (last - first token time) / "
              "(tokens - 1) per request; ITL = gaps between streamed chunks.", "", "Servers:", ""]
    lines += [f"    {s.get('engine')}: {s.get('server_command', '?')}" for s in served]
    lines += ["", "Clients:", ""] + [f"    {s.get('command')}" for s in served]
    return lines


def served_plot(table: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    models = sorted({r["model"] for r in table})
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for ax_row, model in zip(axes, models):
        rs = [r for r in table if r["model"] == model]
        xs = range(len(rs))
        for i, (eng, color) in enumerate((("vllm", "tab:orange"), ("specserve", "tab:blue"))):
            ax_row[0].bar([x + (i - 0.5) * 0.4 for x in xs], [r[f"{eng}_tok_s"] or 0 for r in rs], width=0.4,
                          label=eng, color=color)
            ax_row[1].plot(list(xs), [r[f"{eng}_tpot_p50_ms"] for r in rs], "o-", label=f"{eng} TPOT p50",
                           color=color)
            ax_row[1].plot(list(xs), [r[f"{eng}_ttft_p50_ms"] for r in rs], "x--", label=f"{eng} TTFT p50",
                           color=color)
        for ax in ax_row:
            ax.set_xticks(list(xs), [str(r["concurrency"]) for r in rs])
            ax.set_xlabel("concurrency C")
            ax.legend(fontsize=7)
        ax_row[0].set_ylabel(f"{model}: output tok/s")
        ax_row[1].set_ylabel("ms")
        ax_row[1].set_yscale("log")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_runs(folder: Path) -> tuple[list[dict], list[dict], dict | None]:
    """(offline runs, served sweeps, the floor) from a folder of results."""
    runs, served, floor = [], [], None
    for p in sorted(folder.glob("*.json")):
        r = json.loads(p.read_text())
        if not isinstance(r, dict):
            continue
        if "engine" in r and "mode" in r:
            runs.append(r)
        elif "concurrencies" in r and p.name.startswith("served_"):
            r.setdefault("engine", p.name.split("_")[1])
            served.append(r)
        elif "matmul_tflops" in r:
            floor = r
    return runs, served, floor


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
    runs, served, floor = load_runs(Path(args.runs))
    table = rows(runs)
    meta = {}
    for r in runs:
        meta.setdefault(r["engine"], {"version": r.get("version"), "commit": r.get("commit"), "device": r["device"],
                                      "torch": r.get("torch")})
    commands = sorted({r["command"] for r in runs})
    out = out_path(args.out)
    write_json(out, {"engines": meta, "rows": table, "commands": commands,
                     "runs": [{k: v for k, v in r.items() if k not in ("tiny", "profile")} for r in runs]})
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
    device = meta.get("specserve", meta.get("vllm", {})).get("device") or (served or [{}])[0].get("device")
    stable = served_rows(served)
    if stable:
        sout = out.with_name(out.name + "_served")
        write_json(sout, {"rows": stable, "sweeps": served})
        md = [f"# specserve vs vLLM, served, same GPU ({served[0].get('device')})", "",
              "Servers' commits: " + ", ".join(sorted({f"{s['engine']} {s.get('commit')}" for s in served})), ""]
        write_markdown(sout, md + served_markdown(stable, served))
        served_plot(stable, sout.with_suffix(".png"), f"{served[0].get('device')} · vLLM OpenAI server vs serve run")
        print("\n".join(served_markdown(stable, served)))
    pmd = profile_markdown(floor, runs)
    if pmd:
        pout = out.with_name(out.name + "_profile")
        write_json(pout, {"device": device, "floor": floor,
                          "engines": {r["engine"]: {"version": r.get("version"), "commit": r.get("commit"),
                                                    "command": r.get("command"), **r["profile"]}
                                      for r in runs if r.get("profile")}})
        write_markdown(pout, [f"# Decode step by kernel class, 8B shape ({device})", "",
                              "ms per decode step; per step = (X(n2 new tokens) - X(n1)) / (n2 - n1) over one "
                              "profiled call of each; class times are sums of kernel durations, GPU idle = the step "
                              "without the profiler - the union of kernel intervals.", ""] + pmd)
        print("\n".join(pmd))


if __name__ == "__main__":
    main()
