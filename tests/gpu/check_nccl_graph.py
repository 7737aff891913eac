"""GPU check (2+ GPUs): the tensor-parallel collectives, eager and captured in a CUDA graph, give the right sums and
gathers on every rank — the ctypes NCCL communicator and the one-shot custom all-reduce (symmetric memory) — and
their latency per all-reduce, replayed from a graph, for decode-sized to prefill-sized tensors.

    python -m tests.gpu.check_nccl_graph [--ranks 2] [--isolated] [--json out.json]

``--isolated`` starts each rank seeing only its own GPU (CUDA_VISIBLE_DEVICES, as Ray does for a one-GPU actor);
the ranks then widen their visibility as the Worker does (workers.distributed.share_node_gpus), so that the custom
all-reduce finds its peers.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path

import torch

SIZES_KIB = [8, 32, 128, 512, 1024]  # bf16: 8 KiB is one token of an 8B model's hidden state


def _graph_time_us(fn, reps: int = 64, replays: int = 20) -> float:
    """Microseconds per call of ``fn``, captured ``reps`` times in one graph and replayed."""
    from bench.common import graph_replay_ms

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph_replay_ms(graph, replays) * 1000 / reps


def _ragged_sizes(custom, rank: int, world: int, iters: int = 20000) -> int:
    """Sizes that leave the last program's slice partly used (4096, 3073, 3073 elements: its slice holds 1024, then 1,
    then 1): a call must not take elements an older, larger call of its phase left in the slot for landed. Rank 1
    starts each 4096-element call late (a spin), so rank 0 reads before rank 1's stores land. Returns how many
    elements of the 4096-element calls were not the exact sum."""
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    total = world * (world + 1) // 2
    for i in range(iters):
        v = float(i % 64 + 1)  # sums up to 64 * total: exact in bf16
        for n in (4096, 3073, 3073):
            x = torch.full((n,), (rank + 1) * v, dtype=torch.bfloat16, device="cuda")
            if n == 4096 and rank == 1:
                torch.cuda._sleep(3000)
            y = custom.all_reduce(x)
            if n == 4096:
                wrong += (y != total * v).sum()
    torch.cuda.synchronize()
    return int(wrong)


def _pdl_chain(custom, comm, rank: int, world: int, stream) -> str:
    """The one-shot all-reduce between PDL-launched Triton kernels (the residual output of the fused add + RMSNorm
    with a zero residual: the input itself), as in a layer, in a graph, alternating a one-row and a 64-row tensor (so
    the programs count their calls apart) for 6 links; three replays of fresh random inputs must equal the same
    chain through NCCL (bit for bit with 2 ranks: a + b rounds once either way) and agree on every rank."""
    from workers.kernels.launch import pdl_launches
    from workers.kernels.norm_rope import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    ones = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    inputs = [torch.empty(rows, 4096, device="cuda", dtype=torch.bfloat16) for rows in (1, 64)]
    zeros = [torch.zeros_like(x) for x in inputs]

    def chain():
        hs = list(inputs)
        for _ in range(6):
            for i in range(2):
                hs[i] = custom.all_reduce(rms_norm(hs[i], ones, 1e-6, zeros[i])[1])
        return hs

    with pdl_launches():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for x in inputs:
                x.normal_(generator=gen)
            chain()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain()
    for _ in range(3):
        for x in inputs:
            x.normal_(generator=gen)
        graph.replay()
        refs = [x.clone() for x in inputs]
        for _ in range(6):
            refs = [comm.all_reduce(r.clone()) for r in refs]
        every = [comm.all_gather(o) for o in outs]
        torch.cuda.synchronize()
        for o, r, e in zip(outs, refs, every):
            if world == 2:
                assert torch.equal(o, r), ("PDL chain vs NCCL", (o.float() - r.float()).abs().max().item())
            else:
                assert torch.allclose(o.float(), r.float(), rtol=5e-2, atol=5e-2), "PDL chain vs NCCL"
            assert all(torch.equal(e[0], e[k]) for k in range(world)), "ranks differ in the PDL chain"
    del graph
    return "ok"


def rank_main(rank: int, world: int, port: int, isolated: bool, result_file: str) -> None:
    if isolated:  # before CUDA initialises in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch.distributed as dist

    from workers.kernels.all_reduce import create_custom_all_reduce
    from workers.kernels.launch import pdl_launches
    from workers.distributed import NcclCommunicator, share_node_gpus

    faulthandler.dump_traceback_later(240, exit=True)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    # isolated: the Worker's own remedy, every rank's GPU made visible to every rank before CUDA starts
    widened = share_node_gpus(store, rank, world) if isolated else None
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    dev = torch.device("cuda", widened if widened is not None else (0 if isolated else rank))
    torch.cuda.set_device(dev)
    result = {"rank": rank, "visible_gpus": torch.cuda.device_count(), "widened": widened is not None, "checks": {},
              "latency_us": {}}
    comm = NcclCommunicator(dist.group.WORLD, rank, world, dev)
    w = torch.full((64, 64), 1.0, device="cuda")
    x = torch.full((4, 64), float(rank + 1), device="cuda")
    expect = 64.0 * sum(range(1, world + 1))
    y = comm.all_reduce(x @ w)
    torch.cuda.synchronize()
    assert torch.all(y == expect), ("eager all-reduce", y[0, 0].item(), expect)
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
    for step in range(1, 6):
        x.fill_(float((rank + 1) * step))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.all(out == expect * 5), ("graph all-reduce", out[0, 0].item(), expect * 5)
    assert gathered.shape == (world, 4, 2) and torch.all(gathered == expect * 5)
    result["checks"]["nccl"] = "ok"
    print(f"rank {rank}: NCCL eager and graph ok", flush=True)
    del graph  # captured graphs hold the communicator's kernels: release them first, as Worker.shutdown does

    custom = create_custom_all_reduce(dist.group.WORLD, rank, world, torch.bfloat16, dev)
    result["custom_all_reduce"] = custom is not None
    if custom is not None:
        # random bf16 data: the one-shot sum must equal NCCL's bit for bit and be the same on every rank
        gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
        for rows in (1, 4, 64):
            a = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
            ours = custom.all_reduce(a)
            ref = comm.all_reduce(a.clone())
            every = comm.all_gather(ours)
            torch.cuda.synchronize()
            if world == 2:  # a + b: one rounding either way; more ranks sum in another order than NCCL's ring
                assert torch.equal(ours, ref), ("one-shot vs NCCL", rows, (ours.float() - ref.float()).abs().max())
            else:
                assert torch.allclose(ours.float(), ref.float(), rtol=2e-2, atol=2e-2), ("one-shot vs NCCL", rows)
            assert all(torch.equal(every[0], every[r]) for r in range(world)), ("ranks differ", rows)
        inp = torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                custom.all_reduce(inp.fill_(1.0))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h = inp
            for _ in range(16):  # a chain, like layers: each sum feeds the next
                h = custom.all_reduce(h * 0.5)
        for step in range(1, 4):
            inp.fill_(float(step * (rank + 1)))
            graph.replay()
            torch.cuda.synchronize()
            # each link: h -> sum over ranks of h/2 = h * world/2; start: sum over ranks of step*(r+1)/2 ...
            want = float(step * sum(range(1, world + 1))) * 0.5 * (world * 0.5) ** 15
            assert torch.allclose(h.float(), torch.full_like(h.float(), want), rtol=2e-2), \
                ("graph chain", h[0, 0].item(), want)
        result["checks"]["custom_eager_equals_nccl"] = "ok"
        result["checks"]["custom_graph_chain"] = "ok"
        print(f"rank {rank}: custom all-reduce eager == NCCL, graph chain ok", flush=True)
        del graph
        result["checks"]["custom_pdl_chain"] = _pdl_chain(custom, comm, rank, world, stream)
        print(f"rank {rank}: custom all-reduce in a PDL chain ok", flush=True)
        wrong = _ragged_sizes(custom, rank, world)
        print(f"rank {rank}: custom all-reduce, ragged sizes: {wrong} wrong elements", flush=True)
        assert wrong == 0, ("ragged sizes: wrong sums", wrong)
        result["checks"]["custom_ragged_sizes"] = "ok"

    for kib in SIZES_KIB:
        t = torch.ones(kib * 512, device="cuda", dtype=torch.bfloat16)
        row = {"nccl": round(_graph_time_us(lambda: comm.all_reduce(t)), 2)}
        if custom is not None and custom.takes(t):
            row["custom"] = round(_graph_time_us(lambda: custom.all_reduce(t)), 2)
            with pdl_launches():  # as in the engine's graphs on Hopper: each call starts while the one before ends
                row["custom_pdl"] = round(_graph_time_us(lambda: custom.all_reduce(t)), 2)
        result["latency_us"][f"{kib} KiB"] = row
    if rank == 0:
        Path(result_file).write_text(json.dumps(result))
    torch.cuda.synchronize()
    if custom is not None:
        custom.close()
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from bench.common import commit

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--isolated", action="store_true", help="each rank sees only its own GPU (as under Ray)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rf = f"/tmp/check_nccl_graph_{os.getpid()}.json"
    mp.spawn(rank_main, args=(args.ranks, 29700 + args.isolated, args.isolated, rf), nprocs=args.ranks, join=True)
    res = json.loads(Path(rf).read_text())
    res.update(device=f"{args.ranks}x {torch.cuda.get_device_name(0)}", commit=commit(), command=" ".join(sys.argv),
               isolated=args.isolated)
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print("collectives check: PASS")
