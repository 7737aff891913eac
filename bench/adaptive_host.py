"""The adaptive chooser's host cost per step against a fixed depth, on the graph path's host work alone (#41, CPU).

On a GPU a small model's steps are host-bound, and there the adaptive policy ran slower than the fixed depth it chose
(the shipped tiny family on an H100: 0.63 against 0.51 ms a step at bs 16, depth 3 either way). This builds the
engine on the CPU with the decode graphs' callables captured (as ``tests/speculative/test_adaptive.py`` runs the
graph path) and memoises each one's outputs after its first call, so that a step costs what the host does around the
replays: planning, the step message, the worker's bookkeeping, reading and applying the outputs, the policy (the
launch clock on, as with graphs). Both policies run depth ``--steps`` on every step: the fixed one by schedule, the
chooser on a uniform cost table and told that every draft was accepted (the memoised verdicts are one step's), so
it does all its per-step work (choose, launch samples, host medians, verdicts) and chooses the same depth. Repeats
alternate the two; median ms of a step per batch. Not a GPU measurement: the host's share only.

    python3 -m bench.adaptive_host --out bench/results/adaptive/host/adaptive_host_cpu
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from bench.common import ROOT, command, commit, device_name, out_path, pyplot, write_json, write_markdown


def build(model: str, head: str, steps: int, max_bs: int):
    from deployments.engine.engine import Engine
    from workers.config import EngineConfig, SpeculativeConfig

    spec = SpeculativeConfig(method="eagle3", model=head, num_steps=steps, adaptive=True)
    eng = Engine(EngineConfig(model=model, device="cpu", speculative_config=spec, cuda_graph_max_bs=max_bs,
                              max_num_seqs=max_bs, max_model_len=512))
    graphs = eng.executor.worker.graphs
    eng.executor.worker.capture_graphs()
    memo = {}

    def memoised(key, out):
        def call():
            got = memo.get(key)
            if got is None:
                got = memo[key] = out()
            return got
        return call

    for key, (graph, out) in list(graphs.graphs.items()):
        graphs.graphs[key] = (graph, memoised(key, out))
    eng.host_clock = True  # (the launch clock the graph path runs with)
    return eng


def policies(steps: int, buckets: list[int]):
    from speculative.adaptive import DepthChooser, DepthSchedule

    class Accepting(DepthChooser):  # (every draft accepted: the chooser keeps the deepest tier)
        def observe(self, depth, accepted):
            super().observe(depth, [depth] * len(accepted))

    table = {b: {**{d: 1.0 for d in range(steps + 1)}, -1: 0.01, -16: 0.02} for b in buckets}
    return {"fixed": lambda: DepthSchedule([steps]), "adaptive": lambda: Accepting(table, steps, prior=0.95)}


def run(eng, policy, bs: int, new_tokens: int, prompts) -> tuple[float, dict]:
    from deployments.engine.request import SamplingParams

    eng.depth_policy = policy
    eng.steps_by_depth.clear()
    for i in range(bs):
        eng.add_request(prompts[i % len(prompts)], SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                  ignore_eos=True))
    times, last = [], None
    while eng.has_work():
        eng.step()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return statistics.median(times) * 1e3, {str(d): n for d, n in eng.steps_by_depth.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models/specserve-tiny"))
    ap.add_argument("--spec-head", default=str(ROOT / "models/specserve-tiny-eagle3"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--max-bs", type=int, default=256, help="cuda_graph_max_bs = max_num_seqs (the chooser's buckets)")
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    out = out_path(a.out)
    eng = build(a.model, a.spec_head, a.steps, a.max_bs)
    buckets = eng.executor.worker.graphs.buckets
    made = policies(a.steps, buckets)
    g = torch.Generator().manual_seed(0)  # (prompts of 12-256 tokens)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (12, 68, 4, 160, 36, 256, 100, 20, 132, 48)]
    gc.freeze()
    res = {"device": device_name("cpu"), "commit": commit(), "command": command(), "steps": a.steps,
           "buckets": len(buckets), "rows": []}
    for bs in [int(x) for x in a.batch_sizes.split(",")]:
        row = {"batch_size": bs}
        for rep in range(a.repeats):
            for name, make in made.items():
                ms, depths = run(eng, make(), bs, a.new_tokens, prompts)
                row.setdefault(name, []).append(round(ms, 4))
                row.setdefault(f"{name}_depths", depths)
                print(bs, rep, name, round(ms, 4), depths, flush=True)
        row.update({f"{n}_median_ms": statistics.median(row[n]) for n in made})
        row["extra_us"] = round(1e3 * (row["adaptive_median_ms"] - row["fixed_median_ms"]), 1)
        res["rows"].append(row)
        write_json(out, res)
    lines = ["# The adaptive chooser's host cost per step (CPU, the graph path's host work alone)", "",
             f"{res['device']}; commit `{res['commit']}`; `{res['command']}`", "",
             f"The shipped tiny family, an EAGLE-3 chain of {a.steps}, every step at depth {a.steps} under both "
             f"policies; {len(buckets)} batch buckets; the decode graphs' callables memoised (device work left out); "
             f"median ms of a step over {a.new_tokens}-token batches, {a.repeats} alternated repeats.", "",
             "| bs | fixed depth, ms | adaptive, ms | adaptive's extra, µs | repeats (fixed / adaptive) |",
             "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['batch_size']} | {r['fixed_median_ms']:.3f} | {r['adaptive_median_ms']:.3f} | "
                     f"{r['extra_us']} | {r['fixed']} / {r['adaptive']} |")
    write_markdown(out, lines)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [r["batch_size"] for r in res["rows"]]
    for name in made:
        ax.plot(xs, [r[f"{name}_median_ms"] for r in res["rows"]], marker="o", label=name)
    ax.set_xlabel("batch size")
    ax.set_ylabel("host ms a step (median)")
    ax.set_title(f"adaptive vs fixed depth {a.steps}: host work alone ({res['commit']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"))


if __name__ == "__main__":
    main()
