"""#41 at one batch size: no speculation against forced depths and the adaptive chooser, per tree, on one machine.

``bench.adaptive`` sweeps every batch size and depth; this times one batch size (default the 1B shape at bs 256, the
host-bound point) with more repeats (``--interleave``: both engines built at once and every policy timed in each
repeat, so that a machine's slow spell falls on all of them), and can be run from several trees in one device call
(a copy of an older commit beside the checkout: ``git archive C --prefix=ab_C/ | tar -x``, then ``cd ab_C && python3
../bench/adaptive_ab.py ...``), so that a difference between commits is not one between machines. Per policy: each
timed batch's decode tok/s and median step, the chooser's host medians and, with ``--trace``, every launch the
policy was told of in the last repeat (host time = the interval between launches less the waits for the device).

    python3 -m bench.adaptive_ab --tag main --out bench/results/adaptive/ab/ab_main_h100.json [--trace]
    python3 -m bench.adaptive_ab --report bench/results/adaptive/ab/ab_h100 FILE.json [FILE.json ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# the chooser's variants, by their keyword arguments (adaptive_nocheck: without the realized-rate check, as before it;
# adaptive_nopause: without the draft's pause, as before it; adaptive_every_step: the full choice at every step, as
# before the steady rounds; adaptive_no_host: the start-up table alone, no host samples). Fixed policies: depthN,
# and "paused" (every plain step with the draft paused: the step without speculation, run by the speculative engine)
POLICIES = {"adaptive": {}, "adaptive_p005": {"probe_budget": 0.005}, "adaptive_nocheck": {"check_pairs": 0},
            "adaptive_nopause": {"pause_after": 0}, "adaptive_no_context": {"context_costs": None},
            "adaptive_every_step": {"steady_steps": 1}, "adaptive_no_host": {"host_samples": 0}}


def _args(a) -> argparse.Namespace:  # bench.adaptive's options for one shape and batch size
    return argparse.Namespace(
        cpu=a.cpu, shapes=a.shape, ckpt_dir=a.ckpt_dir, steps=3, accept_lengths=str(a.accept_length),
        batch_sizes=str(a.bs), prompt_len=16 if a.cpu else 128, new_tokens=a.new_tokens, warm_rounds=16,
        catch_up_window=None, repeats=1, change="3.0,1.2", change_bs=4, change_steps=60, default_gc=False,
        tuning_cache_dir=None, out=a.out + "_bench", report_only=False, merge=False, policies=None)


def _traced(policy, log: list) -> None:
    """Record each choice, launch and host sample the policy sees (the chooser's own methods, wrapped), and the
    time spent in each of its per-step calls (the wrappers' own cost falls on every policy alike)."""
    choose, launched, observe = policy.choose, policy.launched, policy.observe
    clock = time.perf_counter

    def on_choose(bs, context_tokens=0):
        t = clock()
        d = choose(bs, context_tokens)
        done = clock()
        # (then the context and the full choices so far: with the verdicts below, what an offline replay needs)
        log.append(["choose", done, bs, d, getattr(policy, "lag", None), done - t, context_tokens,
                    getattr(policy, "full_choices", None)])
        return d

    def on_launch(now, waited, contiguous):
        t = clock()
        launched(now, waited, contiguous)
        log.append(["launch", now, waited, contiguous, clock() - t])

    def on_observe(depth, accepted):
        t = clock()
        observe(depth, accepted)
        log.append(["observe", clock() - t, depth, accepted])

    policy.choose, policy.launched, policy.observe = on_choose, on_launch, on_observe


def run(a) -> None:
    sys.path.insert(0, os.getcwd())  # (the tree run from: a copy of another commit imports its own modules)
    from bench.adaptive import FAMILY, Bench
    from bench.adaptive_calls import adaptive_of
    from speculative.adaptive import PAUSED, DepthChooser, DepthSchedule
    from workers.config import SpeculativeConfig

    b = Bench(_args(a))
    ckpt, head = b.checkpoint(a.shape)
    family = a.shape == FAMILY  # (the shipped family at its real acceptance, on held-out text)
    if family:
        from transformers import AutoTokenizer

        from bench.common import held_out_prompts

        b._text_prompts = held_out_prompts(AutoTokenizer.from_pretrained(str(ckpt)), 64, 128)
    res = {"tag": a.tag, "device": b.results["device"], "commit": b.results["commit"], "command": b.results["command"],
           "compared": a.compare,
           "shape": a.shape, "batch_size": a.bs, "accept_length": None if family else a.accept_length,
           "new_tokens": a.new_tokens, "rows": {}}

    def keep(name, row):
        res["rows"].setdefault(name, []).append(row)
        print(a.tag, name, row["decode_tok_s"], row["median_step_ms"], row.get("steps_by_depth"), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))

    # --interleave: both engines at once, each repeat timing every policy in turn, so that a machine's slow spell
    # falls on all of them; else no speculation's repeats first, then each policy's (the utilization counts what is
    # in use on the device: the first engine takes 0.4 of it, the second up to 0.8 in all)
    mem = {"gpu_memory_utilization": 0.4} if a.interleave and not a.cpu else {}
    plain = b.engine(ckpt, **mem)
    mem = {"gpu_memory_utilization": 0.8} if mem else {}
    b._decode_rate(plain, 1, 8)
    b._decode_rate(plain, a.bs, 16)
    if not a.interleave:
        for _ in range(a.repeats):
            keep("no_spec", b._decode_rate(plain, a.bs))
        del plain
        b.free()
    spec = SpeculativeConfig(method="eagle3", model=str(head), num_steps=3, topk=1, adaptive=True,
                             simulated_accept_length=None if family else a.accept_length)
    eng = b.engine(ckpt, spec, **mem)
    costs = eng.executor.depth_costs
    res["cost_ms"] = {str(k): {str(d): round(v, 4) for d, v in row.items()} for k, row in costs.items()}
    res["context_cost_ms"] = {str(k): {str(d): v for d, v in row.items()}
                              for k, row in (eng.executor.context_costs or {}).items()}
    if not family:
        eng.executor.worker.spec_round.set_simulated_accept_length(a.accept_length)
    policies = {}
    for name in a.policies.split(","):
        if name in POLICIES or name.startswith("adaptive_compared"):
            # (adaptive_compared: the chooser of another commit's tree, --compare, its defaults; with a suffix, as the
            # variants of POLICIES: adaptive_compared_every_step is that tree's chooser with steady_steps 1)
            compared = name.startswith("adaptive_compared")
            cls = adaptive_of(a.compare).DepthChooser if compared else DepthChooser
            variant = POLICIES["adaptive" + name.removeprefix("adaptive_compared")] if compared else POLICIES[name]
            policies[name] = cls(costs, 3, **{"context_costs": eng.executor.context_costs, **variant})
            eng.depth_policy = policies[name]
            b._decode_rate(eng, min(16, a.bs), 16)  # (untimed: the chooser learns acceptance, as bench.adaptive)
        else:
            policies[name] = eng.depth_policy = DepthSchedule(
                [PAUSED if name == "paused" else int(name.removeprefix("depth"))])
        b._decode_rate(eng, a.bs, 16)
        if a.interleave:
            continue
        for i in range(a.repeats):
            time_policy(b, eng, a, res, keep, name, policies[name], last=i == a.repeats - 1)
    if a.interleave:
        for i in range(a.repeats):
            keep("no_spec", b._decode_rate(plain, a.bs))
            for name, policy in policies.items():
                time_policy(b, eng, a, res, keep, name, policy, last=i == a.repeats - 1)
        res["interleaved"] = True
    res["summary"] = summary(res)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(a.tag, "summary", json.dumps(res["summary"]), flush=True)


def time_policy(b, eng, a, res: dict, keep, name: str, policy, last: bool) -> None:
    """One timed batch of ``policy`` (a chooser keeps what it learnt across its batches), traced if asked and last."""
    eng.depth_policy = policy
    log: list = []
    if a.trace and last:
        _traced(policy, log)
    keep(name, b._decode_rate(eng, a.bs))
    if log:
        res.setdefault("trace", {})[name] = log
    for k in ("choose", "launched", "observe"):  # (the wrappers go: the policy's next batch runs as it was built)
        policy.__dict__.pop(k, None)
    if a.profile and last:  # (one more batch, not timed: the profiler slows every step)
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        row = b._decode_rate(eng, a.bs)
        prof.disable()
        res.setdefault("profile", {})[name] = _top_functions(prof, row["decode_steps"])


def _top_functions(prof, steps: int, n: int = 25) -> list:
    """The functions of a profiled batch by own time: [name, calls, own µs per decode step, cumulative µs per step]
    (its prefill included: a comparison between policies, not an absolute)."""
    import pstats

    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [[f"{Path(f).name}:{line}({fn})", calls, round(1e6 * tt / steps, 2), round(1e6 * ct / steps, 2)]
            for (f, line, fn), (_, calls, tt, ct, _) in rows]


def summary(res: dict) -> dict:
    """Per policy: median tok/s over the repeats, its ratio to no speculation's, the median step; and from a trace,
    per depth, the median launch interval, wait for the device and host time (the interval less the wait)."""
    base = statistics.median(r["decode_tok_s"] for r in res["rows"]["no_spec"])
    out = {}
    for name, rows in res["rows"].items():
        tok = statistics.median(r["decode_tok_s"] for r in rows)
        out[name] = {"tok_s": tok, "vs_no_spec": round(tok / base, 4),
                     "median_step_ms": statistics.median(r["median_step_ms"] for r in rows)}
    # interleaved: per repeat, each policy against the best fixed depth's batch of the same repeat (on a host whose
    # speed moves between repeats, up to 2x on some, a ratio of medians mixes repeats of different speeds)
    fixed = [n for n in out if n.startswith("depth")]
    if res.get("interleaved") and fixed:
        best = max(fixed, key=lambda n: out[n]["tok_s"])
        for name, rows in res["rows"].items():
            pairs = [r["decode_tok_s"] / b["decode_tok_s"] for r, b in zip(rows, res["rows"][best])]
            out[name]["paired_vs_best_fixed"] = round(statistics.median(pairs), 4)
            out[name]["best_fixed"] = best
    for name, log in res.get("trace", {}).items():
        launches, depth = [], None
        for e in log:
            if e[0] == "choose":
                depth = e[3]
            elif e[0] == "launch" and depth is not None:
                launches.append((depth, e[1], e[2], e[3]))
                depth = None
        per: dict = {}
        for (d, t0, _, _), (_, t1, waited, contiguous) in zip(launches, launches[1:]):
            if contiguous:
                per.setdefault(d, []).append(((t1 - t0) * 1e3, waited * 1e3))
        # the policy's own calls: mean µs per chosen step (choose, launched, observe and their sum)
        at = {"choose": 5, "launch": 4, "observe": 1}  # (each entry's own time; traces before it had none)
        calls = {k: [e[i] for e in log if e[0] == k and len(e) > i] for k, i in at.items()}
        n = max(1, len(calls["choose"]))
        us = {k: round(1e6 * sum(v) / n, 2) for k, v in calls.items()}
        out[name]["policy_us_per_step"] = {**us, "total": round(sum(us.values()), 2)}
        out[name]["launches_by_depth"] = {str(d): {
            "n": len(v), "interval_ms": round(statistics.median(x for x, _ in v), 3),
            "waited_ms": round(statistics.median(w for _, w in v), 3),
            "host_ms": round(statistics.median(x - w for x, w in v), 3)} for d, v in sorted(per.items())}
    return out


def report(out: str, files: list[str]) -> None:
    from bench.common import out_path, pyplot, write_json, write_markdown

    results = [json.loads(Path(f).read_text()) for f in files]
    for r in results:
        r["summary"] = summary(r)
    path = out_path(out)
    write_json(path, {"runs": [{k: v for k, v in r.items() if k != "trace"} for r in results]})
    names = sorted({n for r in results for n in r["summary"]}, key=lambda n: (n != "no_spec", n))
    lines = ["# Adaptive speculation at one batch size, per tree (#41)", ""]
    for r in results:
        order = "; policies interleaved in each repeat" if r.get("interleaved") else ""
        compared = f"; adaptive_compared: {r['compared']}" if r.get("compared") else ""
        lines += [f"- `{r['tag']}`: {r['device']}, commit `{r['commit']}`, `{r['command']}`{order}{compared}"]
    r0 = results[0]
    accept = ("its real acceptance (held-out text)" if r0["accept_length"] is None
              else f"simulated accept length {r0['accept_length']}")
    lines += ["", f"{r0['shape']}, bs {r0['batch_size']}, {accept}, "
              f"{r0['new_tokens']} new tokens; median of the repeats (decode tok/s, ratio to no speculation in the "
              "same run, median step ms).", "",
              "| tree | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in results:
        s = r["summary"]
        cells = [f"{s[n]['tok_s']:,.0f} ({s[n]['vs_no_spec']:.3f}x, {s[n]['median_step_ms']:.3f})" if n in s else ""
                 for n in names]
        lines.append(f"| {r['tag']} | " + " | ".join(cells) + " |")
    paired = [r for r in results if any("paired_vs_best_fixed" in v for v in r["summary"].values())]
    if paired:
        lines += ["", "Interleaved runs: per repeat, tok/s over the best fixed depth's in the same repeat (its name in "
                  "brackets); median of the repeats.", "", "| tree | " + " | ".join(names) + " |",
                  "|---" * (len(names) + 1) + "|"]
        for r in paired:
            s = r["summary"]
            cells = [f"{s[n]['paired_vs_best_fixed']:.3f}x ({s[n]['best_fixed']})"
                     if "paired_vs_best_fixed" in s.get(n, {}) else "" for n in names]
            lines.append(f"| {r['tag']} | " + " | ".join(cells) + " |")
    traced = [(r, n, s) for r in results for n, s in r["summary"].items() if "launches_by_depth" in s]
    if traced:
        lines += ["", "Launches of the last repeat by depth (interval between launches, wait for the device, host "
                  "= interval less wait; medians, ms):", "", "| tree | policy | depth | n | interval | waited | host |",
                  "|---|---|---|---|---|---|---|"]
        for r, n, s in traced:
            for d, v in s["launches_by_depth"].items():
                lines.append(f"| {r['tag']} | {n} | {d} | {v['n']} | {v['interval_ms']} | {v['waited_ms']} | "
                             f"{v['host_ms']} |")
        lines += ["", "The policy's own calls in that repeat (mean µs per chosen step):", "",
                  "| tree | policy | choose | launched | observe | total |", "|---|---|---|---|---|---|"]
        for r, n, s in traced:
            u = s.get("policy_us_per_step")
            if u:
                lines.append(f"| {r['tag']} | {n} | {u['choose']} | {u['launch']} | {u['observe']} | {u['total']} |")
    for r in results:
        for n, top in r.get("profile", {}).items():
            lines += ["", f"`{r['tag']}`, {n}: functions by own time in a batch after the repeats (cProfile; µs per "
                      "decode step, own / cumulative):", "", "| function | calls | own | cumulative |",
                      "|---|---|---|---|"]
            lines += [f"| `{f}` | {c} | {own} | {cum} |" for f, c, own, cum in top[:15]]
    write_markdown(path, lines)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([j + i * width for j in range(len(results))],
               [r["summary"].get(n, {}).get("vs_no_spec", 0) for r in results], width, label=n)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))], [r["tag"] for r in results], fontsize=7)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_ylim(0.8, 1.05)
    ax.set_ylabel("decode tok/s vs no speculation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="tree")
    ap.add_argument("--out", default=None, help="the run's JSON")
    ap.add_argument("--report", nargs="+", metavar=("OUT", "FILE"), help="render OUT.md/.json/.png from runs' JSON")
    ap.add_argument("--cpu", action="store_true", help="the tiny shape on the CPU (a smoke run)")
    ap.add_argument("--shape", default=None, help="default llama-3.2-1b (--cpu: llama-smoke)")
    ap.add_argument("--ckpt-dir", default="/tmp")
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--accept-length", type=float, default=1.5, help="simulated (--shape family: its real one)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policies", default="depth0,adaptive",
                    help="depthN, paused and " + ", ".join(POLICIES) + "; adaptive_compared (--compare)")
    ap.add_argument("--compare", default=None, help="a checkout of another commit: adaptive_compared is its chooser")
    ap.add_argument("--trace", action="store_true", help="record the launches of each policy's last repeat")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile one more batch of each policy after its last repeat (own µs per step)")
    ap.add_argument("--interleave", action="store_true", help="both engines at once, every policy timed in each "
                    "repeat in turn (a slow spell of the machine then falls on all)")
    a = ap.parse_args()
    if a.report:
        return report(a.report[0], a.report[1:])
    if a.out is None:
        ap.error("--out is required to run")
    if "adaptive_compared" in a.policies and not a.compare:
        ap.error("--policies adaptive_compared* needs --compare (a checkout of the tree whose chooser it runs)")
    a.shape = a.shape or ("llama-smoke" if a.cpu else "llama-3.2-1b")
    run(a)


if __name__ == "__main__":
    main()
