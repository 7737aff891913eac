"""The top-k / top-p / min-p filter floor kernels (``workers.kernels.top_filter``), run on the CPU through Triton's
interpreter (in a subprocess), against their reference."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def check_filter_floor(g) -> None:
    """The per-row filter floor kernels against their reference: top-k (ties with the k-th), top-p (a nucleus inside
    the first chunk, ones that reach into the second and third, with and without top-k), min-p, a row that filters
    nothing, bf16-valued logits with ties, -inf entries; and the race stays above each row's floor."""
    import torch

    from workers.kernels.argmax import argmax_logsumexp
    from workers.kernels.top_filter import filter_floor, filter_floor_reference

    n = 9000  # three chunks of three blocks of 1024
    logits = torch.randn(8, n, generator=g) * torch.tensor([3.0, 3.0, 0.3, 0.05, 3.0, 1.0, 2.0, 3.0]).unsqueeze(1)
    logits[5] = logits[5].bfloat16().float()  # ties
    logits[6, n // 2:] = float("-inf")
    temp = torch.tensor([0.7, 1.0, 1.0, 1.0, 0.0, 1.0, 0.9, 1.0])
    top_k = torch.tensor([40, 0, 0, 0, 7, 1500, 0, 0])
    top_p = torch.tensor([0.9, 0.8, 0.95, 0.5, 1.0, 0.9, 0.99, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
    desc = logits.sort(dim=-1, descending=True).values
    got = filter_floor(desc, temp, top_k, top_p, min_p)
    ref = filter_floor_reference(desc, temp, top_k, top_p, min_p)
    assert torch.equal(got, ref), (got, ref)
    half = desc.bfloat16()  # 16-bit logits, as a bf16 model's (read as fp32 inside)
    assert torch.equal(filter_floor(half, temp, top_k, top_p, min_p), filter_floor_reference(half, temp, top_k, top_p,
                                                                                             min_p))
    kept = (logits >= got.unsqueeze(1)).sum(-1)
    assert kept[7] == n and kept[4] == 7 and 1 <= kept[0] <= 40 and kept[2] > 3072 and kept[3] < kept[2], kept
    race = (torch.where(temp > 0, temp, 1.0), torch.arange(8), torch.zeros(8, dtype=torch.long), 0)
    ids = argmax_logsumexp(logits, gumbel=race, floor=got)[0]
    assert torch.all(logits.gather(1, ids.unsqueeze(1)).squeeze(1) >= got)


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_filter_floor(g)
    print("top_filter ok")


def test_filter_floor_matches_reference_in_interpreter(interpreter_checks):
    """filter_floor against filter_floor_reference, and the race above each floor."""
    interpreter_checks.check(__name__, "top_filter ok")


if __name__ == "__main__":
    check()
