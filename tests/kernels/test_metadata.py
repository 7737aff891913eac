"""The forward-batch metadata kernels (``workers.kernels.metadata``), run on the CPU through Triton's interpreter (in a
subprocess), against the PyTorch ops they replace."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def check_uniform_token_metadata(g) -> None:
    """The one-kernel token metadata of a uniform batch equals the PyTorch ops it replaces (the interpreter runs the
    kernel on these CPU tensors), for decode (1 token), verify-sized (4), odd (5) and prefill-sized (2500: three
    programs per request) extends, int64 and int32 sequence lengths, pages scattered."""
    import torch

    from workers.kernels import metadata

    page, pages_per = 4, 700
    table = (torch.randperm(6 * pages_per, generator=g) + 1).view(6, pages_per).to(torch.int32)
    for n, dtype in ((1, torch.int64), (4, torch.int32), (5, torch.int64), (2500, torch.int64)):  # 2500: 3 blocks
        slots = torch.tensor([5, 9, 0, 9, 3, 9], dtype=torch.int64)[::2]  # strided views, as callers may pass
        seq = torch.tensor([[n, 17 + n, 2790], [0, 0, 0]], dtype=dtype).T[:, 0]
        got = metadata.uniform_token_metadata(slots, seq, n, table, page)
        real = metadata.use_triton
        metadata.use_triton = lambda x: False
        try:
            ref = metadata.uniform_token_metadata(slots, seq, n, table, page)
        finally:
            metadata.use_triton = real
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and torch.equal(a, b), (n, a, b)
        pos = torch.cat([torch.arange(s - n, s) for s in seq.tolist()])
        assert torch.equal(ref[5], table[slots.repeat_interleave(n), pos // page].long() * page + pos % page)
        # lengths moved by an offset, the batch stacked 3 times (each copy 2 further), logits at chosen rows: the
        # same as the plain metadata of the explicit lengths
        if n < 100:
            at = torch.randint(0, n, (3,), generator=g)
            kw = dict(seq_offset=1, steps=3, seq_step=2, logits_at=at)
            got = metadata.uniform_token_metadata(slots, seq, n, table, page, **kw)
            metadata.use_triton = lambda x: False
            try:
                ref = metadata.uniform_token_metadata(slots, seq, n, table, page, **kw)
                plain = metadata.uniform_token_metadata(
                    slots.repeat(3), torch.cat([seq + 1 + 2 * i for i in range(3)]), n, table, page)
            finally:
                metadata.use_triton = real
            for a, b, c in zip(got, ref, plain[:3] + (plain[2] + at.repeat(3),) + plain[4:]):
                assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(b, c), (n, a, b, c)


def check_overlap_step_inputs(g) -> None:
    """A replayed step's inputs in one kernel: lengths and counters moved ahead by the step in flight (pending rows
    only), roots gathered by slot; the same as the PyTorch ops."""
    import torch

    from workers.kernels import metadata

    advance, last = torch.randint(1, 5, (40,), generator=g), torch.randint(0, 1000, (40,), generator=g)
    for b in (1, 7, 33):
        slots = torch.randperm(40, generator=g)[:b]
        pending = torch.randint(0, 2, (b,), generator=g)
        seq, ctr = torch.randint(1, 500, (b,), generator=g), torch.randint(0, 50, (b,), generator=g)
        got = metadata.overlap_step_inputs(slots, pending, seq, ctr, advance, last)
        ahead = pending * advance[slots]
        for a, ref in zip(got, (seq + ahead, last[slots], seq + ahead - 1, ctr + ahead)):
            assert a.dtype == torch.int64 and torch.equal(a, ref), (b, a, ref)


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_uniform_token_metadata(g)
    check_overlap_step_inputs(g)
    print("metadata ok")


def test_metadata_kernels_match_reference_in_interpreter(interpreter_checks):
    """uniform_token_metadata and overlap_step_inputs against the PyTorch ops."""
    interpreter_checks.check(__name__, "metadata ok")


if __name__ == "__main__":
    check()
