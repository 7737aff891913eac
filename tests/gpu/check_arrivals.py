"""Requests arriving while others decode, on the GPU: the prefill overlap (the first token stays on the device),
mixed steps (decode rows and prompt chunks in one EXTEND forward) and separate EXTEND / DECODE steps with the decode
graphs, and speculative rounds with arrivals, against each request run alone on the torch-native backend.

    python -m tests.gpu.check_arrivals --models models --dtype float32 [--json F]

In fp32 every schedule must give the reference's greedy tokens (the exit status says so); in bf16 they are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from tests.engine.test_arrivals import ARRIVALS, drive
    from workers.config import EngineConfig, SpeculativeConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no graphs, no Triton)")
    args = ap.parse_args()
    m = Path(args.models)
    texts = ["def main(argv):\n", "class Config:\n    def __init__(self", "import os\nimport sys\n\n", "# utils\n",
             "for i in range(10):\n", "return {", "    x = np.zeros(", "if __name__ == '__main__':\n",
             "try:\n    import torch\n", "@dataclass\nclass Point:\n"]
    n_req = 1 + max(i for ids in ARRIVALS.values() for i in ids)
    texts = (texts * 2)[:n_req]
    greedy = [SamplingParams(max_tokens=16 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(n_req)]
    base = dict(model=str(m / "specserve-tiny"), device=args.device, dtype=args.dtype, max_model_len=1024,
                kv_cache_tokens=16384, max_prefill_tokens=24)
    ref_engine = Engine(EngineConfig(**base, prefill_attention_backend="torch_native",
                                     decode_attention_backend="torch_native", disable_cuda_graph=True))
    if args.device == "cuda":
        base.update(prefill_attention_backend="triton", decode_attention_backend="triton")
    reference = [ref_engine.generate([t], p)[0].token_ids for t, p in zip(texts, greedy)]  # each request alone
    del ref_engine
    eagle = SpeculativeConfig(method="eagle3", model=str(m / "specserve-tiny-eagle3"), num_steps=3)
    schedules = {
        "graphs, separate steps (the GPU default)": {},
        "graphs + mixed steps": {"mixed_decode_rows": 64},
        "mixed, serial (no overlap)": {"mixed_decode_rows": 64, "disable_overlap_schedule": True},
        "eager, mixed": {"disable_cuda_graph": True},
        "eagle3 chain, graphs": {"speculative_config": eagle, "max_num_seqs": 4},
    }
    rows, ok = [], True
    for name, kw in schedules.items():
        engine = Engine(EngineConfig(**base, **kw))
        row = {"schedule": name, "decode_graphs": bool(engine.executor.decode_graphs),
               "mixed_decode_rows": engine.scheduler.mixed_decode_rows}
        try:
            reqs, counts = drive(engine, greedy, texts)
            toks = [r.output_ids for r in reqs]
            same = toks == reference
            row.update(counts, tokens_equal_reference=same,
                       token_match=round(sum(a == b for x, y in zip(toks, reference) for a, b in zip(x, y))
                                         / sum(map(len, reference)), 4))
        except Exception as e:  # noqa: BLE001 - a schedule that fails is reported, and fails the check
            row.update(error=f"{type(e).__name__}: {e}")
            same = False
        ok &= same or args.dtype != "float32"
        rows.append(row)
        print(row, flush=True)
        del engine
    if args.json:
        from bench.common import commit, device_name

        Path(args.json).write_text(json.dumps({"device": device_name(args.device), "commit": commit(),
                                               "command": " ".join(["python3"] + sys.argv), "dtype": args.dtype,
                                               "reference": "each request alone, torch-native, eager",
                                               "rows": rows}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
