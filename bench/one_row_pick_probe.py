"""Probe behind call 3 of bench/results/tuner_neighbours_h100.md (run at dc20d25 on an H100): the Llama-3.2-1B
gate/up projection [16384 x 2048] at one row on cuBLAS, on the rows-left tensor-core tile, or on the GEMV.

``variants CACHE_HOME``: copies a tuning cache that a start filled (``$XDG_CACHE_HOME/specserve``) three times, to
/tmp/c_{cublas,tile,gemv}, each with that shape's one-row entry set to one of the three. It also drops each copy's
bucket-1 norm-fusion choices, so that each start makes its own. ``time``: times the three as the tuner did then
(``replayed_ms``, back to back), five times. The code that ran, put into functions. The call was, on a GPU:

    python bench/random_llama.py --shape llama-3.2-1b --out /tmp/l1
    XDG_CACHE_HOME=/tmp/cbase python bench/gpu_perf.py --skip-hf --shape llama-3.2-1b --ckpt /tmp/l1 --parts bs1 \\
        --out m1_base_h100
    python bench/one_row_pick_probe.py variants /tmp/cbase
    python bench/one_row_pick_probe.py time
    for i in 1 2; do for v in cublas tile gemv; do XDG_CACHE_HOME=/tmp/c_$v python bench/gpu_perf.py --skip-hf \\
        --shape llama-3.2-1b --ckpt /tmp/l1 --parts bs1 --out m1_${v}_run${i}_h100; done; done
"""
import json
import os
import shutil
import sys

KEY = "16384x2048 bfloat16"
PICKS = {"cublas": None, "tile": [16, 64, 128, 4, 4, False], "gemv": [1, 8, 1024, 4, 3, False]}


def write_variants(cache_home: str) -> None:
    for name, pick in PICKS.items():
        dst = f"/tmp/c_{name}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(cache_home, dst)
        path = os.path.join(dst, "specserve", "small_m_linear.json")
        with open(path) as f:
            data = json.load(f)
        for entries in data.values():
            entries[KEY]["1"] = pick
            for k in [k for k in entries if k.startswith("norms in linears") and k.endswith("bucket 1")]:
                del entries[k]
        with open(path, "w") as f:
            json.dump(data, f)
        print(name, "written", path)


def time_picks() -> None:
    import torch
    import torch.nn.functional as F

    from workers.kernels.small_m_linear import (
        TileConfig,
        replayed_ms,
        small_m_linear,
        weight_copies,
    )

    w = torch.randn(16384, 2048, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda")
    ws = weight_copies(w)
    side = torch.cuda.Stream()
    calls = {"cublas": lambda w: F.linear(x, w), **{n: (lambda w, c=TileConfig(*p): small_m_linear(x, w, None, c))
                                                    for n, p in PICKS.items() if p is not None}}
    for rep in range(5):
        print(rep, {n: round(replayed_ms(c, ws, side) * 1e3, 2) for n, c in calls.items()}, "us", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["variants"] and len(sys.argv) == 3:
        write_variants(sys.argv[2])
    elif sys.argv[1:] == ["time"]:
        time_picks()
    else:
        sys.exit("usage: one_row_pick_probe.py variants CACHE_HOME | time")
