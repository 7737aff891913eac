"""The counter-based noise (``workers.kernels.rng``), run on the CPU through Triton's interpreter (in a
subprocess), against its PyTorch reference."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import assert_interpreting

pytest.importorskip("triton")


def check_counter_noise(g) -> None:
    """The sampler's counter-based noise: the fp32 Gumbel noise against float64 -log(-log u) over the whole range of
    hashes, and the one-kernel uniforms equal to the PyTorch hash's."""
    import torch

    from workers.kernels.rng import gumbel_from_hash, hash32, uniform_noise

    # the fp32 noise against float64 -log(-log u), over the whole range of hashes, the tails included
    h = torch.cat([torch.arange(0, 2**32, 2**32 // 100000), torch.arange(2**32 - 1000, 2**32), torch.arange(1000)])
    exact = -torch.log(-torch.log((h.double() + 0.5) / 2**32))
    assert torch.allclose(gumbel_from_hash(h).double(), exact, rtol=2e-6, atol=2e-6)
    assert gumbel_from_hash(h).isfinite().all() and hash32(torch.tensor([1]), torch.tensor([2]), 4, 0).shape == (1, 4)
    # the one-kernel uniforms (the interpreter runs it here) are exactly the PyTorch hash's, past one block of columns
    seeds, counters = torch.tensor([7, 2**33 + 5, 123456789]), torch.tensor([0, 17, 10**6])
    for width, stream in ((1, 7), (1500, 0)):
        ref = (hash32(seeds, counters, width, stream).double() + 0.5) / 2**32
        assert torch.equal(uniform_noise(seeds, counters, width, stream), ref)


def check() -> None:
    import torch

    assert_interpreting()
    g = torch.Generator().manual_seed(0)
    check_counter_noise(g)
    print("rng ok")


def test_rng_noise_matches_reference_in_interpreter(interpreter_checks):
    """gumbel_from_hash, hash32, uniform_noise against their references."""
    interpreter_checks.check(__name__, "rng ok")


if __name__ == "__main__":
    check()
