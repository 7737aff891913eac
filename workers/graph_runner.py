"""CUDA graphs: one runner for every captured mode.

A captured callable reads only the static input buffers (``StaticInputs``: an int64 and a float32 table in one
device buffer, filled with one host→device copy per step) and the worker's device state (each request's last token
and last advance, the page table, the KV cache), and returns device tensors that stay valid until its next replay. The
worker captures, per batch-size bucket and sampling kind (greedy at start, "sample" / "filter" on first use: see
``workers.sampling``), and with or without top logprobs: the plain DECODE step (forward + sampling), and for
speculative decoding either the whole round in ONE graph (draft loop + TARGET_VERIFY + acceptance + KV compaction +
DRAFT_EXTEND) or the three phases as separate graphs replayed back to back. All graphs share one memory pool.
Batches are padded to the bucket with rows that write their K/V into the reserved page 0.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable

import torch

from workers.kernels.launch import pdl_launches
from workers.sampling import SamplingTensors

INT_FIELDS = ("req_slots", "seq_lens", "top_k", "seeds", "counters", "pending")  # then the n-gram draft columns
FLOAT_FIELDS = ("temperature", "top_p", "min_p")


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off inside (restored after, as it was). For CUDA graph captures: a
    collection that lands in one can destroy unreachable CUDA graphs (a dropped engine's: its graphs and the
    worker's closures form cycles), which is not permitted while a stream captures, and the capture fails."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **kwargs):
    """``torch.cuda.graph(graph, **kwargs)`` with the garbage collector paused (``gc_paused``)."""
    with gc_paused(), torch.cuda.graph(graph, **kwargs):
        yield


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256 (what a padded batch is rounded up to)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
    return [b for b in sizes if b < max_bs] + [max_bs]


class StaticInputs:
    """The step inputs graphs read, at the largest bucket's size; padded rows are greedy no-ops on ``pad_slot``.
    Field-major ([fields, max_bs]): every column a graph reads is a contiguous view (no copy kernel in the graph).
    The int64 and float32 tables are views of one byte buffer, so each step's values arrive in one whole-buffer
    host→device copy."""

    def __init__(self, max_bs: int, num_draft_cols: int, pad_slot: int, device):
        self.pad_slot = pad_slot
        self.max_bs = max_bs
        self.num_int_fields = len(INT_FIELDS) + num_draft_cols
        self.buffer = torch.zeros((self.num_int_fields * 8 + len(FLOAT_FIELDS) * 4) * max_bs, dtype=torch.uint8,
                                  device=device)
        self.ints, self.floats = self._tables(self.buffer)
        self.reset()

    def _tables(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``buffer``'s int64 [int fields, max_bs] and float32 [float fields, max_bs] views."""
        split = self.num_int_fields * 8 * self.max_bs
        return (buffer[:split].view(torch.int64).view(self.num_int_fields, self.max_bs),
                buffer[split:].view(torch.float32).view(len(FLOAT_FIELDS), self.max_bs))

    def reset(self) -> None:
        """Every row a padding row (graphs are captured on these)."""
        self._fill_rows(self.ints, self.floats, 0, self.max_bs)

    def _fill_rows(self, ints, floats, lo, hi) -> None:
        ints[:, lo:hi] = 0
        ints[INT_FIELDS.index("req_slots"), lo:hi] = self.pad_slot
        ints[INT_FIELDS.index("seq_lens"), lo:hi] = 1
        floats[FLOAT_FIELDS.index("top_p"), lo:hi] = 1.0  # greedy (temperature 0), top_p and min_p off
        floats[FLOAT_FIELDS.index("temperature"), lo:hi] = 0.0
        floats[FLOAT_FIELDS.index("min_p"), lo:hi] = 0.0

    def fill(self, step, bucket: int) -> None:
        """Write the step's rows (and padding up to ``bucket``) into the buffers: one host→device copy of the
        whole buffer (a few KB; the columns past ``bucket`` are not read), from pinned memory the copy holds until
        it is done (PyTorch's caching host allocator)."""
        b = len(step.req_slots)
        cols = [step.req_slots, step.seq_lens, step.top_k, step.seeds, step.counters, step.pending or [0] * b]
        pinned = self.buffer.device.type == "cuda"
        host = torch.empty(self.buffer.shape, dtype=torch.uint8, pin_memory=pinned)
        ints, floats = self._tables(host)
        ints[: len(INT_FIELDS), :b] = torch.tensor(cols, dtype=torch.int64)
        if step.draft_tokens is not None:
            ints[len(INT_FIELDS):, :b] = torch.tensor(step.draft_tokens, dtype=torch.int64).T
        floats[:, :b] = torch.tensor([step.temperature, step.top_p, step.min_p], dtype=torch.float32)
        self._fill_rows(ints, floats, b, bucket)
        self.buffer.copy_(host, non_blocking=pinned)

    def column(self, name: str, bucket: int) -> torch.Tensor:
        if name in INT_FIELDS:
            return self.ints[INT_FIELDS.index(name), :bucket]
        return self.floats[FLOAT_FIELDS.index(name), :bucket]

    def sampling(self, bucket: int, kind: str, counters: torch.Tensor) -> SamplingTensors:
        """The bucket's sampling columns, with the step's ``counters`` (moved ahead of the step in flight)."""
        c = lambda n: self.column(n, bucket)  # noqa: E731
        return SamplingTensors(c("temperature"), c("top_k"), c("top_p"), c("min_p"), c("seeds"), counters, kind=kind)

    def drafts(self, bucket: int) -> torch.Tensor:
        """[bucket, num_steps] host-proposed drafts (a transposed view)."""
        return self.ints[len(INT_FIELDS):, :bucket].T


class GraphRunner:
    """Captured graphs keyed by (name, bucket, sampling kind, top logprobs); one shared memory pool. On a CPU the
    callables are kept and run as they are (the same static-buffer, padded path without graphs; the tests exercise
    it that way)."""

    def __init__(self, device: torch.device):
        self.use_graphs = device.type == "cuda"
        self.pool = None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, object]] = {}
        self.num_replays = 0

    def capture(self, key: tuple, fn: Callable[[], object]) -> None:
        if not self.use_graphs:
            self.graphs[key] = (None, fn)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # warm up (Triton compiles, cuBLAS picks kernels) outside the capture; graphs launch with PDL (fused_ops)
        with pdl_launches(), torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread keeps polling its events while a TP rank captures
        with pdl_launches(), capturing(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        graph.replay()  # a capture computes nothing: fill the outputs, which the next phase's capture reads
        self.pool = graph.pool()
        self.graphs[key] = (graph, out)

    def replay_ms(self, keys: list[tuple], passes: int) -> float:
        """Milliseconds per pass of replaying ``keys``' graphs in order, ``passes`` times back to back (CUDA
        events; on a CPU the callables, by the wall clock)."""
        if not self.use_graphs:
            t0 = time.perf_counter()
            for _ in range(passes):
                for key in keys:
                    self.graphs[key][1]()
            return 1e3 * (time.perf_counter() - t0) / passes
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(passes):
            for key in keys:
                self.graphs[key][0].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / passes

    def keep(self, keys: list[tuple], as_keys: list[tuple], drop: list[tuple]) -> None:
        """Keep the graphs of ``keys`` under ``as_keys`` and destroy those of ``drop`` (their pool memory goes
        back to the pool for later captures)."""
        kept = [self.graphs.pop(key) for key in keys]
        for key in drop:
            del self.graphs[key]
        self.graphs.update(zip(as_keys, kept))

    def replay(self, key: tuple):
        graph, out = self.graphs[key]
        self.num_replays += 1
        if graph is None:
            return out()
        graph.replay()
        return out
