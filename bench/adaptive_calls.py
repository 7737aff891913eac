"""The adaptive chooser's own work per decode step (#41, CPU): Python bytecodes (deterministic) and cold wall time.

On a GPU host a small model's steps are host-bound, and there every bytecode the chooser runs between two launches
is the step's; in the engine its calls cost several times what they cost in a loop on their own (each runs once a
step, with its code and data evicted by the rest of the step; the measurements are in docs/performance.md). The
chooser (``DepthChooser``, its defaults, beside ``steady_steps=1``: the full choice at every step) is driven as the
engine drives it, choose, launched and observe a step, the verdicts one step late, over batches of a bucket's size
that either stay (``flat``) or drain a bucket a step at their end, as a benchmark batch's last requests do
(``tail``); a synthetic cost table of the shipped family's shape (23 buckets, a context slope), 0.8 acceptance per
position. Per step: the bytecodes of each call, counted; and the wall time of a step's calls with the caches evicted
between steps (a pass over a few MB, sized so that a fixed depth's calls cost about what they cost in the engine on
a GPU host), the policies interleaved batch by batch, a fixed depth beside them as the reference, the mean over the
steps of a batch of each step's median.

    python3 -m bench.adaptive_calls --out bench/results/adaptive/host/adaptive_calls_cpu
    python3 -m bench.adaptive_calls --compare COPY_OF_AN_OLDER_COMMIT --out OUT   (its chooser beside, interleaved)

``--replay A.json [B.json ...]``: instead, the calls a GPU run of ``bench.adaptive_ab --trace`` recorded for a policy
(its last batch: each choice's batch size and context, each launch's times, each round's verdicts) replayed through
this tree's chooser (and ``--compare``'s) built on that run's cost tables: its bytecodes a step and where it made
the full choice, the batch replayed twice first so that its estimate and host medians are the run's. The recorded
rounds are the engine's at the depths it ran, so the replay is faithful where the chooser picks those depths (the
trace keeps no draft lags told, lost or paused steps; a pass's first launch follows the last pass's, backwards in
time, so it samples nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import command, commit, device_name, out_path, pyplot, write_json, write_markdown

BUCKETS = [1, 2, 4, 8] + list(range(16, 257, 16))
# (the tail: the last requests of a 64-token batch finishing, as fractions of the batch, as in bench.adaptive_ab)
TAIL = (0.9, 0.77, 0.6, 0.53, 0.48, 0.45, 0.34, 0.23, 0.19, 0.12, 0.08, 0.05, 0.05, 0.02, 0.03, 0.02, 0.03)


def _table() -> tuple[dict, dict]:
    table = {b: {0: 0.2 + b * 0.002, 1: 0.28 + b * 0.003, 2: 0.33 + b * 0.004, 3: 0.37 + b * 0.0045,
                 -1: 0.06, -16: 0.1} for b in BUCKETS}
    return table, {b: {d: 1.5e-5 for d in range(4)} for b in table}


def policy(module, steady_steps: int | None):
    """The chooser of ``module`` (``speculative.adaptive``, or another tree's), its defaults or ``steady_steps``;
    ``steady_steps`` 0: a fixed depth of 3 (``DepthSchedule``)."""
    if steady_steps == 0:
        return module.DepthSchedule([3])
    table, context = _table()
    kw = {} if steady_steps is None else {"steady_steps": steady_steps}
    return module.DepthChooser(table, 3, context_costs=context, **kw)


class Engine:
    """A policy driven as the engine drives it: per step ``choose``, ``launched``, then the step before's verdicts
    (random, 0.8 acceptance per position; a seeded stream of its own, so that every policy sees the same)."""

    def __init__(self, c, bs: int, shape: str):
        self.c, self.now, self.pending, self.rng = c, 0.0, None, random.Random(0)
        self.sizes = [bs] * 16 + ([max(1, int(bs * f)) for f in TAIL] if shape == "tail" else [bs] * len(TAIL))

    def calls(self, i: int):
        """The calls of the batch's ``i``-th step: (name, function, arguments), and a function that ends the step."""
        n = self.sizes[i]
        out = [("choose", self.c.choose, (n, n * 128 + (i + 1) * n * 3)),
               ("launched", self.c.launched, (self.now, 1e-5, i > 0))]
        if self.pending is not None:
            out.append(("observe", self.c.observe, self.pending))

        def done(depth: int) -> None:
            rng = self.rng
            self.pending = (depth, [next((k for k in range(depth) if rng.random() >= 0.8), depth) for _ in range(n)])
            self.now += 0.0006 * (1 + 0.05 * rng.random())
        return out, done


def bytecodes(steady_steps: int | None, bs: int, shape: str, batches: int, warm: int) -> dict:
    """Bytecodes a step in each call (the chooser's own frames and those it calls), after ``warm`` batches."""
    from speculative import adaptive

    e = Engine(policy(adaptive, steady_steps), bs, shape)
    ops, steps = {"choose": 0, "launched": 0, "observe": 0}, 0
    for rep in range(batches):
        for i in range(len(e.sizes)):
            calls, done = e.calls(i)
            depth = None
            for name, fn, args in calls:
                got = counted(ops, name, fn, *args) if rep >= warm else fn(*args)
                depth = got if name == "choose" else depth
            steps += rep >= warm
            done(depth)
    return {k: round(v / steps, 1) for k, v in ops.items()}


def counted(ops: dict, key, fn, *args):
    """``fn(*args)``, the bytecodes it runs (its frames and those it calls) added to ``ops[key]``."""
    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            ops[key] += 1
        return tracer

    ops.setdefault(key, 0)
    sys.settrace(tracer)
    try:
        return fn(*args)
    finally:
        sys.settrace(None)


def cold(policies: dict, bs: int, shape: str, batches: int, warm: int) -> dict:
    """Per policy: the mean over a batch's steps of each step's median wall µs (all its calls), the caches evicted
    between steps; the policies interleaved batch by batch, each starting in turn, so that they share the machine's
    moods."""
    engines = {name: Engine(c, bs, shape) for name, c in policies.items()}
    junk = [float(i) for i in range(100_000)]  # (a pass over its pointers and an eighth of its floats: ~1.4 MB)
    names = list(engines)
    per = {name: [[] for _ in engines[name].sizes] for name in names}
    for rep in range(batches):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            e = engines[name]
            for i in range(len(e.sizes)):
                calls, done = e.calls(i)
                t = time.perf_counter()
                depth = calls[0][1](*calls[0][2])
                for _, fn, args in calls[1:]:
                    fn(*args)
                t = time.perf_counter() - t
                if rep >= warm:
                    per[name][i].append(t * 1e6)
                done(depth)
                s = 0.0
                for x in junk[::8]:
                    s += x
    out = {}
    for name in names:
        med = [statistics.median(v) for v in per[name]]
        out[name] = {"us_per_step": round(sum(med) / len(med), 2), "first_16": round(sum(med[:16]) / 16, 2),
                     "last_17": round(sum(med[16:]) / len(med[16:]), 2)}
    return out


def replay(module, run: dict, policy: str) -> dict:
    """``run``'s recorded calls of ``policy`` through ``module``'s chooser (its defaults), the third pass counted."""
    costs = {int(b): {int(d): c for d, c in row.items()} for b, row in run["cost_ms"].items()}
    context = {int(b): {int(d): c for d, c in row.items()} for b, row in run.get("context_cost_ms", {}).items()}
    c = module.DepthChooser(costs, 3, context_costs=context or None)
    ops, full, departed = {}, [], 0  # (ops: step → the bytecodes of its choice and the calls up to the next)
    for rep in range(3):
        i = -1
        for e in run["trace"][policy]:
            if e[0] == "choose":
                i, before = i + 1, c.full_choices
                call, args = c.choose, (e[2], e[6])
            else:
                call, args = (c.launched, e[1:4]) if e[0] == "launch" else (c.observe, e[2:4])
            got = counted(ops, max(i, 0), call, *args) if rep == 2 else call(*args)
            if rep == 2 and e[0] == "choose":
                departed += got != e[3]
                if c.full_choices > before:
                    full.append(i)
    per_step = [ops[k] for k in sorted(ops)]
    return {"bytecodes_per_step": round(sum(per_step) / len(per_step)), "per_step": per_step, "full_choices_at": full,
            "steps": len(per_step), "depths_unlike_the_run": departed}


def replay_main(a) -> None:
    from speculative import adaptive

    out = out_path(a.out)
    choosers = {"this tree": adaptive, **({"compared": adaptive_of(a.compare)} if a.compare else {})}
    res = {"device": device_name("cpu"), "commit": commit(), "command": command(), "compared": a.compare, "rows": []}
    for path in a.replay:
        run = json.loads(Path(path).read_text())
        for name, module in choosers.items():
            row = {"run": f"{run['tag']} ({run['commit']}, {run['device']})", "file": path, "chooser": name,
                   **replay(module, run, a.policy)}
            res["rows"].append(row)
            print({k: v for k, v in row.items() if k != "per_step"}, flush=True)
    write_json(out, res)
    lines = ["# The adaptive chooser on a GPU run's recorded calls (CPU replay)", "",
             f"{res['device']}; commit `{res['commit']}`; `{res['command']}`"
             + (f"; compared: the chooser of `{a.compare}`" if a.compare else ""), "",
             f"Each run's last batch of `{a.policy}` as the engine drove it (batch sizes, contexts, launch times, "
             "verdicts), replayed through each chooser on the run's cost tables, the third pass counted: bytecodes a "
             "step of its calls (choose, launched, observe), the steps where it made the full choice, and the steps "
             "where it chose another depth than the run did (its verdicts then are not that depth's).", "",
             "| run | chooser | bytecodes a step | full choices at step | depths unlike the run's |",
             "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['run']} | {r['chooser']} | {r['bytecodes_per_step']} | {r['full_choices_at']} "
                     f"| {r['depths_unlike_the_run']} of {r['steps']} |")
    write_markdown(out, lines)


def adaptive_of(tree: str):
    """Another tree's ``speculative/adaptive.py`` (a copy of an older commit), as a module of its own."""
    spec = importlib.util.spec_from_file_location("adaptive_compared", Path(tree) / "speculative" / "adaptive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="16,64,256")
    ap.add_argument("--batches", type=int, default=30, help="batches for the bytecode count")
    ap.add_argument("--cold-batches", type=int, default=60, help="batches per policy for the cold wall time")
    ap.add_argument("--compare", default=None, help="a checkout of another commit: its chooser beside, interleaved")
    ap.add_argument("--replay", nargs="+", default=None, help="bench.adaptive_ab --trace runs: replay their calls")
    ap.add_argument("--policy", default="adaptive", help="--replay: whose recorded calls")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.replay:
        return replay_main(a)
    from speculative import adaptive

    other = adaptive_of(a.compare) if a.compare else None
    out = out_path(a.out)
    res = {"device": device_name("cpu"), "commit": commit(), "command": command(), "rows": []}
    for shape in ("flat", "tail"):
        for bs in [int(x) for x in a.batch_sizes.split(",")]:
            pols = {"fixed_depth3": policy(adaptive, 0), "adaptive": policy(adaptive, None),
                    "adaptive_every_step": policy(adaptive, 1)}
            if other is not None:
                pols["adaptive (compared)"] = policy(other, None)
            walls = cold(pols, bs, shape, a.cold_batches, 5)
            counted = {"adaptive": None, "adaptive_every_step": 1}  # (this tree's choosers: their steady_steps)
            for name in pols:
                ops = bytecodes(counted[name], bs, shape, a.batches, 5) if name in counted else None
                row = {"shape": shape, "batch_size": bs, "policy": name, "bytecodes": ops,
                       "bytecodes_per_step": round(sum(ops.values())) if ops else None, "cold_us": walls[name],
                       "vs_fixed": round(walls[name]["us_per_step"] / walls["fixed_depth3"]["us_per_step"], 2)}
                res["rows"].append(row)
                print(row, flush=True)
    if other is not None:
        res["compared"] = a.compare
    write_json(out, res)
    lines = ["# The adaptive chooser's own work per step (CPU)", "",
             f"{res['device']}; commit `{res['commit']}`; `{res['command']}`"
             + (f"; compared: the chooser of `{a.compare}`" if other is not None else ""), "",
             "The chooser driven as the engine drives it (choose, launched, observe a step), 16 steps of a batch, then "
             "17 more that stay (`flat`) or drain a bucket a step (`tail`). Bytecodes a step in each call (the "
             "deterministic measure); cold wall µs a step, the caches evicted between steps and the policies "
             "interleaved (the mean over a batch's steps of each step's median; in all, over its first 16 and its "
             "last 17 steps), and its ratio to a fixed depth's calls.", "",
             "| shape | bs | policy | bytecodes a step (choose / launched / observe) "
             "| cold µs a step (first 16 / last 17) | vs fixed |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        o, w = r["bytecodes"], r["cold_us"]
        ops = f"{r['bytecodes_per_step']} ({o['choose']} / {o['launched']} / {o['observe']})" if o else ""
        lines.append(f"| {r['shape']} | {r['batch_size']} | {r['policy']} | {ops} | {w['us_per_step']} "
                     f"({w['first_16']} / {w['last_17']}) | {r['vs_fixed']}x |")
    write_markdown(out, lines)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = sorted({(r["shape"], r["batch_size"]) for r in res["rows"]}, key=lambda k: (k[0], k[1]))
    names = list(dict.fromkeys(r["policy"] for r in res["rows"]))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        vals = [next(r["cold_us"]["us_per_step"] for r in res["rows"] if (r["shape"], r["batch_size"]) == lab
                     and r["policy"] == name) for lab in labels]
        ax.bar([i + width * k for i in range(len(labels))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], [f"{s} {b}" for s, b in labels], fontsize=7)
    ax.set_ylabel("cold µs a step")
    ax.set_title(f"the chooser's own time a step, caches evicted ({res['commit']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
