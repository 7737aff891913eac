"""The engine's host time per DECODE step, by batch size: planning (schedule) and a step's outputs (tokens to
requests, detokenizing, metrics), with the real Ray metrics on. These are what the overlap schedule must hide
behind the GPU's step; on a CPU the step itself (execute) is the model's own compute and is reported only for
scale. Writes JSON + markdown + PNG.

    specserve make-tiny --out /tmp/micro --layers 1 --hidden 64 --heads 4 --kv-heads 2 --vocab 2048 --max-position 2048
    python bench/host_step.py --model /tmp/micro --out bench/results/cpu_host_step
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_vs_hf import commit  # noqa: E402


def measure(model: str, batch: int, new_tokens: int, prompt_len: int, metrics: bool) -> dict:
    from deployments.config import EngineConfig
    from deployments.engine import Engine
    from deployments.metrics import EngineMetrics
    from deployments.request import SamplingParams

    eng = Engine(EngineConfig(model=model, device="cpu", max_num_seqs=batch, max_model_len=prompt_len + new_tokens + 8,
                              kv_cache_tokens=batch * (prompt_len + new_tokens + 16)),
                 metrics=EngineMetrics("host-step") if metrics else None)
    rng = random.Random(batch)
    vocab = eng.executor.model_config.vocab_size
    for _ in range(batch):
        eng.add_request([rng.randrange(10, vocab - 10) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    while len(eng.scheduler.running) < batch:  # prefills
        eng.step()
    before = dict(eng.step_time)
    while eng.has_work():
        eng.step()
    steps = eng.step_time["steps"] - before["steps"]
    row = {"batch_size": batch, "steps": steps, "metrics": metrics}
    for key in ("schedule_s", "execute_s", "outputs_s"):
        row[key.replace("_s", "_ms_per_step")] = round((eng.step_time[key] - before[key]) / steps * 1e3, 3)
    eng.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", default="8,32,96,256")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # the metrics' agent
    rows = [measure(args.model, int(b), args.new_tokens, args.prompt_len, True) for b in args.batch_sizes.split(",")]
    meta = {"device": f"CPU {platform.machine()}", "commit": commit(), "command": "python " + " ".join(sys.argv),
            "model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    md = [f"# Engine host time per DECODE step ({meta['device']})", "",
          f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          f"{args.prompt_len}-token prompts, {args.new_tokens} greedy tokens each, Ray metrics on; execute is the CPU "
          "model's own step (on a GPU it overlaps with the other two)", "",
          "| batch | steps | schedule ms | outputs ms | execute ms |", "|---|---|---|---|---|"]
    md += [f"| {r['batch_size']} | {r['steps']} | {r['schedule_ms_per_step']} | {r['outputs_ms_per_step']} | "
           f"{r['execute_ms_per_step']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["batch_size"] for r in rows]
    ax.plot(xs, [r["schedule_ms_per_step"] for r in rows], "o-", label="schedule")
    ax.plot(xs, [r["outputs_ms_per_step"] for r in rows], "o-", label="outputs")
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("host ms per step")
    ax.set_title(f"engine host time per step ({meta['device']}, {meta['commit']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print("\n".join(md))


if __name__ == "__main__":
    main()
