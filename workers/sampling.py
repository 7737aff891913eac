"""Batched sampling: greedy, temperature, top-k, top-p, min-p with per-request seeds.

Randomness is counter-based: the uniform for (seed, step, token) is a hash, so a request's samples depend only on
its own seed and output position — reproducible across batch compositions, preemption and TP ranks, with no
generator state and no host sync. Sampling uses the exponential race (argmax p_i / E_i, E_i ~ Exp(1)), which draws
exactly from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.fused_ops import argmax_logsumexp

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values < 2^32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int, stream: int = 0) -> torch.Tensor:
    """Uniforms in (0, 1), shape [B, width], a pure function of (seed, counter, column, stream)."""
    base = _mix32((seeds.long() & _MASK32) ^ _mix32((counters.long() * 0x9E37 + stream * 0x85EB + 0x27D4) & _MASK32))
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    h = _mix32((base.unsqueeze(1) + _mix32(cols).unsqueeze(0) * 0x2C1B) & _MASK32)
    return (h.double() + 0.5) / 4294967296.0


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device. temperature 0 means greedy."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64 (output position of the token being sampled)
    all_greedy: bool = False  # known on the host when the batch is built: skips the sampling kernels

    @classmethod
    def from_lists(cls, temperature, top_k, top_p, min_p, seeds, counters, device) -> "SamplingTensors":
        from workers.forward_batch import to_device

        return cls(
            temperature=to_device(temperature, torch.float32, device),
            top_k=to_device(top_k, torch.int64, device),
            top_p=to_device(top_p, torch.float32, device),
            min_p=to_device(min_p, torch.float32, device),
            seeds=to_device(seeds, torch.int64, device),
            counters=to_device(counters, torch.int64, device),
            all_greedy=all(t <= 0 for t in temperature),
        )

    def repeat_interleave(self, n: int) -> "SamplingTensors":
        """Each row repeated ``n`` times (one per draft position), counters advanced per position."""
        rep = lambda t: t.repeat_interleave(n)  # noqa: E731
        steps = torch.arange(n, device=self.counters.device).repeat(self.counters.shape[0])
        return SamplingTensors(rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p),
                               rep(self.seeds), rep(self.counters) + steps, self.all_greedy)


def processed_probs(logits: torch.Tensor, p: SamplingTensors) -> torch.Tensor:
    """The distribution a request samples from: temperature, then top-k, top-p and min-p filtering (fp32).
    Greedy rows (temperature 0) get a one-hot on the argmax."""
    logits = logits.float()
    greedy = p.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(p.temperature), p.temperature)
    probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    keep &= (p.top_k.unsqueeze(1) <= 0) | (rank < p.top_k.unsqueeze(1))
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before this token
    keep &= before < p.top_p.unsqueeze(1)
    keep &= sorted_p >= p.min_p.unsqueeze(1) * sorted_p[:, :1]
    keep[:, 0] = True
    sorted_p = sorted_p * keep
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    filtered = filtered / filtered.sum(-1, keepdim=True)
    onehot = torch.zeros_like(filtered).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), onehot, filtered)


def sample_from_probs(probs: torch.Tensor, p: SamplingTensors, stream: int = 0) -> torch.Tensor:
    """Exponential race with counter-based noise; exact draw from ``probs`` (argmax for one-hot rows)."""
    u = uniform_noise(p.seeds, p.counters, probs.shape[1], stream)
    race = probs.double() / (-torch.log(u))
    return race.argmax(-1)


TOP_LOGPROBS = 20  # alternatives computed when a request asks for any (OpenAI's most); each request keeps its own


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row under the model's raw distribution: (ids [..., k], logprobs)."""
    vals, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return ids, vals


def sample(logits: torch.Tensor, p: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (token ids [B], logprob of each sampled token under the model's raw distribution [B])."""
    greedy_ids, lse = argmax_logsumexp(logits)
    if p.all_greedy:
        ids = greedy_ids
    else:
        ids = torch.where(p.temperature <= 0, greedy_ids, sample_from_probs(processed_probs(logits, p), p))
    return ids, logits.gather(1, ids.unsqueeze(1)).squeeze(1).float() - lse
