"""Side-by-side table and bar plot of ``bench.gpu_perf`` result files (A/B runs, variants of one tree): for each
labelled JSON its device, commit and bs=1 decode (graph replay and engine, ms and x the bandwidth floor) or, for a
``--parts spec`` file, EAGLE-3's speed-up over no-spec at bs=1; or of ``bench.tp_decode`` result files: TP=1 and
TP=2 ms per decode step, launched as the engine runs them (overlapped), and TP=2 / TP=1.

    python3 -m bench.compare_runs --out bench/results/<topic>/NAME base=a.json new=b.json ...

Writes NAME.json (the rows), NAME.md and NAME.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import out_path, pyplot, write_json, write_markdown


def row(label: str, path: str) -> dict:
    d = json.loads(Path(path).read_text())
    out = {"label": label, "file": Path(path).name, "device": d.get("device"), "commit": d.get("commit"),
           "command": d.get("command")}
    if "bs1" in d:
        b = d["bs1"]
        out.update(floor_ms=b["floor_ms"], graph_replay_ms=b["graph_replay_ms"],
                   graph_replay_vs_floor=b["graph_replay_vs_floor"], engine_ms=b["specserve_graphs_ms"],
                   engine_vs_floor=b["specserve_graphs_vs_floor"])
    if "tp2_over_tp1" in d:
        over = d["overlapped_step_ms"]
        out.update(tp1_ms=over["tp1"], tp2_ms=over["tp2"], tp2_over_tp1=d["overlapped_tp2_over_tp1"],
                   tp2_over_tp1_step_then_read=d["tp2_over_tp1"], dtype=d["dtype"])
    summary = d.get("summary", {})
    if "eagle3_chain3_vs_no_spec_bs1" in summary:
        out["eagle3_vs_no_spec_bs1"] = summary["eagle3_chain3_vs_no_spec_bs1"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+", metavar="LABEL=FILE")
    args = ap.parse_args()
    rows = [row(*r.split("=", 1)) for r in args.runs]
    out = out_path(args.out)
    write_json(out, rows)
    cols = [c for c in ("graph_replay_ms", "graph_replay_vs_floor", "engine_ms", "engine_vs_floor",
                        "eagle3_vs_no_spec_bs1", "dtype", "tp1_ms", "tp2_ms", "tp2_over_tp1",
                        "tp2_over_tp1_step_then_read") if any(c in r for r in rows)]
    lines = ["| run | device | commit | " + " | ".join(cols) + " |", "|---" * (3 + len(cols)) + "|"]
    lines += [f"| {r['label']} | {r['device']} | {r['commit']} | " + " | ".join(str(r.get(c, "")) for c in cols)
              + " |" for r in rows]
    lines += ["", "Commands:", ""] + [f"- {r['label']}: `{r['command']}` ({r['file']})" for r in rows]
    write_markdown(out, lines)
    plt = pyplot()

    tp = [r for r in rows if "tp2_over_tp1" in r]
    if tp:  # TP=2 / TP=1 per run against the 0.6 goal
        bar_plot(out, plt, tp, "tp2_over_tp1", "TP=2 / TP=1 decode step, bs=1", f"{tp[0]['device']}: TP=2 vs TP=1",
                 [(0.6, dict(color="tab:red", ls="--"), "goal 0.6"),
                  (0.5, dict(color="k"), "0.5: half the weights per GPU, nothing else")],
                 (0.45, max(r["tp2_over_tp1"] for r in tp) * 1.03))
        return
    timed = [r for r in rows if "graph_replay_ms" in r]
    floor = timed[0]["floor_ms"] if timed else None
    bar_plot(out, plt, timed, "graph_replay_ms", "bs=1 decode step, graph replay (ms)",
             f"{timed[0]['device'] if timed else ''}: bs=1 decode",
             [(floor, dict(color="k"), f"bandwidth floor {floor} ms"),
              (floor * 1.10, dict(color="tab:red", ls="--"), "1.10 x floor")] if timed else [],
             (floor * 0.95, max(r["graph_replay_ms"] for r in timed) * 1.01) if timed else None)


def bar_plot(out: Path, plt, rows: list[dict], key: str, ylabel: str, title: str, hlines: list, ylim) -> None:
    """One bar per row (its ``key``), horizontal reference lines (value, style, label), written to ``out``.png."""
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4))
    ax.bar([r["label"] for r in rows], [r[key] for r in rows], color="tab:blue")
    for y, style, label in hlines:
        ax.axhline(y, lw=1, label=label, **style)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
