"""Structured output on the device: a step's packed allowed-token bits (``WorkerStep.token_mask``) applied to its
logits before sampling or verification (-inf where a token is not allowed), so every draw and every verified draft
comes from the masked distribution; the logprobs reported are still the raw distribution's (``raw_logprobs``)."""

from __future__ import annotations

import numpy as np
import torch

from workers.kernels.argmax import argmax_logsumexp


def apply_token_mask(logits: torch.Tensor, mask: np.ndarray | torch.Tensor | None) -> torch.Tensor:
    """``logits`` [N, V] (or [B, D, V]); ``mask`` [N, ceil(V / 32)] int32 words (or [B, D, W]), one row per logits
    row: a host array, or a device tensor (a CUDA graph's static mask buffer). Returns the masked logits (a new
    tensor; the input is left as it is)."""
    if mask is None:
        return logits
    v = logits.shape[-1]
    if isinstance(mask, torch.Tensor):
        words = mask
    else:  # (a copy: the step's arrays are read-only views of the pickled message)
        words = torch.from_numpy(np.array(mask, dtype=np.int32)).to(logits.device, non_blocking=True)
    # unpacked by bytes (little-endian: token t is bit t % 8 of byte t // 8): a quarter of the int32 unpacking's
    # temporaries, which at a 128k vocabulary and a round's nodes are tens of MB a step
    octets = words.reshape(*logits.shape[:-1], -1).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    refused = ((octets.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :v] == 0
    return logits.masked_fill(refused, float("-inf"))


def raw_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities of ``ids`` [N] under the model's raw distribution, ``logits`` [N, V] before any mask: a
    guided request reports what an unguided one would (vLLM's default, and computed as ``sampling.sample`` does),
    never the renormalised or -inf values of the masked distribution."""
    return logits.gather(1, ids.unsqueeze(1)).squeeze(1).float() - argmax_logsumexp(logits)[1]
