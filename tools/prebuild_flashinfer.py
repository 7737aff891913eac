"""Compile FlashInfer's XQA JIT modules for several query lengths in parallel (each is a separate nvcc build of about
a minute; used one by one they would compile one after another on first use).

    python3 -m tools.prebuild_flashinfer --group 4 --head-dim 64 --page-size 16 --q 1,4,5,8,12
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def main() -> None:
    from flashinfer.jit.xqa import gen_xqa_module

    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="4", help="query heads per KV head, comma-separated")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--q", default="1,4,5,8", help="query rows per request (q_len_per_req), comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    specs = [gen_xqa_module(dtype, dtype, args.page_size, args.head_dim, int(g), False, dtype, int(q), False)
             for g in args.groups.split(",") for q in args.q.split(",")]
    t0 = time.time()
    with ThreadPoolExecutor(len(specs)) as pool:
        list(pool.map(lambda s: s.build(need_lock=True), specs))
    print(f"built {len(specs)} XQA modules in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
