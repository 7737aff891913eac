"""Greedy tokens of the whole engine with each attention backend pair vs a reference pair (torch-native when it is in
--backends, else the first pair), speculation off and on, and speculation on vs off on the same backend.

    python -m tests.gpu.check_engine_backends --models models --dtype float32 --backends torch_native,triton [--json F]

In fp32 every comparison must be token-exact (the exit status says so); in bf16 they are reported (kernels that
round differently may break near-ties, after which sequences diverge).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig, SpeculativeConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backends", default="torch_native,triton")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = Path(args.models)
    prompts = ["def main(argv):\n", "class Config:\n    def __init__(self", "import os\nimport sys\n\n", "# utils\n"]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    specs = {"none": None,
             "eagle3-chain": SpeculativeConfig(method="eagle3", model=str(m / "specserve-tiny-eagle3"), num_steps=4),
             "eagle3-tree": SpeculativeConfig(method="eagle3", model=str(m / "specserve-tiny-eagle3"), num_steps=3,
                                              topk=3, num_draft_tokens=8)}
    names = args.backends.split(",")
    configs = [(p, d, "decode") for p in names for d in names] + [(n, n, "prefill") for n in names if n != "torch_native"]
    configs.sort(key=lambda c: c != ("torch_native", "torch_native", "decode"))  # the reference first
    rows, ok, ref, no_spec = [], True, {}, {}
    for prefill, decode, verify in configs:
        for spec_name, spec in specs.items():
            eng = Engine(EngineConfig(model=str(m / "specserve-tiny"), device="cuda", dtype=args.dtype,
                                      max_model_len=1024, kv_cache_tokens=16384, prefill_attention_backend=prefill,
                                      decode_attention_backend=decode, verify_attention_mode=verify,
                                      speculative_config=spec))
            out = eng.generate(prompts, params)
            toks = [o.token_ids for o in out]
            ref.setdefault(spec_name, toks)
            no_spec.setdefault((prefill, decode, verify), toks)
            base = no_spec[(prefill, decode, verify)]
            same_ref, same_nospec = toks == ref[spec_name], toks == base
            ok &= (same_ref and same_nospec) or args.dtype != "float32"
            acc = None
            if spec is not None:
                acc = round(1 + sum(o.spec["num_accepted_tokens"] for o in out) / sum(o.spec["num_drafts"] for o in out), 3)
            rows.append({"spec": spec_name, "prefill": prefill, "decode": decode, "verify_mode": verify,
                         "tokens_equal_reference": same_ref, "tokens_equal_spec_off": same_nospec,
                         "token_match_spec_off": round(_match(toks, base), 4), "accept_length": acc})
            print(rows[-1], flush=True)
            del eng
    if args.json:
        from bench.common import commit, device_name

        Path(args.json).write_text(json.dumps({"device": device_name("cuda"), "commit": commit(),
                                               "command": " ".join(["python3"] + sys.argv), "dtype": args.dtype,
                                               "reference": "/".join(configs[0]) + " with the same speculation",
                                               "rows": rows}, indent=2))
    sys.exit(0 if ok else 1)


def _match(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions equal (a divergence makes the rest of a sequence differ)."""
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    return same / max(1, sum(len(s) for s in b))


if __name__ == "__main__":
    main()
