"""Structured output on the GPU path: JSON-schema requests (beside requests without a grammar) through the ``+mask``
CUDA-graph variant (the masks a static input buffer, the step split where its logits wait for the host's masks)
under the overlap schedule, against the torch-native backend run eagerly with overlap off, in fp32: without
speculation, with an EAGLE-3 chain and with an EAGLE-3 tree.

    python -m tests.gpu.check_structured [--device cuda] [--json F]

Greedy and seeded tokens must be equal to the reference's, with overlap on and off, and every guided output must
parse as JSON (the exit status says so); the ``+mask`` graphs must have been replayed.
"""

from __future__ import annotations

import json
import sys

from tests.gpu.tiny_check import (EAGER_REFERENCE, checked_backends, engine_kwargs, parse_args,
                                  speculation_cases, tiny_llama_and_eagle3, write_result)


def main() -> None:
    from deployments.engine.engine import Engine
    from deployments.engine.grammar import GuidedSpec
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig
    from workers.graphs import MASK_VARIANT

    args = parse_args()
    target, head = tiny_llama_and_eagle3()
    schemas = [
        {"type": "object", "properties": {"b": {"type": "boolean"}, "c": {"enum": ["x", "y"]}},
         "required": ["b", "c"], "additionalProperties": False},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 500},
                                          "s": {"type": "string", "maxLength": 4}},
         "required": ["n", "s"], "additionalProperties": False},
        {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 3}},
         "required": ["a"], "additionalProperties": False},
    ]
    prompts = [[5, 9, 17, 33, 2, 8], [40, 41, 42, 43], [7, 7, 7, 7, 7, 9, 11], [100, 3, 250, 17, 9],
               [12, 13, 14, 200, 301, 17, 9, 8, 77, 5], [60, 61, 62]]
    params = []
    for i in range(len(prompts)):  # requests 2 and 5 without a grammar; greedy and seeded
        g = None if i % 3 == 2 else GuidedSpec("json_schema", json.dumps(schemas[i % len(schemas)]))
        params.append(SamplingParams(max_tokens=64 if g else 24, temperature=0.0 if i % 2 else 0.9, seed=30 + i,
                                     guided=g, ignore_eos=g is None))
    cfg = engine_kwargs(target, args.device)
    gpu = checked_backends(args.device)
    specs = speculation_cases(head)
    rows, ok = [], True
    for name, spec in specs:
        ref = Engine(EngineConfig(**cfg, **EAGER_REFERENCE, speculative_config=spec))
        ref_out = [o.token_ids for o in ref.generate(prompts, params)]
        del ref
        for overlap in (True, False):
            eng = Engine(EngineConfig(**cfg, **gpu, speculative_config=spec, disable_overlap_schedule=not overlap))
            if args.device == "cpu":  # the dry run: the graph path's callables, run as they are off CUDA
                eng.executor.worker.capture_graphs()
            out = eng.generate(prompts, params)
            graphs = eng.executor.worker.graphs
            masked = [k for k in graphs.phases if k[1].endswith(MASK_VARIANT)]
            row = {"spec": name, "overlap": overlap, "graphs": bool(eng.executor.decode_graphs),
                   "equal": [o.token_ids == r for o, r in zip(out, ref_out)],
                   "json_valid": [_valid_json(o.text) for o, p in zip(out, params) if p.guided is not None],
                   "mask_variants": [f"bucket {b} {k}{' top' if t else ''}" for b, k, t in masked],
                   "replays": graphs.num_replays, "grammar_s": eng.step_time["grammar_s"]}
            ok &= all(row["equal"]) and all(row["json_valid"])
            ok &= bool(masked)  # the +mask variant ran
            rows.append(row)
            print(row, flush=True)
            del eng
    write_result(args.json, args.device, "torch-native, eager, overlap off, fp32", rows)
    sys.exit(0 if ok else 1)


def _valid_json(text: str) -> bool:
    try:
        json.loads(text, strict=False)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
