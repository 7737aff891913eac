"""Logprobs on the GPU path: each emitted token's logprob and its ``top_logprobs`` (through the graph variant with
alternatives, under the overlap schedule), against the torch-native backend run eagerly with overlap off, in fp32:
without speculation, with an EAGLE-3 chain and with an EAGLE-3 tree.

    python -m tests.gpu.check_logprobs [--device cuda] [--json F]

Tokens and the alternatives' ids must equal the reference's and their logprobs agree within 1e-4; in each engine a
token's logprob must equal its own entry among its alternatives exactly (the exit status says so); the variant with
alternatives must have been replayed.
"""

from __future__ import annotations

import sys

from tests.gpu.tiny_check import (EAGER_REFERENCE, checked_backends, engine_kwargs, parse_args,
                                  speculation_cases, tiny_llama_and_eagle3, write_result)


def run(engine, prompts, params) -> list:
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    return [(r.output_ids, r.output_logprobs, r.output_top_logprobs) for r in reqs]


def own_entry_equal(out) -> bool:
    """Each token's logprob is exactly its entry among its alternatives, where it is among them."""
    for ids, lps, tops in out:
        for tok, lp, top in zip(ids, lps, tops):
            entry = dict(top).get(tok)
            if entry is not None and entry != lp:
                return False
    return True


def main() -> None:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    args = parse_args()
    target, head = tiny_llama_and_eagle3()
    prompts = [[5, 9, 17, 33, 2, 8], [40, 41, 42, 43], [7, 7, 7, 7, 7, 9, 11], [100, 3, 250, 17, 9]]
    # greedy and seeded sampling, with and without alternatives (a batch mixes them)
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 == 0 else 0.8, seed=40 + i, ignore_eos=True,
                             logprobs=True, top_logprobs=5 if i != 2 else 0) for i in range(len(prompts))]
    cfg = engine_kwargs(target, args.device)
    gpu = checked_backends(args.device)
    specs = speculation_cases(head)
    rows, ok = [], True
    for name, spec in specs:
        ref = Engine(EngineConfig(**cfg, **EAGER_REFERENCE, speculative_config=spec))
        ref_out = run(ref, prompts, params)
        del ref
        eng = Engine(EngineConfig(**cfg, **gpu, speculative_config=spec))
        if args.device == "cpu":  # the dry run: the graph path's callables, run as they are off CUDA
            eng.executor.worker.capture_graphs()
        out = run(eng, prompts, params)
        graphs = eng.executor.worker.graphs
        lp_diff = max((abs(a - b) for (_, lps, _), (_, rlps, _) in zip(out, ref_out) for a, b in zip(lps, rlps)),
                      default=0.0)
        top_diff = max((abs(a[1] - b[1]) for (_, _, tops), (_, _, rtops) in zip(out, ref_out)
                        for t, rt in zip(tops, rtops) for a, b in zip(t, rt)), default=0.0)
        row = {"spec": name, "graphs": bool(eng.executor.decode_graphs),
               "tokens_equal": [o[0] == r[0] for o, r in zip(out, ref_out)],
               "top_ids_equal": [[[t for t, _ in x] for x in o[2]] == [[t for t, _ in x] for x in r[2]]
                                 for o, r in zip(out, ref_out)],
               "max_logprob_diff": lp_diff, "max_top_logprob_diff": top_diff,
               "own_entry_equal": own_entry_equal(out), "reference_own_entry_equal": own_entry_equal(ref_out),
               "top_variants": sum(bool(k[-1]) for k in graphs.phases), "replays": graphs.num_replays}
        ok &= all(row["tokens_equal"]) and all(row["top_ids_equal"]) and lp_diff < 1e-4 and top_diff < 1e-4
        ok &= row["own_entry_equal"] and row["reference_own_entry_equal"]
        ok &= args.device == "cpu" or row["top_variants"] > 0
        rows.append(row)
        print(row, flush=True)
        del eng
    write_result(args.json, args.device, "torch-native, eager, overlap off, fp32", rows)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
