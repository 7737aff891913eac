"""Batched sampling: greedy, temperature, top-k, top-p, min-p with per-request seeds.

Randomness is counter-based: the uniform for (seed, step, token) is a hash, so a request's samples depend only on
its own seed and output position — reproducible across batch compositions, preemption and TP ranks, with no
generator state and no host sync. A draw is the Gumbel-max race: argmax_i x_i + G_i with G_i = -log(-log u_i)
draws exactly from softmax(x). For a row with only a temperature x = logits / T, raced in the same pass that
reads the logits (one kernel on the GPU, no softmax, no sort); a row with top-k / top-p / min-p races only the
tokens its filters keep, which are the logits at or above a per-row floor found from the sorted row (one sort, then
one kernel that reads only as far into each sorted row as its filters reach), so a batch says on the host whether
any row filters (``kind``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.kernels.argmax import argmax_logsumexp, greedy_with_logprob
from workers.kernels.top_filter import filter_floor
from workers.logits_processing import process_logits


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device. temperature 0 means greedy."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64 (output position of the token being sampled)
    # known on the host when the batch is built (and a CUDA graph variant each): "greedy" (every row: no sampling
    # kernels), "sample" (temperatures only: no filtering), "filter" (some row has top-k / top-p / min-p)
    kind: str = "filter"
    # penalties / logit_bias / min_tokens (``workers.logits_processing``): the per-slot state and the rows' slots;
    # None where no row of the batch uses them (a graph variant of its own)
    logits_state: object | None = None
    req_slots: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return self.kind == "greedy"

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
            kind=sampling_kind(temperature, top_k, top_p, min_p),
        )


def sampling_kind(temperature, top_k, top_p, min_p) -> str:
    """The batch's ``SamplingTensors.kind`` from its host values (lists or numpy arrays; only sampled rows count: a
    greedy row's filters are never applied)."""
    sampled = np.asarray(temperature) > 0
    if not sampled.any():
        return "greedy"
    filters = (np.asarray(top_k) > 0) | (np.asarray(top_p) < 1) | (np.asarray(min_p) > 0)
    return "filter" if filters[sampled].any() else "sample"


def processed_probs(logits: torch.Tensor, p: SamplingTensors) -> torch.Tensor:
    """The distribution a request samples from (fp32), filtered in HF transformers' order: temperature, top-k
    (with every token tied with the k-th), top-p over what top-k kept (renormalised: the smallest prefix of the
    top-k tokens holding ``top_p`` of their mass, with every token tied with its last; off at 1), min-p (relative to
    the most likely token). What is kept is every token whose logit reaches the row's ``filter_floor``. Greedy rows
    (temperature 0) get a one-hot on the argmax."""
    logits = logits.float()
    greedy = p.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(p.temperature), p.temperature)
    floor = filter_floor(logits.sort(dim=-1, descending=True).values, p.temperature, p.top_k, p.top_p, p.min_p)
    x = torch.where(logits >= floor.unsqueeze(1), logits / temp.unsqueeze(1), float("-inf"))
    filtered = torch.softmax(x, dim=-1)
    onehot = torch.zeros_like(filtered).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), onehot, filtered)


def draw(logits: torch.Tensor, p: SamplingTensors, stream: int = 0) -> torch.Tensor:
    """A token per row ([B]) drawn from the processed distribution (``processed_probs``), by the Gumbel race on
    logits / T, among the tokens at or above the row's ``filter_floor`` for rows that filter (the race of the kept
    tokens is a draw from their renormalised distribution). Rows that do not filter race the very same values
    whatever the batch's kind (the kernel divides by T in both), so their draws do not depend on the rest of the
    batch. Greedy rows (temperature 0) get a draw at T = 1 here; callers take their argmax."""
    temp = torch.where(p.temperature > 0, p.temperature, torch.ones_like(p.temperature))
    # the race: argmax_i x_i / T + G_i, G_i = -log(-log u_i) of the counter-based uniforms
    # (``kernels.rng.gumbel_from_hash``), an exact draw from softmax(x / T); one pass of the split-row argmax kernel
    floor = None
    if p.kind == "filter":  # one sort for the thresholds; no pass over [B, V] after it but the race itself
        # sorted in their own dtype (16-bit keys sort faster; the values are the same), read as fp32 after
        floor = filter_floor(logits.sort(dim=-1, descending=True).values, p.temperature, p.top_k, p.top_p, p.min_p)
    return argmax_logsumexp(logits, gumbel=(temp, p.seeds, p.counters, stream), floor=floor)[0]


TOP_LOGPROBS = 20  # alternatives computed when a request asks for any (OpenAI's most); each request keeps its own


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row under the model's raw distribution: (ids [..., k], logprobs). Each is
    its logit less the row's ``argmax_logsumexp``, as the chosen token's own logprob is, so the two agree exactly."""
    vals, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    lse = argmax_logsumexp(logits.reshape(-1, logits.shape[-1]))[1].view(logits.shape[:-1])
    return ids, vals.float() - lse.unsqueeze(-1)


def sample(logits: torch.Tensor, p: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (token ids [B], logprob of each sampled token under the model's raw distribution [B]); with logits
    processing, the token is chosen from the processed logits."""
    if p.logits_state is not None:
        x = process_logits(logits, p)
        ids = argmax_logsumexp(x)[0]
        if not p.all_greedy:
            ids = torch.where(p.temperature <= 0, ids, draw(x, p))
        lse = argmax_logsumexp(logits)[1]
        return ids, logits.gather(1, ids.unsqueeze(1)).squeeze(1).float() - lse
    if p.all_greedy:  # the argmax kernels write its log-probability too
        return greedy_with_logprob(logits)
    greedy_ids, lse = argmax_logsumexp(logits)
    ids = torch.where(p.temperature <= 0, greedy_ids, draw(logits, p))
    return ids, logits.gather(1, ids.unsqueeze(1)).squeeze(1).float() - lse
