"""The one-shot all-reduce kernel (``workers.kernels.all_reduce``), run on the CPU through Triton's interpreter (in a
subprocess) as rank 0 of 2, its peer played by the test."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def check_one_shot_sum(g) -> None:
    """The one-shot all-reduce kernel (``workers.kernels.all_reduce``) as rank 0 of 2, its peer played here: the peer
    has pushed its slices into slot 1 of rank 0's buffer, in the phase of each program's call count (mod 3). Rank 0
    must push its own slices into slot 0 of the peer's buffer (same phase, -0.0 sent as +0.0: -0.0 marks a slot
    empty), sum both in rank order, mark the peer's slot of its previous phase empty again, count its calls and
    leave the programs past the grid alone; sizes change between calls, a ragged last slice included."""
    import torch

    from workers.kernels.all_reduce import BLOCK, _one_shot_sum_kernel

    world, slot = 2, 4 * BLOCK

    def negative_zero(t):
        return (t == 0) & (1 / t < 0)

    for dtype in (torch.float32, torch.bfloat16):
        buffers = [torch.full((3 * world * slot,), -0.0, dtype=dtype) for _ in range(world)]
        buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        mine, peers = (b.view(3, world, slot) for b in buffers)  # [phase, slot, elements]
        calls = torch.zeros(4, dtype=torch.int64)
        for n in (BLOCK + 7, 3 * BLOCK, BLOCK + 7, 4 * BLOCK, 5, BLOCK + 7):
            x, peer = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
            x[1] = -0.0
            grid = -(-n // BLOCK)
            for p in range(grid):
                lo, hi = p * BLOCK, min(n, (p + 1) * BLOCK)
                mine[int(calls[p]) % 3, 1, lo:hi] = peer[lo:hi]
            before, out = calls.clone(), torch.empty_like(x)
            _one_shot_sum_kernel[(grid,)](x, out, buffer_ptrs, calls, n, slot, RANK=0, WORLD=world, BLOCK=BLOCK,
                                          num_warps=4)
            sent = torch.where(x == 0, torch.zeros_like(x), x)
            ref = (sent.float() + peer.float()).to(dtype)
            if dtype == torch.float32:
                assert torch.equal(out, ref), n
            else:  # the interpreter rounds fp32 to bf16 towards zero, the GPU to nearest: one unit apart at most
                assert torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=0), n
            assert torch.equal(calls[:grid], before[:grid] + 1) and torch.equal(calls[grid:], before[grid:])
            for p in range(grid):
                lo, hi = p * BLOCK, min(n, (p + 1) * BLOCK)
                phase = int(before[p]) % 3
                assert torch.equal(peers[phase, 0, lo:hi], sent[lo:hi]), (n, p)
                assert not negative_zero(peers[phase, 0, lo:hi]).any()
                # the previous phase: empty over the program's whole slice, where an earlier, larger call of that
                # phase left elements past this n (a later, larger call would take them for landed)
                assert negative_zero(mine[(phase + 2) % 3, 1, lo:lo + BLOCK]).all(), (n, p)
            peers.fill_(-0.0)  # the peer has read them


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_one_shot_sum(g)
    print("all_reduce ok")


def test_one_shot_sum_kernel_in_interpreter(interpreter_checks):
    """_one_shot_sum_kernel as rank 0 of 2."""
    interpreter_checks.check(__name__, "all_reduce ok")


if __name__ == "__main__":
    check()
