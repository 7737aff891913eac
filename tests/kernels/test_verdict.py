"""The speculative round's verdict kernels (``workers.kernels.verdict``), run on the CPU through Triton's interpreter
(in a subprocess), against the PyTorch ops they replace."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def check_tree_verdict(g) -> None:
    """A round's verdict in one kernel: the same accepted counts, paths, emitted tokens and log-probs as the PyTorch
    ops, on random trees whose tokens repeat (several children match: the first wins; a walk that stopped stays
    stopped), on chains (as their explicit parents), and with a forced accept count (the benchmark's)."""
    import torch

    from workers.kernels import verdict

    def both(*args, **kwargs):
        got = verdict.tree_verdict(*args, **kwargs)
        real = verdict.use_triton
        verdict.use_triton = lambda x: False
        try:
            ref = verdict.tree_verdict(*args, **kwargs)
        finally:
            verdict.use_triton = real
        for a, r in zip(got, ref):
            assert a.dtype == r.dtype and torch.equal(a, r), (args[1].shape, a, r)
        return ref

    hits = 0
    for b, d, depth in ((6, 4, 3), (5, 8, 4), (7, 13, 5), (3, 1, 0)):
        parents = torch.full((b, d), -1, dtype=torch.int64)
        for j in range(1, d):
            parents[:, j] = torch.randint(0, j, (b,), generator=g)
        tokens = torch.randint(0, 3, (b, d), generator=g)
        choice = torch.randint(0, 3, (b, d), generator=g)
        logits = torch.randn(b * d, 5, generator=g).to(torch.bfloat16)
        lse = torch.logsumexp(logits.float(), -1).view(b, d)
        accept, path, out, logprob = both(parents, tokens, choice, lse, logits, depth)
        hits += int((accept > 1).sum())
        for i in range(b):  # what the walk emits: the target's choice along the path, with its log-prob
            assert path[i, 0] == 0 and all(parents[i, path[i, j + 1]] == path[i, j] for j in range(int(accept[i])))
            assert torch.equal(out[i], choice[i, path[i]])
            assert torch.equal(logprob[i], logits[i * d + path[i], out[i]].float() - lse[i, path[i]])
        # a chain (parents None: node j's parent is j - 1) walks as its explicit parents do
        chain = both(None, tokens, choice, lse, logits, depth)
        explicit = verdict.tree_verdict((torch.arange(d) - 1).expand(b, d).contiguous(), tokens, choice, lse,
                                          logits, depth)
        assert all(torch.equal(a, e) for a, e in zip(chain, explicit))
        if d == depth + 1:  # forced: floor(u + offset) drafts, then the target's choice
            u = torch.rand(b, generator=g)
            accept, path, out, _ = both(None, tokens, choice, lse, logits.view(b, d, 5), depth, forced=(u, 1.0))
            assert torch.equal(accept, (u + 1.0).long().clamp(0, depth)) and torch.equal(path[0], torch.arange(d))
            for i in range(b):
                a = int(accept[i])
                assert torch.equal(out[i, :a], tokens[i, 1:a + 1]) and out[i, a] == choice[i, a]
    assert hits > 0  # some walks went deeper than one hop


def check_record_round(g) -> None:
    """A round's outcome into the per-request state: last_token[slot] = out[b, accept], advance[slot] = accept + 1."""
    import torch

    from workers.kernels import verdict

    slots = torch.tensor([7, 2, 9, 4, 0, 5])[::2]  # strided
    accept = torch.tensor([0, 3, 1])
    out = torch.randint(0, 100, (3, 4), generator=g)
    last, adv = torch.zeros(10, dtype=torch.int64), torch.ones(10, dtype=torch.int64)
    verdict.record_round(slots, accept, out, last, adv)
    want_last, want_adv = torch.zeros(10, dtype=torch.int64), torch.ones(10, dtype=torch.int64)
    want_last[slots], want_adv[slots] = out[torch.arange(3), accept], accept + 1
    assert torch.equal(last, want_last) and torch.equal(adv, want_adv), (last, adv)


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_tree_verdict(g)
    check_record_round(g)
    print("verdict ok")


def test_tree_verdict_and_record_round_match_reference_in_interpreter(interpreter_checks):
    """tree_verdict and record_round against the PyTorch ops."""
    interpreter_checks.check(__name__, "verdict ok")


if __name__ == "__main__":
    check()
