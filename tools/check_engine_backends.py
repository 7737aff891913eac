"""Greedy tokens of the whole engine with each attention backend pair vs torch-native (GPU), speculation off and on.

    python tools/check_engine_backends.py --models models --dtype float32 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from deployments.config import EngineConfig, SpeculativeConfig
    from deployments.engine import Engine
    from deployments.request import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = Path(args.models)
    prompts = ["def main(argv):\n", "class Config:\n    def __init__(self", "import os\nimport sys\n\n", "# utils\n"]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    specs = {"none": None,
             "eagle3-chain": SpeculativeConfig(method="eagle3", model=str(m / "specserve-tiny-eagle3"), num_steps=4),
             "eagle3-tree": SpeculativeConfig(method="eagle3", model=str(m / "specserve-tiny-eagle3"), num_steps=3,
                                              topk=3, num_draft_tokens=8)}
    rows, ok = [], True
    for spec_name, spec in specs.items():
        ref = None
        for prefill, decode, verify in [("torch_native", "torch_native", "decode"), ("triton", "triton", "decode"),
                                        ("triton", "triton", "prefill"), ("torch_native", "triton", "decode"),
                                        ("triton", "torch_native", "decode")]:
            eng = Engine(EngineConfig(model=str(m / "specserve-tiny"), device="cuda", dtype=args.dtype,
                                      max_model_len=1024, kv_cache_tokens=16384, prefill_attention_backend=prefill,
                                      decode_attention_backend=decode, verify_attention_mode=verify,
                                      speculative_config=spec))
            out = eng.generate(prompts, params)
            toks = [o.token_ids for o in out]
            ref = toks if ref is None else ref
            same = toks == ref
            ok &= same or args.dtype != "float32"
            acc = None
            if spec is not None:
                acc = round(1 + sum(o.spec["num_accepted_tokens"] for o in out) / sum(o.spec["num_drafts"] for o in out), 3)
            rows.append({"spec": spec_name, "prefill": prefill, "decode": decode, "verify_mode": verify,
                         "tokens_equal_torch_native": same, "accept_length": acc})
            print(rows[-1], flush=True)
            del eng
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "rows": rows}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
