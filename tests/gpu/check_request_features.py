"""The request features of the OpenAI layer on the GPU path (Triton backends, CUDA graphs, the ``+logits`` graph
variant, grammar steps through the ``+mask`` variant) against the torch-native backend run eagerly, in fp32:
penalties, logit_bias and min_tokens, a JSON schema (xgrammar masks), prompt logprobs; without speculation and with
an EAGLE-3 chain.

    python -m tests.gpu.check_request_features [--device cuda] [--json F]

Greedy tokens must be equal to the reference's and prompt logprobs within 1e-4 (the exit status says so); seeded
sampling with penalties must give the same tokens with speculation as without it on the same backend.
"""

from __future__ import annotations

import json
import sys

from tests.gpu.tiny_check import REFERENCE_BACKENDS, checked_backends, parse_args, tiny_llama_and_eagle3, write_result


def main() -> None:
    from deployments.engine.engine import Engine
    from deployments.engine.grammar import GuidedSpec
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig, SpeculativeConfig

    args = parse_args()
    target, head = tiny_llama_and_eagle3()
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}, "c": {"enum": ["x", "y"]}},
              "required": ["b", "c"], "additionalProperties": False}  # short: complete within max_tokens
    prompts = [[5, 9, 17, 33, 2, 8], [40, 41, 42, 43], [7, 7, 7, 7, 7, 9, 11], [100, 3, 250, 17, 9],
               [12, 13, 14, 200, 301, 17, 9, 8, 77, 5]]
    greedy = dict(temperature=0.0, max_tokens=24)
    params = [SamplingParams(**greedy, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
              SamplingParams(**greedy, logit_bias={5: 5.0, 7: -100.0}),
              SamplingParams(**greedy, min_tokens=12),
              SamplingParams(**greedy, guided=GuidedSpec("json_schema", json.dumps(schema))),
              SamplingParams(**greedy, prompt_logprobs=2)]
    seeded = [SamplingParams(temperature=0.9, seed=40 + i, max_tokens=24, ignore_eos=True, frequency_penalty=0.4,
                             repetition_penalty=1.1) for i in range(len(prompts))]
    cfg = dict(model=str(target), device=args.device, dtype="float32", max_model_len=512, kv_cache_tokens=8192)
    ref = Engine(EngineConfig(**cfg, **REFERENCE_BACKENDS, disable_cuda_graph=True))
    ref_out = ref.generate(prompts, params)
    del ref
    gpu = checked_backends(args.device)
    rows, ok, no_spec_seeded = [], True, None
    for name, spec in [("none", None), ("eagle3 chain", SpeculativeConfig(method="eagle3", model=str(head),
                                                                          num_steps=3))]:
        eng = Engine(EngineConfig(**cfg, **gpu, speculative_config=spec))
        out = eng.generate(prompts, params)
        same = [o.token_ids == r.token_ids for o, r in zip(out, ref_out)]
        plp = [x for x in (out[4].prompt_logprobs or []) if x is not None]
        rlp = [x for x in (ref_out[4].prompt_logprobs or []) if x is not None]
        lp_err = max((abs(a[0] - b[0]) for a, b in zip(plp, rlp)), default=float("nan"))
        s_out = [o.token_ids for o in eng.generate(prompts, seeded)]
        no_spec_seeded = no_spec_seeded or s_out
        row = {"spec": name, "graphs": bool(eng.executor.decode_graphs),
               "greedy_equal": dict(zip(["penalties", "logit_bias", "min_tokens", "json_schema", "prompt_logprobs"],
                                        same)),
               "json_valid": _valid_json(out[3].text), "prompt_logprobs_max_abs_diff": lp_err,
               "prompt_logprobs_count": [len(plp), len(rlp)], "seeded_equal_no_spec": s_out == no_spec_seeded}
        ok &= all(same) and row["json_valid"] and lp_err < 1e-4 and len(plp) == len(rlp) > 0
        ok &= row["seeded_equal_no_spec"]
        rows.append(row)
        print(row, flush=True)
        del eng
    write_result(args.json, args.device, "torch-native, eager, fp32", rows)
    sys.exit(0 if ok else 1)


def _valid_json(text: str) -> bool:
    try:
        json.loads(text, strict=False)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
