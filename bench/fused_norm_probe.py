"""What the norms and residual adds inside the small-M kernels cost and save, per linear of a Llama layer.

    python bench/fused_norm_probe.py --out bench/results/fused_norm_probe_h100 [--shape llama-3.2-1b]

At 1 row (the decode step) and 4 rows (an EAGLE-3 chain-of-3 verify), for each of the layer's four linears with the
tile ``small_m_linear.tune`` picks (the activated one for gate/up where ``tune_activated`` picks one): the kernel as
it runs unfused, with its input RMS-normalised inside it (q/k/v, gate/up: ``norm_eps``) or the residual stream added
to its output (o, down: ``add``), and the add + RMSNorm kernel those replace (``fused_ops.rms_norm`` with a
residual), each timed as the tuner times kernels (``replayed_ms``: back-to-back in a CUDA graph under PDL, over
weight copies worth twice the L2). Per layer the fusion saves two norm kernels and costs the four kernels' deltas;
what a whole forward gains also depends on how the norm kernels overlapped their neighbours under PDL, which only a
forward's own timing shows (``gpu_perf.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_vs_hf import commit, device_name  # noqa: E402
from bench.random_llama import SHAPES  # noqa: E402

EPS = 1e-5


def linear_shapes(shape: str) -> tuple[int, int, int]:
    """(hidden, intermediate, q/k/v output width) of a ``bench.random_llama`` shape."""
    c = SHAPES[shape]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["hidden_size"], c["intermediate_size"], c["hidden_size"] + 2 * c["num_key_value_heads"] * head_dim


def probe(rows: int, shape: str) -> dict:
    from workers.kernels import small_m_linear as sml
    from workers.kernels import tuning
    from workers.kernels.norm_rope import rms_norm

    hidden, intermediate, qkv = linear_shapes(shape)
    dev, dt = torch.device("cuda"), torch.bfloat16
    side = torch.cuda.Stream(dev)
    out = {}
    stream = torch.randn(rows, hidden, dtype=dt, device=dev)
    shapes = (("qkv_proj", qkv, hidden), ("o_proj", hidden, hidden), ("gate_up_proj", 2 * intermediate, hidden),
              ("down_proj", hidden, intermediate))
    for name, n, k in shapes:
        w = torch.randn(n, k, dtype=dt, device=dev) / k ** 0.5
        weights = tuning.weight_copies(w)
        gated = name == "down_proj"
        cfg = tuning.tune(w, None, rows, gated=gated, side=side)
        act = tuning.tune_activated(w, None, rows, cfg, side) if name == "gate_up_proj" else None
        if cfg is None:
            out[name] = {"tile": "cuBLAS"}
            continue
        if gated and cfg.weight_left:  # behind an activated gate/up the down projection's input is plain
            gated, x = False, torch.randn(rows, k, dtype=dt, device=dev)
        else:
            x = torch.randn(rows, 2 * k if gated else k, dtype=dt, device=dev)
        tile, activated = (act, True) if act is not None else (cfg, False)
        fused = ({"norm_eps": EPS} if name in ("qkv_proj", "gate_up_proj") else
                 {"add": torch.randn(rows, n // (2 if activated else 1), dtype=dt, device=dev)})
        plain_us = 1e3 * tuning.replayed_ms(lambda w: sml.small_m_linear(x, w, None, tile, gated, activated),
                                         weights, side)
        fused_us = 1e3 * tuning.replayed_ms(lambda w: sml.small_m_linear(x, w, None, tile, gated, activated, **fused),
                                         weights, side)
        out[name] = {"tile": list(tile), "activated": activated, "fused": next(iter(fused)),
                     "plain_us": round(plain_us, 2), "fused_us": round(fused_us, 2),
                     "delta_us": round(fused_us - plain_us, 2)}
    gamma = torch.ones(hidden, dtype=dt, device=dev)
    residual = torch.randn(rows, hidden, dtype=dt, device=dev)
    norm_us = 1e3 * tuning.replayed_ms(lambda w: rms_norm(stream, gamma, EPS, residual=residual), [gamma] * 8, side)
    deltas = sum(v.get("delta_us", 0.0) for v in out.values())
    return {"linears": out, "add_rms_norm_us": round(norm_us, 2),
            "saving_per_layer_us": round(2 * norm_us - deltas, 2)}


def markdown(res: dict) -> str:
    lines = [f"# Norms and adds inside the small-M kernels, {res['shape']} linears ({res['device']})", "",
             f"commit {res['commit']}, `{res['command']}`", "",
             "| rows | linear | tile | fused | unfused µs | fused µs | delta µs |", "|---|---|---|---|---|---|---|"]
    for rows, r in res["rows"].items():
        for name, v in r["linears"].items():
            if "plain_us" in v:
                lines.append(f"| {rows} | {name} | {v['tile']}{' act' if v['activated'] else ''} | {v['fused']} | "
                             f"{v['plain_us']} | {v['fused_us']} | {v['delta_us']} |")
        lines.append(f"| {rows} | add + RMSNorm kernel | | | {r['add_rms_norm_us']} | | "
                     f"saving per layer {r['saving_per_layer_us']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    args = ap.parse_args()
    res = {"device": device_name("cuda"), "commit": commit(), "command": "python " + " ".join(sys.argv),
           "shape": args.shape, "rows": {r: probe(int(r), args.shape) for r in args.rows.split(",")}}
    Path(args.out + ".json").write_text(json.dumps(res, indent=2))
    Path(args.out + ".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
