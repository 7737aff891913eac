"""Probe: the sampling filter's sort at [B, 128256] (fp32 keys, bf16 keys), torch.topk candidates and a softmax,
each timed as CUDA-graph replays (what a filtering decode step pays for them).

    python bench/sort_probe.py bench/results/sort_probe_h100.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine_vs_hf import commit  # noqa: E402

out = {}
V = 128256
for B in (1, 16, 64):
    x = torch.randn(B, V, device="cuda").bfloat16().float()
    fns = {"sort_fp32": lambda: x.sort(dim=-1, descending=True),
           "sort_bf16": lambda: x.bfloat16().sort(dim=-1, descending=True),
           "topk_1024": lambda: x.topk(1024, dim=-1),
           "topk_64": lambda: x.topk(64, dim=-1),
           "softmax": lambda: torch.softmax(x, dim=-1)}
    for name, fn in fns.items():
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(); fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(3): g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50): g.replay()
        e1.record(); torch.cuda.synchronize()
        out[f"{name}_bs{B}_us"] = round(e0.elapsed_time(e1) / 50 * 1e3, 1)
print(json.dumps(out))
json.dump({"device": torch.cuda.get_device_name(), "commit": commit(), "command": "python " + " ".join(sys.argv),
           "torch": torch.__version__, "what": "CUDA-graph replay time of one op on [B, 128256] logits (bf16-valued fp32)", "us": out}, open(sys.argv[1], "w"), indent=1)
