"""Side-by-side table and bar plot of ``bench/gpu_perf.py`` result files (A/B runs, variants of one tree): for each
labelled JSON its device, commit and bs=1 decode (graph replay and engine, ms and x the bandwidth floor) or, for a
``--parts spec`` file, EAGLE-3's speed-up over no-spec at bs=1.

    python bench/compare_runs.py --out bench/results/NAME base=a.json new=b.json ...

Writes NAME.json (the rows), NAME.md and NAME.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(label: str, path: str) -> dict:
    d = json.loads(Path(path).read_text())
    out = {"label": label, "file": Path(path).name, "device": d.get("device"), "commit": d.get("commit"),
           "command": d.get("command")}
    if "bs1" in d:
        b = d["bs1"]
        out.update(floor_ms=b["floor_ms"], graph_replay_ms=b["graph_replay_ms"],
                   graph_replay_vs_floor=b["graph_replay_vs_floor"], engine_ms=b["specserve_graphs_ms"],
                   engine_vs_floor=b["specserve_graphs_vs_floor"])
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
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    cols = [c for c in ("graph_replay_ms", "graph_replay_vs_floor", "engine_ms", "engine_vs_floor",
                        "eagle3_vs_no_spec_bs1") if any(c in r for r in rows)]
    lines = ["| run | device | commit | " + " | ".join(cols) + " |", "|---" * (3 + len(cols)) + "|"]
    lines += [f"| {r['label']} | {r['device']} | {r['commit']} | " + " | ".join(str(r.get(c, "")) for c in cols)
              + " |" for r in rows]
    lines += ["", "Commands:", ""] + [f"- {r['label']}: `{r['command']}` ({r['file']})" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "graph_replay_ms" in r]
    fig, ax = plt.subplots(figsize=(1.2 * len(timed) + 3, 4))
    ax.bar([r["label"] for r in timed], [r["graph_replay_ms"] for r in timed], color="tab:blue")
    if timed:
        floor = timed[0]["floor_ms"]
        ax.axhline(floor, color="k", lw=1, label=f"bandwidth floor {floor} ms")
        ax.axhline(floor * 1.10, color="tab:red", ls="--", lw=1, label="1.10 x floor")
        ax.set_ylim(floor * 0.95, max(r["graph_replay_ms"] for r in timed) * 1.01)
    ax.set_ylabel("bs=1 decode step, graph replay (ms)")
    ax.set_title(f"{timed[0]['device'] if timed else ''}: bs=1 decode")
    ax.legend(loc="lower right", fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
