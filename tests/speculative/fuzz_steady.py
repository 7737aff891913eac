"""Fuzz: ``DepthChooser`` with steady runs (its defaults) against the one that makes the full choice every step
(``steady_steps=1``), driven with identical random inputs as the engine drives them.

Per step, as ``deployments/engine/engine.py``: ``sync_lag`` (where no step is in flight), ``choose``, ``launched``,
then the verdicts of the step before (``observe``, or ``lost``; the overlap schedule). Inputs are exogenous (they do
not depend on the depths chosen), so the two choosers see the same world: a request's "potential" accepted drafts
(clamped to each chooser's depth), the batch size (stretches that stay, drain, or grow with a prefill), the context
(grows by the batch each step, sometimes jumps), each depth's host time on a noisy clock, occasional
non-contiguous launches, ``sync_lag(lag > 0)`` after a prefill, lost steps, structured-output rounds (full depth,
no launch), verdicts with every request's draft holed (``[]``), and acceptance that changes at random points.

Checks: no exception; after every full choice (and every paused one) the deferred lists are empty; the depth
sequences (a lone probe step masked: a run that ends a step or two after a change shifts the probes' phase) apart
in stretches, each counted, and flagged where longer than ``LONGEST`` steps (a run's 16 and the verdicts' step);
"begun quiet": with no change (acceptance, bucket, lag, lost step, prefill, structured step, holed verdicts,
non-contiguous launch, context jump) in the ``QUIET`` steps before. ``--alike``: a regime's rounds are alike (one
pattern of verdicts), so a run's merged update is exact and what remains apart is the run's own lag; with random
verdicts a probe's phase shift samples other verdicts, and an unprobed position's estimate can stay apart until the
next probe (or a pause's end), so long stretches there are not by themselves a fault.

    python3 -m tests.speculative.fuzz_steady --seeds 200 --steps 2000 [--alike] [--host] [--context] [--holes]
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback

from speculative.adaptive import DepthChooser

H100_8B = {1: {0: 5.467, 1: 5.911, 2: 6.201, 3: 6.504, -1: 0.380, -16: 0.393},
           16: {0: 5.697, 1: 6.720, 2: 7.069, 3: 7.389, -1: 0.379, -16: 0.476},
           64: {0: 6.814, 1: 7.755, 2: 8.865, 3: 9.873, -1: 0.414, -16: 1.015},
           128: {0: 7.956, 1: 9.764, 2: 12.690, 3: 15.356, -1: 0.445, -16: 1.859},
           256: {0: 9.876, 1: 14.949, 2: 22.993, 3: 28.453, -1: 0.548, -16: 3.533}}
KV_8B = {b: {d: 131072 / 3.35e9 for d in range(4)} for b in H100_8B}
LONGEST = 20  # (the longest stretch of different depths allowed)
QUIET = 40  # (steps after a change before the depths must agree: 2 runs of 16 and a probe's settling)


class Sim:
    """One chooser and its engine's own state (its clock, the step in flight)."""

    def __init__(self, chooser: DepthChooser):
        self.c = chooser
        self.now = 0.0
        self.pending = None  # the verdicts of the step in flight: (depth, accepted) or "lost"; None: no step
        self.depths: list[int] = []
        self.full: list[bool] = []

    def step(self, w: dict, host: dict) -> int:
        c = self.c
        if w["prefill"] and self.pending is not None:  # (a prefill step: the decode step in flight is read)
            self._apply()
        if w["guided"]:
            c.unpause()
        if self.pending is None and not c.paused:  # (no decode in flight: the batch's own lag)
            c.sync_lag(w["lag"])
        before = c.full_choices
        d = c.choose(w["bs"], w["context"])
        full = c.full_choices != before
        if full or c.paused:
            assert not c._deferred and not c._run_launches, ("deferred left after a full choice", c._deferred)
        self.depths.append(-1 if c.paused else d)
        self.full.append(full)
        if w["guided"]:
            c.sync_lag(0)
            depth = c.tiers[-1]
            new = (depth, [min(depth, a) for a in w["accept"]])
        elif c.paused:
            new = None
        else:
            self.now += host[d] / 1e3 * w["noise"] + w["waited"] + (w["gap"] if not w["contiguous"] else 0.0)
            c.launched(self.now, w["waited"], w["contiguous"] and not w["prefill"])
            new = "lost" if w["lost"] else (d, [] if w["holes"] else [min(d, a) for a in w["accept"]])
        if self.pending is not None:
            self._apply()
        self.pending = new
        return d

    def _apply(self):
        if self.pending == "lost":
            self.c.lost()
        else:
            self.c.observe(*self.pending)
        self.pending = None


def world(rng: random.Random, steps: int, opts) -> list[dict]:
    """The exogenous inputs of every step, and the steps where something changed."""
    out, bs, context, p = [], rng.choice([16, 40, 64, 100, 128, 200]), 0, [0.8, 0.8, 0.8]
    mode, left = "stay", rng.randint(20, 200)
    pattern = [next((j for j in range(3) if rng.random() >= p[j]), 3) for _ in range(256)]
    context = bs * rng.randint(50, 2000)
    for i in range(steps):
        change = False
        if rng.random() < opts.p_change:
            p = [rng.choice([0.1, 0.3, 0.5, 0.7, 0.85, 0.95]) for _ in range(3)]
            change = True
            pattern = [next((j for j in range(3) if rng.random() >= p[j]), 3) for _ in range(256)]
        left -= 1
        prefill = False
        if left <= 0:
            mode, left = rng.choice(["stay", "stay", "drain", "grow"]), rng.randint(5, 200)
        if mode == "drain" and bs > 1 and rng.random() < 0.7:
            bs = max(1, bs - rng.randint(1, max(1, bs // 8)))
        elif mode == "grow" and rng.random() < 0.1:
            bs = min(256, bs + rng.randint(1, 32))
            prefill = True
            context += rng.randint(100, 4000) * 4
        context += bs * (1 + rng.randint(0, 3))
        if rng.random() < opts.p_jump:
            context = max(bs, int(context * rng.choice([0.5, 2.0, 4.0])))
            change = True
        lag = rng.randint(1, 20) if prefill and rng.random() < 0.5 else 0
        w = {"bs": bs, "context": context if opts.context else 0, "prefill": prefill, "lag": lag,
             "lost": rng.random() < opts.p_lost, "guided": rng.random() < opts.p_guided,
             "holes": opts.holes and rng.random() < opts.p_holes,
             "contiguous": rng.random() > opts.p_gap, "gap": rng.random() * 0.01,
             "waited": rng.random() * 0.002 if rng.random() < 0.5 else 0.0,
             "noise": 1.0 + opts.host_noise * (rng.random() - 0.5),
             "accept": pattern[:bs] if opts.alike else
             [next((j for j in range(3) if rng.random() >= p[j]), 3) for _ in range(bs)]}
        w["change"] = change or prefill or lag or w["lost"] or w["guided"] or w["holes"] or not w["contiguous"]
        out.append(w)
    return out


def _unprobed(depths: list[int]) -> list[int]:
    out = list(depths)
    for i in range(1, len(depths) - 1):
        if depths[i - 1] == depths[i + 1] < depths[i]:
            out[i] = depths[i - 1]
    return out


def run_seed(seed: int, opts) -> dict:
    rng = random.Random(seed)
    steps = world(rng, opts.steps, opts)
    table = H100_8B
    host = {d: rng.uniform(4.0, 9.0) * (1 + 0.12 * d) for d in range(4)} if opts.host else {d: 5.0 for d in range(4)}
    kw = dict(num_steps=3, context_costs=KV_8B if opts.context else None, host_unit=1e3,
              host_samples=15 if opts.host else 0)
    sims = [Sim(DepthChooser(table, steady_steps=s, **kw)) for s in (16, 1)]
    res = {"seed": seed, "error": None, "quiet_diff": [], "full": 0}  # (quiet_diff: stretches over LONGEST)
    for i, w in enumerate(steps):
        bucket = sims[1].c.bucket(w["bs"])
        for s in sims:
            try:
                s.step(w, host)
            except Exception:  # noqa: BLE001
                res["error"] = (i, "steady" if s is sims[0] else "every", traceback.format_exc())
                return res
        w["bucket"] = bucket
    res["full"] = sum(sims[0].full)
    # (a probe, one step above the depths either side, is compared apart: a run that ends a step or two after a
    # change shifts the probes' phase for good, the every-step chooser's and its by as much)
    norm = [_unprobed(s.depths) for s in sims]
    res["probes"] = [len(s.depths) - sum(x == y for x, y in zip(s.depths, n)) for s, n in zip(sims, norm)]
    # stretches of steps where the depths differ: each must end within LONGEST steps (a run's 16, and the steps a
    # change takes to show in the verdicts, one step late); "quiet": begun with no change in the QUIET steps before
    last_change, prev_bucket, since = -10**9, None, None
    res["stretches"] = []
    for i, w in enumerate(steps + [None]):
        if w is not None and (w["change"] or w["bucket"] != prev_bucket):
            last_change = i
        prev_bucket = w and w["bucket"]
        same = w is None or norm[0][i] == norm[1][i]
        if not same and since is None:
            since, quiet = i, i - last_change > QUIET
        elif same and since is not None:
            res["stretches"].append((since, i - since, quiet))
            if i - since > LONGEST:
                res["quiet_diff"].append(since)
            since = None
    res["depths"] = (sims[0].depths, sims[1].depths)
    res["steps"] = steps
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--host", action="store_true", help="host clock samples on (host_samples 15)")
    ap.add_argument("--context", action="store_true", help="the 8B KV's context cost")
    ap.add_argument("--alike", action="store_true", help="a regime's rounds alike (its verdicts one pattern)")
    ap.add_argument("--holes", action="store_true", help="verdicts [] (every request's draft holed) now and then")
    ap.add_argument("--p-change", type=float, default=0.004)
    ap.add_argument("--p-jump", type=float, default=0.003)
    ap.add_argument("--p-lost", type=float, default=0.003)
    ap.add_argument("--p-guided", type=float, default=0.003)
    ap.add_argument("--p-holes", type=float, default=0.01)
    ap.add_argument("--p-gap", type=float, default=0.01)
    ap.add_argument("--host-noise", type=float, default=0.1)
    ap.add_argument("-v", action="store_true")
    opts = ap.parse_args(argv)
    errors, quiet, full, total = 0, 0, 0, 0
    n_str = n_quiet = n_steps = longest = 0
    for seed in range(opts.first, opts.first + opts.seeds):
        r = run_seed(seed, opts)
        total += opts.steps
        if r["error"]:
            errors += 1
            print(f"seed {seed}: EXCEPTION at step {r['error'][0]} ({r['error'][1]})\n{r['error'][2]}")
            continue
        full += r["full"]
        n_str += len(r["stretches"])
        n_quiet += sum(q for _, _, q in r["stretches"])
        n_steps += sum(n for _, n, _ in r["stretches"])
        longest = max([longest] + [n for _, n, _ in r["stretches"]])
        if r["quiet_diff"]:
            quiet += 1
            i = r["quiet_diff"][0]
            print(f"seed {seed}: {len(r['quiet_diff'])} stretches over {LONGEST} steps, first at {i}: "
                  f"steady {r['depths'][0][max(0, i - 8):i + 4]} every {r['depths'][1][max(0, i - 8):i + 4]}")
        elif opts.v:
            print(f"seed {seed}: ok, full choices {r['full']}/{opts.steps}, probes {r['probes']}")
    print(f"{opts.seeds} seeds x {opts.steps} steps: exceptions {errors}, seeds with long divergences {quiet}, "
          f"stretches {n_str} ({n_quiet} begun quiet), longest {longest}, steps differing {n_steps}, "
          f"full choices of the steady chooser {full}/{total - errors * opts.steps}")
    return 1 if errors or quiet else 0


if __name__ == "__main__":
    sys.exit(main())
