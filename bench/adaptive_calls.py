"""The adaptive chooser's own work per decode step, counted in Python bytecodes (#41, CPU, deterministic).

On a GPU host a small model's steps are host-bound, and there every bytecode the chooser runs between two launches
is the step's; in the engine its calls cost several times what they cost in a loop on their own (each runs once a
step, with its code and data evicted by the rest of the step; the measurements are in docs/performance.md). Wall
time here moves by more than the effects measured, so this counts what runs instead: the chooser
(``DepthChooser``, its defaults, beside ``steady_steps=1``: the full choice at every step) is driven as the engine
drives it, choose, launched and observe a step, the verdicts one step late, over batches of a bucket's size that
either stay (``flat``) or drain a bucket a step at their end, as a benchmark batch's last requests do (``tail``); a
synthetic cost table of the shipped family's shape (23 buckets, a context slope), 0.8 acceptance per position. Per
step: bytecodes in each call and in all, and a wall time with the caches evicted between steps (noisy: a guide only).

    python3 -m bench.adaptive_calls --out bench/results/adaptive/host/adaptive_calls_cpu
    cd COPY_OF_AN_OLDER_COMMIT && PYTHONPATH=. python3 PATH/TO/bench/adaptive_calls.py --out OUT   (its chooser)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from bench.common import command, commit, device_name, out_path, pyplot, write_json, write_markdown

BUCKETS = [1, 2, 4, 8] + list(range(16, 257, 16))
# (the tail: the last requests of a 64-token batch finishing, as fractions of the batch, as in bench.adaptive_ab)
TAIL = (0.9, 0.77, 0.6, 0.53, 0.48, 0.45, 0.34, 0.23, 0.19, 0.12, 0.08, 0.05, 0.05, 0.02, 0.03, 0.02, 0.03)


def drive(steady_steps: int | None, bs: int, shape: str, batches: int, warm: int, count: bool) -> dict:
    from speculative.adaptive import DepthChooser

    table = {b: {0: 0.2 + b * 0.002, 1: 0.28 + b * 0.003, 2: 0.33 + b * 0.004, 3: 0.37 + b * 0.0045,
                 -1: 0.06, -16: 0.1} for b in BUCKETS}
    kw = {} if steady_steps is None else {"steady_steps": steady_steps}
    c = DepthChooser(table, 3, context_costs={b: {d: 1.5e-5 for d in range(4)} for b in table}, **kw)
    rng, junk = random.Random(0), list(range(300_000))
    sizes = [bs] * 16 + ([max(1, int(bs * f)) for f in TAIL] if shape == "tail" else [bs] * len(TAIL))
    ops = {"choose": 0, "launched": 0, "observe": 0}
    wall = {k: [] for k in ops}
    where = ["choose"]

    def tracer(frame, event, arg):  # (every bytecode run under the call, in the chooser's own frames)
        frame.f_trace_opcodes = True
        if event == "opcode":
            ops[where[0]] += 1
        return tracer

    now, pending, steps = 0.0, None, 0
    for rep in range(batches):
        for i, n in enumerate(sizes):
            on = rep >= warm
            context = n * 128 + (i + 1) * n * 3
            calls = (("choose", c.choose, (n, context)), ("launched", c.launched, (now, 1e-5, i > 0)),
                     ("observe", c.observe, pending))
            d = None
            for name, fn, args in calls:
                if args is None:
                    continue
                where[0] = name
                if on and count:
                    sys.settrace(tracer)
                t = time.perf_counter()
                got = fn(*args)
                t = time.perf_counter() - t
                if on and count:
                    sys.settrace(None)
                if on and not count:
                    wall[name].append(t)
                d = got if name == "choose" else d
            steps += on
            pending = (d, [next((k for k in range(d) if rng.random() >= 0.8), d) for _ in range(n)])
            now += 0.0006 * (1 + 0.05 * rng.random())
            if not count:
                s = 0
                for j in range(0, len(junk), 16):  # (evict the chooser's state, as the rest of a step does)
                    s += junk[j]
    if count:
        return {k: round(v / steps, 1) for k, v in ops.items()}
    return {k: round(1e6 * sum(v) / steps, 2) for k, v in wall.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="16,64,256")
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, os.getcwd())  # (the tree run from: a copy of another commit measures its own chooser)
    out = out_path(a.out)
    res = {"device": device_name("cpu"), "commit": commit(), "command": command(), "rows": []}
    policies = {"adaptive": None, "adaptive_every_step": 1}
    for shape in ("flat", "tail"):
        for bs in [int(x) for x in a.batch_sizes.split(",")]:
            for name, steady in policies.items():
                ops = drive(steady, bs, shape, a.batches, 5, True)
                us = drive(steady, bs, shape, a.batches, 5, False)
                row = {"shape": shape, "batch_size": bs, "policy": name, "bytecodes": ops,
                       "bytecodes_per_step": round(sum(ops.values())), "wall_us": us,
                       "wall_us_per_step": round(sum(us.values()), 1)}
                res["rows"].append(row)
                print(row, flush=True)
    write_json(out, res)
    lines = ["# The adaptive chooser's own work per step (CPU, Python bytecodes)", "",
             f"{res['device']}; commit `{res['commit']}`; `{res['command']}`", "",
             "The chooser driven as the engine drives it (choose, launched, observe a step), 16 steps of a batch, then "
             "17 more that stay (`flat`) or drain a bucket a step (`tail`); bytecodes a step in each call (the "
             "deterministic measure) and the wall µs a step with the caches evicted between steps (noisy).", "",
             "| shape | bs | policy | bytecodes a step | choose / launched / observe | wall µs a step (noisy) |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        o = r["bytecodes"]
        lines.append(f"| {r['shape']} | {r['batch_size']} | {r['policy']} | {r['bytecodes_per_step']} | "
                     f"{o['choose']} / {o['launched']} / {o['observe']} | {r['wall_us_per_step']} |")
    write_markdown(out, lines)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['shape']} {r['batch_size']}" for r in res["rows"] if r["policy"] == "adaptive"]
    for k, name in enumerate(policies):
        vals = [r["bytecodes_per_step"] for r in res["rows"] if r["policy"] == name]
        ax.bar([i + 0.4 * k for i in range(len(vals))], vals, 0.4, label=name)
    ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("bytecodes a step")
    ax.set_title(f"the chooser's own work a step ({res['commit']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
