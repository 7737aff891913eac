"""What a serve config's engine costs to start, in-process: seconds from construction until it can step (weights,
KV cache, CUDA graphs, warm-ups) and device memory in use after, for the CUDA-graph sampling kinds given. Random
weights stand in for the config's checkpoints (``--model``, ``--draft``; ``python3 -m bench.common --shape ...
--eagle3-head ...`` writes them).

    python3 -m bench.startup_cost --config configs/gpu-llama3.1-8b-eagle3.yaml --model /tmp/l8 \\
        --draft /tmp/l8-eagle3 --kinds sample,filter --out bench/results/serving/sampled/startup_8b_kinds
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from bench.common import command, commit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="a serve config: its first application's engine_kwargs")
    ap.add_argument("--model", required=True, help="the checkpoint to load instead of the config's")
    ap.add_argument("--draft", default=None, help="the draft (EAGLE head) instead of the config's")
    ap.add_argument("--kinds", default="sample,filter", help="cuda_graph_sampling_kinds, comma-separated ('' none)")
    ap.add_argument("--out", required=True, help="path stem: .json is written")
    args = ap.parse_args()
    import torch

    from deployments.engine.engine import Engine
    from workers.config import EngineConfig

    kwargs = dict(yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]["engine_kwargs"])
    if args.draft and kwargs.get("speculative_config"):
        kwargs["speculative_config"] = {**kwargs["speculative_config"], "model": args.draft}
    kinds = [k for k in args.kinds.split(",") if k]
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, cuda_graph_sampling_kinds=kinds, **kwargs))
    seconds = time.perf_counter() - t0
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "commit": commit(),
              "command": command(), "config": args.config, "kinds": kinds, "startup_s": round(seconds, 1),
              "device_memory_used_gib": round((total - free) / 2**30, 2), "kv_pages": engine.allocator.capacity_pages}
    print(json.dumps(result), flush=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
