"""A step's outputs on their way from the device to the host, and the ``StepResult`` they become.

A step's device outputs are packed side by side into one tensor (``PackedOutputs``), copied to the host in ONE
asynchronous copy (``HostCopy``), and turned into a ``StepResult`` when the caller reads them (``Launched.result``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

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
    asynchronously) and waited for in ``lists()``."""

    def __init__(self, packed: PackedOutputs):
        self.widths, self.flat = packed.widths, packed.flat
        self.event = None
        if packed.data.is_cuda:
            self.host = torch.empty(packed.data.shape, dtype=packed.data.dtype, pin_memory=True)
            self.host.copy_(packed.data, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed.data  # (on a CPU a "replay" runs the callable: new tensors every step)

    def lists(self) -> list[list]:
        if self.event is not None:
            self.event.synchronize()
        out, start = [], 0
        for width, flat in zip(self.widths, self.flat):
            out.append((self.host[:, start] if flat else self.host[:, start:start + width]).tolist())
            start += width
        return out


@dataclass
class Launched:
    """A step whose work is queued on the device; ``finish`` turns its copied outputs into the StepResult."""

    step_id: int
    copy: HostCopy | None
    finish: Callable[[list[list]], StepResult] | None
    launch_s: float
    error: str | None = None

    def result(self) -> StepResult:
        t0 = time.perf_counter()
        res = None
        if self.error is None:
            try:
                res = self.finish(self.copy.lists())
            except Exception as e:  # noqa: BLE001 - e.g. a device fault surfacing at the copy: this step fails
                logger.exception("reading a step's results failed")
                self.error = f"{type(e).__name__}: {e}"
        if res is None:
            res = StepResult(tokens=[], logprobs=[], error=self.error)
        res.step_id = self.step_id
        res.timings["worker_s"] = self.launch_s + time.perf_counter() - t0
        return res


def token_result(lists: list[list]) -> StepResult:
    """A plain step's outputs: one token per request."""
    ids, logprobs, *top = lists
    res = StepResult(tokens=[[t] for t in map(int, ids)], logprobs=[[lp] for lp in logprobs])
    if top:  # [B, K] ids and logprobs
        res.top_logprobs = [[list(zip(map(int, i), v))] for i, v in zip(*top)]
    return res


def round_result(lists: list[list], tree_size: int) -> StepResult:
    """A speculative round's outputs: each request's accepted drafts and bonus token."""
    accept, tokens, logprobs, *top = lists
    accept = [int(a) for a in accept]
    res = StepResult(
        tokens=[[int(x) for x in t[: a + 1]] for t, a in zip(tokens, accept)],
        logprobs=[lp[: a + 1] for lp, a in zip(logprobs, accept)],
        spec=[(tree_size - 1, list(range(a))) for a in accept],
    )
    if top:  # [B, S+1, K] ids and logprobs, each request's row flattened by the copy
        res.top_logprobs = []
        for t, ti, tv, a in zip(tokens, *top, accept):
            k = len(ti) // len(t)
            res.top_logprobs.append([list(zip(map(int, ti[j * k:(j + 1) * k]), tv[j * k:(j + 1) * k]))
                                     for j in range(a + 1)])
    return res
