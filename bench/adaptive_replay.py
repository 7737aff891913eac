"""The depth chooser replayed on the CPU over H100 start-up cost tables (no model runs): ``bench.adaptive``'s rows
(per batch size an untimed batch of 16 new tokens, then a timed one; the chooser fresh per shape, first warmed at
bs 16) against every fixed depth, with a host model per step (``tests/speculative/test_adaptive_replay.py``'s
``HostReplay``: the host's ms per step by batch and depth, +-10 % noise and a 3x pause every 13th step, under the
overlap schedule; with a catch-up host model, the host's ms of the draft's catch-up too). What it shows is the
chooser's logic on those tables and host models, not a measurement of the engine.

Then the slow-spell case of #41 (``test_adaptive_replay.spell_batches``): the 1B table at bs 256, L 1.5, a host whose
plain step costs 2.72 ms and round of 1 3.99 ms (4.37 of wall: the device at 1.18x the table), depth 0 the best
fixed depth, and spells of the machine (+0.27 ms of host a step for 200-600 ms, every 1.5 s on average) per seed:
fixed depths 0 and 1, the chooser without its realized-rate check (``check_pairs=0``, as before it) and with it.

    python3 -m bench.adaptive_replay --out bench/results/adaptive/cpu_replay_guard --repeats 3
"""

from __future__ import annotations

import argparse
from collections import Counter

from bench.common import command, commit, out_path, write_json, write_markdown


def main() -> None:
    from speculative.adaptive import DepthChooser, DepthSchedule
    from tests.speculative import test_adaptive_replay as t

    ap = argparse.ArgumentParser()
    ap.add_argument("--accept-lengths", default="1.5,2,3")
    ap.add_argument("--batch-sizes", default="16,64,128,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="timed batches per point, back to back (their mean)")
    ap.add_argument("--spell-seeds", type=int, default=20, help="seeds of the slow-spell case (0: none)")
    ap.add_argument("--spell-batches", type=int, default=10, help="timed batches of 128 new tokens per seed")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = out_path(a.out)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    # (shape, table, host model, its function, catch-up host model, its function)
    cases = [("1b", t.H100_1B, "light", t.light_host, "none", None),
             ("1b", t.H100_1B, "heavy", t.heavy_host, "none", None),
             ("1b", t.H100_1B, "lean", t.lean_host, "eager", t.eager_catch_up_host),
             ("1b", t.H100_1B, "lean", t.lean_host, "graph", t.graph_catch_up_host),
             ("1b", t.H100_1B, "none", None, "none", None), ("8b", t.H100_8B, "heavy", t.heavy_host, "none", None)]
    meta = {"device": "CPU (this machine): a replay of H100 tables", "commit": commit(), "command": command(),
            "new_tokens": a.new_tokens, "repeats": a.repeats, "rows": []}
    for shape, costs, host_name, host, cu_name, cu in cases:
        for length in (float(x) for x in a.accept_lengths.split(",") if x):
            rates: dict[str, dict[int, tuple[float, dict]]] = {}
            for name in ["adaptive", "no check", "table only", "no pause"] + [f"depth{d}" for d in range(t.STEPS + 1)]:
                if name.startswith("depth"):
                    policy = DepthSchedule([int(name[-1])])
                else:  # (no check: the chooser without its realized-rate check, as before it; no pause: without
                    # the draft's pause, as before it)
                    policy = DepthChooser(costs, t.STEPS, host_samples=0 if name == "table only" else 15,
                                          check_pairs=0 if name == "no check" else 3,
                                          pause_after=0 if name == "no pause" else None)
                rep = t.HostReplay(policy, length, costs, host, cu) if host else t.Replay(policy, length, costs)
                if not name.startswith("depth"):
                    rep.run(16, 16, seed=16)
                for bs in sizes:
                    rep.run(bs, 16, seed=bs)
                    start = len(rep.depths)
                    rate = sum(rep.run(bs, a.new_tokens, seed=bs + i) for i in range(a.repeats)) / a.repeats
                    rates.setdefault(name, {})[bs] = (rate, dict(sorted(Counter(rep.depths[start:]).items())))
            for bs in sizes:
                fixed = {d: rates[f"depth{d}"][bs][0] for d in range(t.STEPS + 1)}
                best = max(fixed, key=fixed.get)
                row = {"shape": shape, "host": host_name, "catch_up_host": cu_name, "accept_length": length,
                       "batch_size": bs, "best_fixed": best}
                for name in ("adaptive", "no check", "table only", "no pause"):
                    rate, depths = rates[name][bs]
                    key = name.replace(" ", "_")
                    row[f"{key}_vs_best"] = round(rate / fixed[best], 3)
                    row[f"{key}_vs_depth0"] = round(rate / fixed[0], 3)
                    row[f"{key}_depths"] = {str(d): n for d, n in depths.items()}
                meta["rows"].append(row)
                print(row, flush=True)
    meta["spell_rows"] = spell_rows(a.spell_seeds, a.spell_batches)
    write_json(out, meta)
    md = [f"# The depth chooser replayed on H100 tables with a host model ({meta['device']})", "",
          f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          "Host models (ms per step, bs = batch, d = depth): light = 0.5 + (3.4 + 0.25 d) bs / 256 (the H100 1B run "
          "at bs 256: 3.9 a plain step, 4.15 a round of 1); heavy = 0.5 + bs (3.4 / 256 + 0.004 d) (another H100 at "
          "bs 128: 2.4 and 2.9); lean = 0.3 + (2.4 + 1.4 d) bs / 256 (2.7 and 4.1 at bs 256); none = the table's times "
          "alone. Catch-up host (ms added to a step that catches the draft up): eager = 0.5 + 7.5 bs / 256 before a "
          "round short of a full stash (8 at bs 256; the table has 0.3-0.5 of device time), 0.05 on a full stash "
          "(its graph); graph = 0.05 for every catch-up (a graph per span); none = 0. adaptive: the chooser with its "
          "host samples and its realized-rate check; no check: without the check (as before it); table only: without "
          "host samples (host_samples 0); no pause: without the draft's pause (a paused step is replayed as a plain "
          "step without the catch-up; the stash's writes and the host's bookkeeping it saves are not modelled). "
          "Each ratio is the timed batches' mean decode rate "
          f"over the fixed depth's ({meta['new_tokens']} new tokens, {meta['repeats']} batch(es) back to back after "
          "an untimed batch of 16).", "",
          "| shape | host | catch-up host | L | bs | best fixed | adaptive vs best | vs depth 0 | its depths | "
          "no check vs best | its depths | table only vs best | its depths | no pause vs best | vs depth 0 |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda d: ", ".join(f"d{k}:{n}" for k, n in d.items())  # noqa: E731
    md += [f"| {r['shape']} | {r['host']} | {r['catch_up_host']} | {r['accept_length']:g} | {r['batch_size']} | "
           f"{r['best_fixed']} | "
           f"**{r['adaptive_vs_best']}x** | {r['adaptive_vs_depth0']}x | {fmt(r['adaptive_depths'])} | "
           f"{r['no_check_vs_best']}x | {fmt(r['no_check_depths'])} | "
           f"{r['table_only_vs_best']}x | {fmt(r['table_only_depths'])} | {r['no_pause_vs_best']}x | "
           f"{r['no_pause_vs_depth0']}x |" for r in meta["rows"]]
    md += spell_table(meta["spell_rows"], a.spell_batches)
    write_markdown(out, md)
    print("\n".join(md))


def spell_rows(seeds: int, batches: int) -> list[dict]:
    """Per seed of the slow-spell case: each policy's mean rate over the timed batches against fixed depth 0's, and
    its depths."""
    from speculative.adaptive import DepthChooser, DepthSchedule
    from tests.speculative import test_adaptive_replay as t

    rows = []
    for seed in range(seeds):
        policies = {"depth0": DepthSchedule([0]), "depth1": DepthSchedule([1]),
                    "no check": DepthChooser(t.H100_1B, t.STEPS, check_pairs=0),
                    "checked": DepthChooser(t.H100_1B, t.STEPS)}
        rates, row = {}, {"seed": seed}
        for name, policy in policies.items():
            rates[name], depths = t.spell_batches(policy, seed, batches)
            key = name.replace(" ", "_")
            row[f"{key}_vs_depth0"] = round(rates[name] / rates["depth0"], 4)
            if name in ("no check", "checked"):
                row[f"{key}_depths"] = {str(d): n for d, n in sorted(Counter(depths).items())}
        row["verdicts"] = policies["checked"].stats()["rate_check"]
        row["checks"] = policies["checked"].stats()["checks"]
        rows.append(row)
        print(row, flush=True)
    return rows


def spell_table(rows: list[dict], batches: int) -> list[str]:
    if not rows:
        return []
    fmt = lambda d: ", ".join(f"d{k}:{n}" for k, n in d.items())  # noqa: E731
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    md = ["", "## Slow spells: the realized-rate check (1B table, bs 256, L 1.5)", "",
          "Host: a plain step 2.72 ms, a round of 1 3.99 ms (0.3 + (2.42 + 1.27 d) bs / 256), the device at 1.18x the "
          "table (a round of 1: 4.37 ms of wall), ±10 % noise a step (no 3x pauses); spells of +0.27 ms a step for "
          "200-600 ms at exponential gaps of mean 1.5 s (seeded). Per seed: the chooser warmed at bs 16, an untimed "
          f"batch of 16 new tokens, then {batches} timed batches of 128 back to back; each policy's mean rate over "
          "fixed depth 0's. no check: the chooser without the check (check_pairs 0: as before it); checked: with it.",
          "", "| seed | depth 1 | no check | its depths | checked | its depths | its checks | last verdict |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['seed']} | {r['depth1_vs_depth0']:.3f}x | {r['no_check_vs_depth0']:.3f}x | "
           f"{fmt(r['no_check_depths'])} "
           f"| **{r['checked_vs_depth0']:.3f}x** | {fmt(r['checked_depths'])} | "
           + ", ".join(f"{k} {n}" for k, n in sorted(r["checks"].items())) + " | "
           + "; ".join(f"bs {b}: {v['verdict']} d{v['depth']} ({v['rate_vs_base']}x d{v['base']})"
                       for b, v in r["verdicts"].items()) + " |" for r in rows]
    md += [f"| mean | {mean('depth1_vs_depth0'):.3f}x | {mean('no_check_vs_depth0'):.3f}x | | "
           f"**{mean('checked_vs_depth0'):.3f}x** | | | |",
           f"| min | {min(r['depth1_vs_depth0'] for r in rows):.3f}x | "
           f"{min(r['no_check_vs_depth0'] for r in rows):.3f}x "
           f"| | **{min(r['checked_vs_depth0'] for r in rows):.3f}x** | | | |"]
    return md


if __name__ == "__main__":
    main()
