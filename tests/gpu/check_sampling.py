"""The sampler on a device: draws against the distribution they must follow, and the device's draws against the
PyTorch reference's on the CPU (the same counter-based noise, so the same tokens up to float rounding of near ties).

    python -m tests.gpu.check_sampling --device cuda --json out.json

Per kind ("sample": temperature only, the Gumbel race inside the argmax kernel; "filter": top-k / top-p / min-p,
the race over the logits at or above each row's filter floor): a chi-square test of 50,000 draws from a 6-token
distribution (pass: p-value > 1e-4), and 64 rows of 128k-token random logits drawn on the device and on the CPU,
and their filter floors (pass: at most one row's draw differs, and no row's kept-token count differs by more than
2 + 0.1% of it: fp32 sums in another order can move a top-p boundary). The exit status says whether every check
passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from workers.kernels.top_filter import filter_floor
from workers.sampling import SamplingTensors, draw, processed_probs


def main() -> None:
    from scipy.stats import chisquare

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows, ok = [], True
    cases = (("sample", 0, 1.0, 0.0), ("filter", 4, 1.0, 0.0), ("filter", 0, 0.9, 0.0), ("filter", 0, 1.0, 0.2),
             ("filter", 3, 0.95, 0.0))
    for kind, top_k, top_p, min_p in cases:
        n = 50000
        logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], device=args.device).expand(n, -1)
        p = SamplingTensors.from_lists([0.7] * n, [top_k] * n, [top_p] * n, [min_p] * n, [11] * n, list(range(n)),
                                       args.device)
        assert p.kind == kind
        probs = processed_probs(logits[:1], SamplingTensors.from_lists([0.7], [top_k], [top_p], [min_p], [11], [0],
                                                                       args.device))[0].double().cpu()
        counts = torch.bincount(draw(logits, p).cpu(), minlength=6).double()
        kept = probs > 0
        pvalue = float(chisquare(counts[kept].numpy(), (probs[kept] / probs[kept].sum() * n).numpy()).pvalue)
        outside = int(counts[~kept].sum())
        # device vs CPU reference on a large vocabulary
        g = torch.Generator().manual_seed(0)
        wide = torch.randn(64, 128256, generator=g) * 2
        def params(dev):
            return SamplingTensors.from_lists([0.8] * 64, [top_k and 50] * 64, [top_p] * 64, [min_p / 20] * 64,
                                              list(range(64)), [3] * 64, dev)

        on_device = draw(wide.to(args.device), params(args.device)).cpu()
        on_cpu = draw(wide, params("cpu"))
        differ = int((on_device != on_cpu).sum())
        floors_differ, kept_off, kept_ok = 0, 0, True
        if kind == "filter":  # a top-p boundary may move by a token or two with the order of fp32 summation
            def kept(x, q):
                floor = filter_floor(x.sort(dim=-1, descending=True).values, q.temperature, q.top_k, q.top_p, q.min_p)
                return (x >= floor.unsqueeze(1)).sum(-1).cpu()

            on_dev, ref = kept(wide.to(args.device), params(args.device)), kept(wide, params("cpu"))
            floors_differ, kept_off = int((on_dev != ref).sum()), int((on_dev - ref).abs().max())
            kept_ok = bool(((on_dev - ref).abs() <= 2 + ref // 1000).all())
        passed = pvalue > 1e-4 and outside == 0 and differ <= 1 and kept_ok
        ok &= passed
        rows.append({"kind": kind, "top_k": top_k, "top_p": top_p, "min_p": min_p, "chi2_pvalue": round(pvalue, 5),
                     "draws_outside_support": outside, "rows_differing_from_cpu_of_64": differ,
                     "floors_differing_from_cpu_of_64": floors_differ, "kept_tokens_most_off": kept_off, "ok": passed})
        print(rows[-1], flush=True)
    if args.json:
        from bench.common import commit, device_name

        Path(args.json).write_text(json.dumps({"device": device_name(args.device), "commit": commit(),
                                               "command": "python " + " ".join(sys.argv), "rows": rows}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
