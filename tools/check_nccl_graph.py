"""GPU check (2+ GPUs): the ctypes NCCL communicator, eager and captured in a CUDA graph, gives the right sums and
gathers on every rank.

    python tools/check_nccl_graph.py [--ranks 2]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rank_main(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from workers.nccl import NcclCommunicator

    faulthandler.dump_traceback_later(60, exit=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = NcclCommunicator(dist.group.WORLD, rank, world, torch.device("cuda", rank))
    w = torch.full((64, 64), 1.0, device="cuda")
    x = torch.full((4, 64), float(rank + 1), device="cuda")
    expect = 64.0 * sum(range(1, world + 1))
    y = comm.all_reduce(x @ w)
    torch.cuda.synchronize()
    assert torch.all(y == expect), ("eager all-reduce", y[0, 0].item(), expect)
    print(f"rank {rank}: eager ok", flush=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            comm.all_reduce(x @ w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = comm.all_reduce(x @ w)
        gathered = comm.all_gather(out[:, :2])
    print(f"rank {rank}: captured", flush=True)
    for step in range(1, 6):
        x.fill_(float((rank + 1) * step))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.all(out == expect * 5), ("graph all-reduce", out[0, 0].item(), expect * 5)
    assert gathered.shape == (world, 4, 2) and torch.all(gathered == expect * 5)
    print(f"rank {rank}: graph ok", flush=True)
    del graph  # captured graphs hold the communicator's kernels: release them first, as Worker.shutdown does
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    mp.spawn(rank_main, args=(args.ranks, 29700), nprocs=args.ranks, join=True)
    print("NCCL graph check: PASS")
