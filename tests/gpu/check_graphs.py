"""CUDA graphs on the GPU: the engine's tokens with graphs (the round fused in one graph, and split into draft /
verify / draft-extend graphs) against the same engine run eagerly, for every proposer, greedy and seeded sampling;
and for the chains, adaptive speculation's depths forced to change (plain steps replaying the decode graph, the
draft's lazy catch-ups, and the draft's pause: the step without speculation's graph, then rounds on a draft with
holes) against no speculation.

    python -m tests.gpu.check_graphs --models models --dtype float32 [--json out.json]

fp32 must be token-exact (the exit status says so); the graph replays the very kernels the eager run launches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from speculative.adaptive import PAUSED, DepthSchedule
    from workers.config import EngineConfig, SpeculativeConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--specs", default=None, help="comma list of the cases to run (default: all)")
    args = ap.parse_args()
    m = Path(args.models)
    eagle3, draft = str(m / "specserve-tiny-eagle3"), str(m / "specserve-tiny-draft")
    specs = {"none": None,
             # (chains: a stash of 2 plain steps, which the forced depths below fill)
             # (adaptive: every depth's graphs at start-up, and the plain step's catch-up graphs)
             "eagle3-chain": SpeculativeConfig(method="eagle3", model=eagle3, num_steps=4, catch_up_window=2,
                                               adaptive=True),
             "eagle3-tree": SpeculativeConfig(method="eagle3", model=eagle3, num_steps=3, topk=3, num_draft_tokens=8),
             "draft-chain": SpeculativeConfig(method="draft", model=draft, num_steps=3, catch_up_window=2),
             "ngram": SpeculativeConfig(method="ngram", num_steps=3),
             "naive": SpeculativeConfig(method="naive", model=eagle3, num_steps=1)}
    if args.specs:
        specs = {k: v for k, v in specs.items() if k in args.specs.split(",")}
    prompts = ["def main(argv):\n", "class Config:\n    def __init__(self", "import os\nimport sys\n\n", "# utils\n",
               "for i in range(", "    return self."]  # 6 requests: padded to the bucket of 8
    sampling = {"greedy": SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
                "sampled": SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)}
    rows, ok = [], True
    for spec_name, spec in specs.items():
        for mode, kw in (("eager", {"disable_cuda_graph": True}), ("graphs_fused", {}),
                         ("graphs_separate", {"fuse_speculative_round": False})):
            if spec is None and mode == "graphs_separate":
                continue
            eng = Engine(EngineConfig(model=str(m / "specserve-tiny"), device="cuda", dtype=args.dtype,
                                      max_model_len=1024, kv_cache_tokens=16384, prefill_attention_backend="triton",
                                      decode_attention_backend="triton", speculative_config=spec, **kw))
            for sname, params in sampling.items():
                toks = [o.token_ids for o in eng.generate(prompts, params)]
                forced_schedule = None
                if spec is not None and spec.topk == 1 and spec_name != "naive":
                    # runs of plain steps (a stash of 2 fills), rounds of every depth after them
                    forced_schedule = [0, 0, 0, 2, 0, spec.num_steps, 0, 0, 1, 0, 0, 0, 0, 0, 1]
                if mode == "eager":
                    rows.append({"spec": spec_name, "sampling": sname, "eager_tokens": toks})
                    if forced_schedule is not None:  # the eager catch-up's acceptance, which the graphs' should equal
                        eng.depth_policy = DepthSchedule(forced_schedule)
                        rows[-1]["eager_forced_accepted"] = sum(o.spec["num_accepted_tokens"]
                                                                for o in eng.generate(prompts, params))
                        eng.depth_policy = None
                    continue
                ref = next(r for r in rows if r["spec"] == spec_name and r["sampling"] == sname and "eager_tokens" in r)
                same = toks == ref["eager_tokens"]
                ok &= same or args.dtype != "float32"
                worker = eng.executor.worker
                rows.append({"spec": spec_name, "sampling": sname, "mode": mode, "tokens_equal_eager": same,
                             "graph_replays": worker.graphs.num_replays,
                             "prefill_graph_replays": worker.extend_graphs.num_replays if worker.extend_graphs else 0,
                             # per batch bucket: whether its graphs run the norms inside the linears
                             "norms_in_linears": {str(b): f for b, f in sorted(worker.graphs.norm_fusion.items())}})
                print(rows[-1], flush=True)
                if forced_schedule is not None:
                    eng.depth_policy = DepthSchedule(forced_schedule)
                    forced_out = eng.generate(prompts, params)
                    forced = [o.token_ids for o in forced_out]
                    eng.depth_policy = None
                    plain = next(r for r in rows if r["spec"] == "none" and r["sampling"] == sname
                                 and "eager_tokens" in r)
                    same = forced == plain["eager_tokens"]
                    ok &= same or args.dtype != "float32"
                    rows[-1]["forced_depths_equal_no_spec"] = same
                    rows[-1]["catch_ups"] = list(worker.catch_ups)
                    # (where the plain step's catch-up replays a graph; the drafts' acceptance after catch-ups)
                    rows[-1]["catch_up_graphs"] = worker.graphs.catch_up_graphs
                    rows[-1]["forced_accepted_tokens"] = sum(o.spec["num_accepted_tokens"] for o in forced_out)
                    rows[-1]["eager_forced_accepted_tokens"] = ref.get("eager_forced_accepted")
                    print({"forced_depths_equal_no_spec": same, "catch_ups": worker.catch_ups,
                           "catch_up_graphs": worker.graphs.catch_up_graphs,
                           "forced_accepted_tokens": rows[-1]["forced_accepted_tokens"],
                           "eager_forced_accepted_tokens": ref.get("eager_forced_accepted")}, flush=True)
                    # the draft's pause forced on and off (after plain steps and right after a round)
                    paused_steps = eng.paused_steps
                    eng.depth_policy = DepthSchedule([0, 0, PAUSED, PAUSED, 0, 2, PAUSED, 0, spec.num_steps,
                                                      PAUSED, PAUSED, 1])
                    same = [o.token_ids for o in eng.generate(prompts, params)] == plain["eager_tokens"]
                    eng.depth_policy = None
                    ok &= same or args.dtype != "float32"
                    rows[-1]["paused_equal_no_spec"] = same
                    rows[-1]["paused_steps"] = eng.paused_steps - paused_steps
                    print({"paused_equal_no_spec": same, "paused_steps": rows[-1]["paused_steps"]}, flush=True)
            del eng
    rows = [r for r in rows if "eager_tokens" not in r]
    if args.json:
        from bench.common import commit, device_name

        Path(args.json).write_text(json.dumps({"device": device_name("cuda"), "commit": commit(),
                                               "command": " ".join(["python3"] + sys.argv), "dtype": args.dtype,
                                               "rows": rows}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
