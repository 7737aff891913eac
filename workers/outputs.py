"""A step's outputs on their way from the device to the host, and the ``StepResult`` they become.

A step's device outputs are packed side by side into one tensor (``PackedOutputs``), copied to the host in ONE
asynchronous copy (``HostCopy``), and turned into a ``StepResult`` when the caller reads them (``Launched.result``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from workers.messages import StepResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedOutputs:
    """A step's [B] / [B, ...] device outputs side by side in one [B, W] float64 tensor (ids stay exact), and how to
    split them again. A graph's last phase returns one (the packing is captured with it), so a replayed step adds
    no kernel of its own before its device→host copy."""

    data: torch.Tensor
    widths: tuple[int, ...]
    flat: tuple[bool, ...]  # a [B] output (one value per row), not a [B, ...] one

    @classmethod
    def pack(cls, *tensors: torch.Tensor) -> "PackedOutputs":
        cols = [t.reshape(t.shape[0], -1).double() for t in tensors]
        return cls(torch.cat(cols, dim=1), tuple(c.shape[1] for c in cols), tuple(t.dim() == 1 for t in tensors))

    def rows(self, b: int) -> "PackedOutputs":
        """The first ``b`` rows (a bucket's real requests; a contiguous view)."""
        return replace(self, data=self.data[:b])


class HostCopy:
    """A step's packed outputs on their way to the host: ONE device→host copy, started now (into pinned memory,
    asynchronously) and waited for in ``columns()``."""

    # pinned host buffers of copies already read, by (shape, dtype), for later copies of that shape (a few each):
    # a pinned tensor per step cost the caching host allocator's event bookkeeping every step
    _free: dict[tuple, list[torch.Tensor]] = {}
    KEEP = 4

    def __init__(self, packed: PackedOutputs):
        self.widths, self.flat = packed.widths, packed.flat
        self.event = None
        self.waited = 0.0  # seconds ``columns`` waited for the device (the host-bound chooser leaves them out)
        if packed.data.is_cuda:
            self.key = (tuple(packed.data.shape), packed.data.dtype)
            try:
                self.host = self._free[self.key].pop()
            except (KeyError, IndexError):
                self.host = torch.empty(packed.data.shape, dtype=packed.data.dtype, pin_memory=True)
            self.host.copy_(packed.data, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed.data  # (on a CPU a "replay" runs the callable: new tensors every step)

    def columns(self) -> list[np.ndarray]:
        """The outputs as float64 host arrays ([B] or [B, W]; views of the copy)."""
        if self.event is not None:
            t0 = time.perf_counter()
            self.event.synchronize()
            self.waited = time.perf_counter() - t0
        host, out, start = self.host.numpy(), [], 0
        for width, flat in zip(self.widths, self.flat):
            out.append(host[:, start] if flat else host[:, start:start + width])
            start += width
        return out

    def release(self) -> None:
        """Its values have been read into Python objects (``columns`` waited for the copy): its pinned buffer may
        serve a later copy of its shape."""
        if self.event is not None and self.host is not None:
            free = self._free.setdefault(self.key, [])
            if len(free) < self.KEEP:
                free.append(self.host)
            self.host = None


@dataclass
class Launched:
    """A step whose work is queued on the device; ``finish`` turns its copied outputs into the StepResult."""

    step_id: int
    copy: HostCopy | None
    finish: Callable[[list[np.ndarray]], StepResult] | None
    launch_s: float
    error: str | None = None

    def result(self) -> StepResult:
        t0 = time.perf_counter()
        res = None
        if self.error is None:
            try:
                res = self.finish(self.copy.columns())
                self.copy.release()  # (every ``finish`` turns the columns into lists)
            except Exception as e:  # noqa: BLE001 - e.g. a device fault surfacing at the copy: this step fails
                logger.exception("reading a step's results failed")
                self.error = f"{type(e).__name__}: {e}"
        if res is None:
            res = StepResult(tokens=[], logprobs=[], error=self.error)
        res.step_id = self.step_id
        res.timings["worker_s"] = self.launch_s + time.perf_counter() - t0
        if self.copy is not None:
            res.timings["wait_s"] = self.copy.waited
        return res


def token_result(cols: list[np.ndarray]) -> StepResult:
    """A plain step's outputs: one token per request."""
    ids, logprobs, *top = cols
    res = StepResult(tokens=ids.astype(np.int64).tolist(), logprobs=logprobs.tolist())
    if top:  # [B, K] ids and logprobs
        res.top_logprobs = [[list(zip(i, v))] for i, v in zip(top[0].astype(np.int64).tolist(), top[1].tolist())]
    return res


def plain_round_result(cols: list[np.ndarray], caught_up: bool = False) -> StepResult:
    """Adaptive speculation's depth 0 (a plain step in a speculative engine): ``token_result`` read as a round of
    no drafts, one token each; ``caught_up``: the step caught the draft up first (``StepResult.caught_up``)."""
    res = token_result(cols)
    res.counts = [1] * len(res.tokens)
    res.caught_up = caught_up
    return res


def round_result(cols: list[np.ndarray], tree_size: int) -> StepResult:
    """A speculative round's outputs: each request's accepted drafts and bonus token."""
    accept, tokens, logprobs, *top = cols
    accept = accept.astype(np.int64)
    kept = np.arange(tokens.shape[1]) <= accept[:, None]  # [B, S+1]: the accepted drafts and the bonus token
    res = StepResult(tokens=tokens[kept].astype(np.int64).tolist(), logprobs=logprobs[kept].tolist(),
                     counts=(accept + 1).tolist(), num_drafts=tree_size - 1)
    if top:  # [B, S+1, K] ids and logprobs, each request's row flattened by the copy
        res.top_logprobs = []
        for t, ti, tv, a in zip(tokens, top[0].astype(np.int64).tolist(), top[1].tolist(), accept.tolist()):
            k = len(ti) // len(t)
            res.top_logprobs.append([list(zip(ti[j * k:(j + 1) * k], tv[j * k:(j + 1) * k]))
                                     for j in range(a + 1)])
    return res


def with_prompt_logprobs(cols: list[np.ndarray], prompt: HostCopy, rows: list[tuple[int, int, int]],
                         batch: int) -> StepResult:
    """An EXTEND step's tokens (``token_result``) and the prompt logprobs of the requests that asked: ``rows`` is
    (request index, values, alternatives) per asking request, in the order of ``prompt``'s packed rows."""
    res = token_result(cols)
    lps, *top = prompt.columns()
    lps = lps.tolist()
    top_ids = top[0].astype(np.int64).tolist() if top else None
    top_lps = top[1].tolist() if top else None
    res.prompt_logprobs = [None] * batch
    at = 0
    for i, n, k in rows:
        tops = [list(zip(top_ids[j][:k], top_lps[j][:k])) for j in range(at, at + n)] if k and top else []
        res.prompt_logprobs[i] = (lps[at:at + n], tops)
        at += n
    return res


def proposal_result(cols: list[np.ndarray]) -> StepResult:
    """A ``mask_follows`` round's draft trees: every node's token ([B, D], row-major) and parent (-2: a chain)."""
    tokens, parents = cols
    d = tokens.shape[1]
    return StepResult(tokens=tokens.astype(np.int64).reshape(-1).tolist(), logprobs=[],
                      counts=[d] * tokens.shape[0], draft_parents=parents.astype(np.int64).reshape(-1).tolist())
