"""The split-row argmax kernels (``workers.kernels.argmax``), run on the CPU through Triton's interpreter (in a
subprocess), against PyTorch: argmax + logsumexp, and the Gumbel race of sampling."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def check_argmax_logsumexp(g) -> None:
    """The split-row argmax + logsumexp (first index on ties, -inf columns, rows longer and shorter than one
    program), greedy sampling's log-probability, an EAGLE-3 remap, ids written in place."""
    import torch

    from workers.kernels.argmax import argmax_logsumexp, greedy_with_logprob

    for b, n in ((3, 50), (2, 5000), (4, 70001)):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(b, n, generator=g) * 4).to(dtype)
            logits[0, n // 3] = logits[0, n - 1] = logits[0].max() + 1  # a tie: the first index wins
            if b > 2:
                logits[2, : n // 2] = float("-inf")
            ids, lse = argmax_logsumexp(logits)
            assert ids.dtype == torch.int64 and torch.equal(ids, logits.argmax(-1)), (b, n, dtype)
            assert ids[0].item() == n // 3
            assert torch.allclose(lse, torch.logsumexp(logits.float(), -1), atol=1e-4, rtol=1e-5), (b, n, dtype)
            # greedy sampling's (argmax, its log-probability) from the same kernels: the gathered logit minus lse
            gids, glp = greedy_with_logprob(logits)
            assert torch.equal(gids, ids) and glp.dtype == torch.float32
            remap = torch.randint(0, 1000, (n,), generator=g)  # an EAGLE-3 d2t: id + remap[id]
            rids, rlse = argmax_logsumexp(logits, remap=remap)
            assert torch.equal(rids, ids + remap[ids]) and torch.equal(rlse, lse), (b, n, dtype)
            assert torch.equal(glp, logits.gather(1, ids.unsqueeze(1)).squeeze(1).float() - lse), (b, n, dtype)
            # in place: into a given [B] (a draft chain's node), or scattered by slot into a per-request state
            into = torch.full((b + 1, b), -1)
            got, _ = argmax_logsumexp(logits, remap=remap, ids_out=into[1])
            assert got.data_ptr() == into[1].data_ptr() and torch.equal(into[1], rids) and (into[0] == -1).all()
            state, slots = torch.full((2 * b + 3,), -1), torch.randperm(2 * b + 3, generator=g)[:b]
            argmax_logsumexp(logits, remap=remap, ids_out=state, ids_rows=slots)
            want = torch.full_like(state, -1)
            want[slots] = rids
            assert torch.equal(state, want), (state, want)


def check_gumbel_race(g) -> None:
    """The Gumbel race inside the split-row argmax kernel: the same uniforms as ``uniform_noise`` (hash on uint32
    lanes), so the same winners as the PyTorch reference, for several temperatures, seeds (one past 2^32), counters
    and streams, rows longer than one program, -inf entries that never win."""
    import torch

    from workers.kernels.argmax import argmax_logsumexp
    from workers.kernels.rng import uniform_noise

    for b, n in ((3, 50), (4, 9000)):
        logits = torch.randn(b, n, generator=g) * 3
        logits[0, : n // 2] = float("-inf")
        temp = torch.tensor([0.5, 1.0, 2.0, 0.8][:b])
        seeds = torch.tensor([7, 2**33 + 5, 123456789, 42][:b])
        counters = torch.tensor([0, 17, 10**6, 3][:b])
        for stream in (0, 7):
            ids = argmax_logsumexp(logits, gumbel=(temp, seeds, counters, stream))[0]
            u = uniform_noise(seeds, counters, n, stream)
            ref = (logits / temp.unsqueeze(1) + (-torch.log(-torch.log(u))).float()).argmax(-1)  # float64 noise
            assert torch.equal(ids, ref), (b, n, stream, ids, ref)
            assert ids[0] >= n // 2
    flat = torch.zeros(64, 1000)  # a uniform distribution: each counter draws its own token
    ids = argmax_logsumexp(flat, gumbel=(torch.ones(64), torch.full((64,), 3), torch.arange(64), 0))[0]
    assert len(set(ids.tolist())) > 50


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_argmax_logsumexp(g)
    check_gumbel_race(g)
    print("argmax ok")


def test_argmax_logsumexp_matches_reference_in_interpreter(interpreter_checks):
    """argmax_logsumexp / greedy_with_logprob, plain and with the Gumbel race."""
    interpreter_checks.check(__name__, "argmax ok")


if __name__ == "__main__":
    check()
