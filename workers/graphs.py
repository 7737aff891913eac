"""CUDA graphs of DECODE steps: the runner, what is captured when, and how (the norm-fusion choice).

A captured callable reads only the static input buffers (``StaticInputs``: an int64 and a float32 table in one
device buffer, filled with one host→device copy per step) and the worker's device state (each request's last token
and last advance, the page table, the KV cache), and returns device tensors that stay valid until its next replay.
``DecodeGraphs`` captures, per batch-size bucket and sampling kind (greedy, and by default "sample" / "filter", at
start-up: see ``workers.sampling``), and with or without top logprobs (on first use): the plain DECODE step (forward
+ sampling), and for speculative decoding either the whole round in ONE graph (``speculative.round.SpecRound``:
draft loop + TARGET_VERIFY + acceptance + KV compaction + DRAFT_EXTEND) or its three phases as separate graphs
replayed back to back. All graphs share one memory pool. Batches are padded to the bucket with rows that write
their K/V into the reserved page 0. Where a bucket's forwards can run the RMSNorms inside the linears, its graphs are
captured both ways, timed, and the faster kept (``DecodeGraphs._capture_faster_fusion``). A sparse-MLA model whose
decode backend has a kernel for rows that each select their whole top-k (``SelectionVariant``) gets each decode
graph that runs it twice, and a step replays the long-rows twins when its contexts guarantee such rows.
``graph_refusal`` says when graphs are off; ``tune_for_graphs`` sets up the small-M kernels they run.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from functools import partial
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from attention.base import AttentionLayerSpec, int_specialisation
from speculative.proposers import RoundInputs
from workers.forward_batch import PinnedRing
from workers.kernels.launch import capturing, pdl_launches
from workers.kernels.metadata import overlap_step_inputs
from workers.kernels.small_m_linear import MAX_ROWS, row_bucket
from workers.messages import FLOAT_FIELDS, ForwardMode
from workers.messages import INT_FIELDS as STEP_INT_FIELDS
from workers.outputs import PackedOutputs
from workers.sampling import SamplingTensors

logger = logging.getLogger(__name__)

# choosing a bucket's graphs with or without the norms inside the linears (DecodeGraphs._capture_faster_fusion):
# rounds of alternating timings, graph replays per timing, and how much faster the graphs with norm kernels must be
# to be kept
NORM_FUSION_PASSES = 5
NORM_FUSION_REPLAYS = 10
NORM_FUSION_MARGIN = 0.01

# the int rows a graph reads (a WorkerStep's first six, in its order), then the n-gram draft columns; the floats
INT_FIELDS = STEP_INT_FIELDS[:6]
assert INT_FIELDS == ("req_slots", "seq_lens", "top_k", "seeds", "counters", "pending")


# appended to a sampling kind: the variant whose rows may use penalties / logit_bias / min_tokens
LOGITS_VARIANT = "+logits"
# appended last: the structured-output variant, split where the logits wait for the host's masks, which it reads
# from a static mask buffer (``DecodeGraphs.mask_buffer``)
MASK_VARIANT = "+mask"
# the phase of a MASK_VARIANT that ends at the logits: the phases after it wait for the masks
MASK_WAITS_AFTER = ("decode_forward", "verify_forward")
# a speculative worker's plain step with the draft paused (adaptive speculation): its graphs' depth key
PAUSED_DEPTH = "paused"


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256 (what a padded batch is rounded up to)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
    return [b for b in sizes if b < max_bs] + [max_bs]


class StaticInputs:
    """The step inputs graphs read, at the largest bucket's size; padded rows are greedy no-ops on ``pad_slot``.
    Field-major ([fields, max_bs]): every column a graph reads is a contiguous view (no copy kernel in the graph).
    The int64 and float32 tables (and a prefill's token ids, ``max_tokens``) are views of one byte buffer, so each
    step's values arrive in one whole-buffer host→device copy. ``int_fields``: the leading fields of a
    ``WorkerStep``'s ints that the graphs read."""

    def __init__(self, max_bs: int, num_draft_cols: int, pad_slot: int, device, int_fields: tuple = INT_FIELDS,
                 max_tokens: int = 0):
        assert STEP_INT_FIELDS[:len(int_fields)] == int_fields
        self.pad_slot = pad_slot
        self.max_bs = max_bs
        self.int_fields = int_fields
        self.num_int_fields = len(int_fields) + num_draft_cols
        self.max_tokens = max_tokens
        self.buffer = torch.zeros((self.num_int_fields * 8 + len(FLOAT_FIELDS) * 4) * max_bs + 8 * max_tokens,
                                  dtype=torch.uint8, device=device)
        self.ints, self.floats, self.tokens = self._tables(self.buffer)
        # the host image of an all-padding buffer, which each step's fill starts from
        self._padding = np.zeros(self.buffer.shape, dtype=np.uint8)
        ints, floats, _ = self._tables(self._padding)
        ints[int_fields.index("req_slots")] = self.pad_slot
        ints[int_fields.index("seq_lens")] = 1
        floats[FLOAT_FIELDS.index("top_p")] = 1.0  # greedy (temperature 0), top_p and min_p off
        # the host images ``fill`` copies from (pinned on a GPU), used in turn: made on the first fill; an image is
        # written again two fills later, when its copy has long finished
        self._images: PinnedRing | None = None
        self.reset()

    def _tables(self, buffer):
        """``buffer``'s (a tensor's or a numpy array's) int64 [int fields, max_bs], int64 [max_tokens] and float32
        [float fields, max_bs] views."""
        split = self.num_int_fields * 8 * self.max_bs
        tokens_end = split + 8 * self.max_tokens
        i64, f32 = (torch.int64, torch.float32) if isinstance(buffer, torch.Tensor) else (np.int64, np.float32)
        return (buffer[:split].view(i64).reshape(self.num_int_fields, self.max_bs),
                buffer[tokens_end:].view(f32).reshape(len(FLOAT_FIELDS), self.max_bs),
                buffer[split:tokens_end].view(i64))

    def reset(self) -> None:
        """Every row a padding row (graphs are captured on these)."""
        self.buffer.copy_(torch.from_numpy(self._padding))

    def fill(self, step, bucket: int) -> None:
        """Write the step's rows (padding after them) into the buffers: numpy copies of the step's packed rows into
        one host image, then one host→device copy of the whole buffer (a few KB; the columns past ``bucket`` are
        not read), from pinned memory on a GPU (asynchronous: the image is not written again until it is done)."""
        b, n = step.batch_size, len(self.int_fields)
        pinned = self.buffer.device.type == "cuda"
        if self._images is None:
            self._images = PinnedRing(self.buffer.shape, torch.uint8, self.buffer.device, buffers=2)
        host, image, i = self._images.take()
        image[:] = self._padding
        ints, floats, tokens = self._tables(image)
        ints[:n, :b] = step.ints[:n]
        if step.draft_tokens is not None:
            ints[n:, :b] = step.draft_tokens.T
        floats[:, :b] = step.floats
        if self.max_tokens:  # a prefill: its tokens, then one padding request holding the rest of the bucket's
            t = len(step.input_ids)
            tokens[:t] = step.input_ids
            if bucket > t:  # (none left: it stays an empty padding row)
                ints[self.int_fields.index("seq_lens"), b] = ints[self.int_fields.index("extend_lens"), b] = bucket - t
        self.buffer.copy_(host, non_blocking=pinned)
        self._images.copied(i)

    def column(self, name: str, bucket: int) -> torch.Tensor:
        if name in self.int_fields:
            return self.ints[self.int_fields.index(name), :bucket]
        return self.floats[FLOAT_FIELDS.index(name), :bucket]

    def sampling(self, bucket: int, kind: str, counters: torch.Tensor, logits_state=None) -> SamplingTensors:
        """The bucket's sampling columns, with the step's ``counters`` (moved ahead of the step in flight); a kind
        with LOGITS_VARIANT reads ``logits_state`` at the rows' slots."""
        c = lambda n: self.column(n, bucket)  # noqa: E731
        kind = kind.removesuffix(MASK_VARIANT)
        base = kind.removesuffix(LOGITS_VARIANT)
        processing = logits_state if base != kind else None
        return SamplingTensors(c("temperature"), c("top_k"), c("top_p"), c("min_p"), c("seeds"), counters, kind=base,
                               logits_state=processing, req_slots=c("req_slots") if processing else None)

    def drafts(self, bucket: int) -> torch.Tensor:
        """[bucket, num_steps] host-proposed drafts (a transposed view)."""
        return self.ints[len(INT_FIELDS):, :bucket].T

    def round_inputs(self, bucket: int, kind: str, advance: torch.Tensor, last_token: torch.Tensor,
                     drafts: bool, logits_state=None) -> RoundInputs:
        """The bucket's step inputs, moved ahead of the step in flight (overlap: one kernel on the GPU) by what it
        appends (``advance``) and emits (``last_token``), both per request slot."""
        slots = self.column("req_slots", bucket)
        seq, root, root_pos, counters = overlap_step_inputs(
            slots, self.column("pending", bucket), self.column("seq_lens", bucket), self.column("counters", bucket),
            advance, last_token)
        return RoundInputs(root=root, req_slots=slots, seq_lens=seq, root_pos=root_pos,
                           sampling=self.sampling(bucket, kind, counters, logits_state),
                           drafts=self.drafts(bucket) if drafts else None)


class GraphRunner:
    """Captured graphs keyed by (name, bucket, sampling kind, top logprobs); one shared memory pool. On a CPU the
    callables are kept and run as they are (the same static-buffer, padded path without graphs; the tests exercise
    it that way)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.use_graphs = device.type == "cuda"
        # set once the worker has started: a capture from then on runs inside a step every stream waits for, so it
        # is logged and counted (``late_captures``: how many, their seconds)
        self.serving = False
        self.late_captures, self.late_capture_s = 0, 0.0
        self.clear()

    def clear(self) -> None:
        """Drop every graph (and the memory pool)."""
        self.pool = None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, object]] = {}
        self.num_replays = 0

    def capture(self, key: tuple, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        self._capture_graph(key, fn)
        if self.serving:
            took = time.perf_counter() - t0
            self.late_captures += 1
            self.late_capture_s += took
            logger.warning("captured the CUDA graph %s after start-up in %.0f ms, inside a step", key, took * 1e3)

    def _capture_graph(self, key: tuple, fn: Callable[[], object]) -> None:
        if not self.use_graphs:
            self.graphs[key] = (None, fn)
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # warm up (Triton compiles, cuBLAS picks kernels) outside the capture; graphs launch with PDL (kernels.launch)
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


def graph_refusal(runners: list, cfg, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why decode steps and speculative rounds will run eagerly (None: they are captured in CUDA graphs)."""
    for runner in runners:  # first, so that CPU runs exercise it too
        spec = runner.attention_specs[0]
        refusal = runner.attn_backend.graph_refusal(cfg.page_size, dtype, spec.head_dim)
        if refusal is not None:
            return f"{refusal} (use triton, or flashinfer with XQA on sm90+ and verify_attention_mode=decode)"
    if device.type != "cuda":
        return "not on a CUDA device"
    if cfg.disable_cuda_graph:
        return "disable_cuda_graph is set"
    return None


def tune_for_graphs(models: list[torch.nn.Module], cache_dir: str | None, device: torch.device):
    """Time the small-M linear kernel against cuBLAS for every layer of ``models`` and row bucket, once, before the
    KV cache takes the memory. Only for graph runs: eagerly, Triton's Python launch cost outweighs what it saves.
    Choices are kept in the tuning cache under ``cache_dir`` (``EngineConfig.tuning_cache_dir``): later starts read
    them, run the same kernels, and so give the same tokens. Returns the cache (TuningCache), or None."""
    from workers.kernels import (
        tuning,  # (looked up now: tests replace its tuning_environment)
    )

    cache = (tuning.TuningCache(os.path.join(cache_dir, "small_m_linear.json"), tuning.tuning_environment(device))
             if cache_dir else None)
    t0 = time.perf_counter()
    timed = sum(tuning.tune_small_m_linears(m, cache) for m in models)
    torch.cuda.empty_cache()  # the timing buffers must not count as used when the KV cache is sized
    if cache is not None:
        cache.save()
    logger.info("small-M linear kernels: %d (shape, rows) pairs timed in %.1fs%s", timed,
                time.perf_counter() - t0, f" (the others from {cache.path})" if cache is not None else "")
    return cache


# the graph key's suffix of SelectionVariant's long-rows graphs
LONG_ROWS = "long rows"
# positions a row of a forward that may run the long-rows kernel (a decode-mode one: DECODE, a draft step, a
# decode-style TARGET_VERIFY) may sit before the newest token the host counts: none sits before it (a safety margin;
# a lagging draft's catch-up rows are DRAFT_EXTEND, a prefill-style forward, which the hybrid's Triton child runs)
ROW_MARGIN = 16


class SelectionVariant:
    """Sparse-MLA backends (``supports_full_selection``) that run a faster kernel where every row of a forward
    selects exactly ``topk`` slots, a mode (``full_selection``) set around such forwards, each counting the forwards
    that ran it (``long_rows_forwards``): ``DecodeGraphs`` captures each graph that runs it in both modes and
    replays the long-rows one when ``long_rows`` holds for the step."""

    def __init__(self, backends: list, topk: int):
        self.backends, self.topk, self.margin = backends, topk, ROW_MARGIN

    @classmethod
    def of(cls, runners: list) -> SelectionVariant | None:
        """The runners' backends with the mode (a hybrid's children included); None where there are none."""
        backends, topk = [], 0
        for runner in runners:
            backend = runner.attn_backend
            for b in (backend, getattr(backend, "prefill", None), getattr(backend, "decode", None)):
                if getattr(b, "supports_full_selection", False) and b not in backends:
                    backends.append(b)
                    topk = max(topk, max(spec.topk for spec in runner.attention_specs))
        return cls(backends, topk) if backends else None

    def long_rows(self, seq_lens) -> bool:
        """Whether every sparse row of a decode step over requests of ``seq_lens`` (the host's lengths, never above
        the device's) selects its whole top-k."""
        return len(seq_lens) > 0 and int(np.min(seq_lens)) - self.margin >= self.topk  # (numpy: no Python loop)

    def runs_kernel(self, fns: list[Callable[[], object]]) -> bool:
        """Whether ``fns`` (long-rows callables, ``wrap``'s), run once now in order, run the long-rows kernel
        anywhere: graphs without it (one row, dense drafts) are captured once."""
        before = sum(b.long_rows_forwards for b in self.backends)
        for fn in fns:
            fn()
        return sum(b.long_rows_forwards for b in self.backends) > before

    def wrap(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` run with the backends in the long-rows mode."""
        def run():
            for b in self.backends:
                b.full_selection = True
            try:
                return fn()
            finally:
                for b in self.backends:
                    b.full_selection = False
        return run


class DecodeGraphs(GraphRunner):
    """The DECODE step's graphs, per batch bucket, sampling kind and top logprobs: a plain step (``decode``: forward
    and sampling) or a speculative round (``spec_round``: in one graph, or its three phases), each returning its
    outputs packed for the host. Per bucket, whether its graphs run the norms inside the linears (``norm_fusion``).

    ``models``: the target's and the draft's modules; ``last_token`` / ``advance``: the worker's per-slot state that
    moves a step's inputs ahead of the step in flight (``StaticInputs.round_inputs``)."""

    def __init__(self, cfg, device: torch.device, dtype: torch.dtype, tp, models: list[torch.nn.Module],
                 decode: Callable, spec_round, last_token: torch.Tensor, advance: torch.Tensor, rank: int = 0,
                 logits_state=None, decode_phases: tuple[Callable, Callable] | None = None):
        super().__init__(device)
        self.cfg, self.dtype, self.tp, self.rank = cfg, dtype, tp, rank
        self.models = models
        self.decode = decode
        self.decode_phases = decode_phases  # (forward to the logits, sampling under a mask): the MASK_VARIANT's
        self.mask_buffer: torch.Tensor | None = None  # [max_bs, nodes, words] int32, allocated on the first use
        self.spec_round = spec_round
        self.last_token, self.advance = last_token, advance
        self.logits_state = logits_state  # (``workers.logits_processing.LogitsState``: the LOGITS_VARIANT graphs read it)
        self.static: StaticInputs | None = None
        self.buckets: list[int] = []  # empty until ``capture_all``: every step then runs eagerly
        self.phases: dict[tuple[int, str, bool], list[str]] = {}  # (bucket, kind, top) → graph names, replay order
        self.norm_fusion: dict[int, bool] = {}  # bucket → its graphs run the norms inside the linears
        self.plain_norm_fusion: dict[int, bool] = {}  # the same for a speculative worker's plain step (depth 0)
        self.tuning_cache = None  # where fusion choices are read and kept (TuningCache)
        # adaptive speculation: the draft depths besides num_steps whose graphs (of every start-up kind) are
        # captured at start-up (others on first use); a phase key ends with its depth, none for num_steps
        self.depth_tiers: list[int] = []
        # a speculative worker's depth 0: the plain decode step (``decode``) that also stashes the draft's inputs
        # (``Worker._plain_step``); its graphs are keyed as the "decode" phase at depth 0
        self.plain_step: Callable | None = None
        # its plain step with the draft paused: ``decode`` alone, no stash (keyed as the "decode" phase at depth
        # PAUSED_DEPTH); whether its graphs are captured at start-up (else on first use)
        self.paused_graphs = False
        # the draft's catch-up (a plain step on a full stash, a round after plain steps) replayed from a graph per
        # bucket and span (``_capture_catch_up``), its per-row lags read from ``catch_up_lags``; False: it runs eagerly
        self.catch_up_graphs = False
        self.catch_up_lags: torch.Tensor | None = None
        self._lag_images: PinnedRing | None = None  # the host images ``_fill_catch_up_lags`` copies from
        # sparse MLA: each graph also captured in the backends' long-rows mode (``SelectionVariant``), and whether
        # the step being replayed takes those graphs
        self.selection: SelectionVariant | None = None
        self.long_rows = False
        self.long_replays = 0  # graphs replayed in the long-rows mode (checks, stats)

    def capture(self, key: tuple, fn: Callable[[], object]) -> None:
        self.capture_sequence([key], [fn])

    def capture_sequence(self, keys: list[tuple], fns: list[Callable[[], object]]) -> None:
        """Graphs that hand tensors to each other in order (a round's phases read the outputs the phase before left
        at its capture) captured in order; then, where a backend has the long-rows mode and any of them runs its
        kernel, their twins in order, so that each twin reads the twin before it and each graph the graph before."""
        for key, fn in zip(keys, fns):
            super().capture(key, fn)
        if self.selection is not None:
            longs = [self.selection.wrap(fn) for fn in fns]
            if self.selection.runs_kernel(longs):
                for key, fn in zip(keys, longs):
                    super().capture(key + (LONG_ROWS,), fn)

    def replay(self, key: tuple):
        if self.long_rows and key + (LONG_ROWS,) in self.graphs:
            self.long_replays += 1
            key += (LONG_ROWS,)
        return super().replay(key)

    def keep(self, keys: list[tuple], as_keys: list[tuple], drop: list[tuple]) -> None:
        super().keep(keys, as_keys, drop)
        if self.selection is not None:  # (their twins, where captured)
            twins = [(k + (LONG_ROWS,), a + (LONG_ROWS,)) for k, a in zip(keys, as_keys)
                     if k + (LONG_ROWS,) in self.graphs]
            super().keep([k for k, _ in twins], [a for _, a in twins],
                         [k + (LONG_ROWS,) for k in drop if k + (LONG_ROWS,) in self.graphs])

    def _choose_rows(self, step) -> None:
        self.long_rows = self.selection is not None and self.selection.long_rows(step.seq_lens)

    @torch.inference_mode()
    def capture_all(self, tuning_cache=None) -> None:
        """Capture every bucket's graphs now (largest first, so smaller graphs reuse its pool memory): greedy, and
        the sampling kinds of ``cuda_graph_sampling_kinds`` ("sample": temperatures only; "filter": with the
        top-k/top-p sort, which needs much more memory); the other kinds and the variants with top logprobs, logits
        processing or masks on their first use."""
        from tqdm import tqdm

        self.clear()
        serving, self.serving = self.serving, False  # (what this captures is start-up's, whenever it runs)
        self.tuning_cache = tuning_cache
        buckets = batch_buckets(min(self.cfg.cuda_graph_max_bs, self.cfg.max_num_seqs))
        draft_cols = self.spec_round.proposer.num_steps if self.spec_round is not None else 0
        self.static = StaticInputs(buckets[-1], draft_cols, self.cfg.max_num_seqs, self.device)
        self.phases.clear()
        self.norm_fusion.clear()
        self.plain_norm_fusion.clear()
        self.buckets = buckets
        self.catch_up_graphs = self._captures_catch_up()
        for bucket in tqdm(list(reversed(buckets)), desc="capturing CUDA graphs", disable=self.rank != 0):
            for kind in ("greedy", *self.cfg.cuda_graph_sampling_kinds):
                self._capture(bucket, kind, top=False)  # (greedy's full round first: it makes the norm-fusion choice)
                for depth in self._other_depths(self.depth_tiers) + ([PAUSED_DEPTH] if self.paused_graphs else []):
                    self._capture(bucket, kind, False, depth)
            if self.catch_up_graphs:
                self._capture_catch_up(bucket)
        self.serving = serving
        if self.tuning_cache is not None:
            self.tuning_cache.save()

    def bucket_for(self, batch_size: int) -> int | None:
        """The bucket a batch is padded to (None: no graphs, or a larger batch)."""
        return next((x for x in self.buckets if x >= batch_size), None)

    def replay_step(self, step, bucket: int, kind: str, top: bool, depth: int | None = None,
                    catch_up_lags: np.ndarray | None = None) -> PackedOutputs:
        """Run ``step`` through its bucket's graphs (captured now on first use); returns its rows' packed outputs,
        valid until the next replay. ``depth``: a speculative round's draft depth (None: num_steps; PAUSED_DEPTH: a
        plain step with the draft paused).
        ``catch_up_lags``: each row's plain steps that the draft catches up on first (``capture_catch_up``)."""
        at = (bucket, kind, top) + _depth_key(depth)
        if at not in self.phases:
            self._capture(bucket, kind, top, depth)
        self.static.fill(step, bucket)
        self._choose_rows(step)
        if catch_up_lags is not None:
            self._fill_catch_up_lags(catch_up_lags, bucket)
            self.replay(self._catch_up_key(bucket, int(catch_up_lags.max()), plain=depth == 0))
        for name in self.phases[at]:  # the last phase returns the packed outputs
            out = self.replay((name,) + at)
        return out.rows(step.batch_size)

    # ---- structured output: the MASK_VARIANT, replayed in two parts around the host's masks ------------------------
    def replay_until_mask(self, step, bucket: int, kind: str, top: bool) -> PackedOutputs | None:
        """A MASK_VARIANT ``kind``'s phases up to the logits (a round: its drafts' phase, then the verify forward).
        Returns a round's drafts packed (tokens, parents), valid until the next replay; None for a plain step."""
        if (bucket, kind, top) not in self.phases:
            self._capture_every_bucket(kind, top)
        self.static.fill(step, bucket)
        self._choose_rows(step)  # (``replay_after_mask`` goes on with the same step's graphs)
        names = self.phases[(bucket, kind, top)]
        drafts = None
        for name in names[:self._mask_split(names)]:
            out = self.replay((name, bucket, kind, top))
            if name == "draft":
                drafts = out.rows(step.batch_size)
        return drafts

    def replay_after_mask(self, mask: np.ndarray, batch_size: int, bucket: int, kind: str,
                          top: bool) -> PackedOutputs:
        """The rest of ``replay_until_mask``'s step once its masks ([B, nodes, words]) are here: one host→device
        copy into the static mask buffer, then the phases that read it. Returns the step's packed outputs."""
        self._fill_mask(mask, bucket)
        names = self.phases[(bucket, kind, top)]
        for name in names[self._mask_split(names):]:
            out = self.replay((name, bucket, kind, top))
        return out.rows(batch_size)

    def _capture_every_bucket(self, kind: str, top: bool) -> None:
        """A ``kind``'s graphs for every bucket at once (largest first: the smaller reuse its pool memory). A guided
        batch shrinks through the buckets as its requests end; captured one bucket at a time, each new size would
        stall the whole batch (its requests' masks and steps waiting on a capture) in the middle of its decode."""
        for b in reversed(self.buckets):
            if (b, kind, top) not in self.phases:
                self._capture(b, kind, top)

    @staticmethod
    def _mask_split(names: list[str]) -> int:
        return next(i for i, n in enumerate(names) if n in MASK_WAITS_AFTER) + 1

    def _mask_rows(self) -> int:
        return 1 if self.spec_round is None else self.spec_round.proposer.tree_size

    def _ensure_mask_buffer(self) -> torch.Tensor:
        if self.mask_buffer is None:
            words = (self.models[0].cfg.vocab_size + 31) // 32
            self.mask_buffer = torch.full((self.static.max_bs, self._mask_rows(), words), -1, dtype=torch.int32,
                                          device=self.device)
        return self.mask_buffer

    def _fill_mask(self, mask: np.ndarray, bucket: int) -> None:
        """The step's masks, then all-allowed padding rows, in one host→device copy of the bucket's rows (from
        pinned memory the copy holds until it is done, as ``StaticInputs.fill``)."""
        buf = self.mask_buffer[:bucket]
        pinned = buf.device.type == "cuda"
        host = torch.empty(buf.shape, dtype=torch.int32, pin_memory=pinned)
        image = host.numpy()
        image[:len(mask)] = mask.reshape(len(mask), *buf.shape[1:])
        image[len(mask):] = -1
        buf.copy_(host, non_blocking=pinned)

    def _other_depths(self, tiers: list[int]) -> list[int]:
        """``tiers`` but num_steps (whose graphs are the plain round's)."""
        return [d for d in tiers if d != self.spec_round.proposer.full_steps] if self.spec_round else []

    def _callables(self, bucket: int, kind: str, top: bool, depth: int | None = None) -> dict[str, Callable]:
        """What one bucket captures: name → callable over the static inputs, in replay order; the last returns the
        step's outputs packed for the host (``top``: with each token's top logprobs; ``depth``: a round drafting
        that many tokens, None: num_steps)."""
        if depth == PAUSED_DEPTH:  # (the step without speculation)
            return {"decode": lambda: PackedOutputs.pack(*self.decode(self.static.round_inputs(
                bucket, kind, self.advance, self.last_token, drafts=False, logits_state=self.logits_state), top))}
        if self._is_plain(kind, depth):
            def plain():
                inp = self.static.round_inputs(bucket, kind, self.advance, self.last_token, drafts=False,
                                               logits_state=self.logits_state)
                return PackedOutputs.pack(*self.plain_step(inp, top))
            return {"decode": plain}
        phases = self._phase_callables(bucket, kind, top)
        if depth is None:
            return phases
        proposer = self.spec_round.proposer

        def at_depth(fn):
            def run():
                with proposer.at_depth(depth):
                    return fn()
            return run

        return {name: at_depth(fn) for name, fn in phases.items()}

    def _phase_callables(self, bucket: int, kind: str, top: bool) -> dict[str, Callable]:
        spec = self.spec_round

        def inputs() -> RoundInputs:
            return self.static.round_inputs(bucket, kind, self.advance, self.last_token, drafts=spec is not None,
                                            logits_state=self.logits_state)

        if kind.endswith(MASK_VARIANT):
            return self._mask_callables(bucket, inputs, top)
        if spec is None:
            return {"decode": lambda: PackedOutputs.pack(*self.decode(inputs(), top))}
        if self.cfg.fuse_speculative_round:
            return {"round": lambda: PackedOutputs.pack(*spec.run(inputs(), top))}
        state: dict = {}  # tensors the phases hand to each other (outputs of the previous phase's graph)

        def draft():
            state["inp"] = inp = inputs()
            state["tree"] = spec.propose(inp)

        def verify():
            state["verified"] = spec.verify(state["inp"], state["tree"], top)

        return {"draft": draft, "verify": verify,
                "draft_extend": lambda: PackedOutputs.pack(*spec.catch_up(state["inp"], state["tree"],
                                                                          *state["verified"]))}

    def _mask_callables(self, bucket: int, inputs: Callable[[], RoundInputs], top: bool) -> dict[str, Callable]:
        """The MASK_VARIANT's phases: up to the logits (a round: its drafts, returned for the host, then the target's
        verify forward), then, once the host has copied the masks into the static buffer, sampling or the verdict
        under them (and a round's catch-up)."""
        spec, state = self.spec_round, {}
        mask = self._ensure_mask_buffer()[:bucket]
        if spec is None:
            forward, sample = self.decode_phases

            def decode_forward():
                state["inp"] = inp = inputs()
                state["logits"] = forward(inp)

            return {"decode_forward": decode_forward,
                    "decode_sample": lambda: PackedOutputs.pack(*sample(state["inp"], state["logits"], top, mask))}

        def draft():
            state["inp"] = inp = inputs()
            state["tree"] = tree = spec.propose(inp)
            return PackedOutputs.pack(tree.tokens, tree.parents if tree.parents is not None
                                      else torch.full_like(tree.tokens, -2))

        def verify_forward():
            state["forward"] = spec.verify_forward(state["inp"], state["tree"])

        def accept():
            state["verified"] = spec.verify_accept(state["inp"], state["tree"], state["forward"], top, mask)

        return {"draft": draft, "verify_forward": verify_forward, "accept": accept,
                "draft_extend": lambda: PackedOutputs.pack(*spec.catch_up(state["inp"], state["tree"],
                                                                          *state["verified"]))}

    # ---- the norm-fusion choice --------------------------------------------------------------------------------
    def _capture(self, bucket: int, kind: str, top: bool, depth: int | None = None) -> None:
        """Capture one bucket's graphs on padding rows (a capture runs its callables three times). Where its
        forwards can run the norms inside the linears (``_norm_fusion_open``), the bucket's first capture takes
        them both ways and keeps the faster (``_capture_faster_fusion``); its later captures follow that choice."""
        # a speculative worker's plain step (depth 0) runs the target alone, as no speculation does: its own choice
        choices = self.plain_norm_fusion if self._is_plain(kind, depth) else self.norm_fusion
        if bucket not in choices and self._norm_fusion_open(bucket):
            choices[bucket] = self._capture_faster_fusion(bucket, kind, top, depth)
        else:
            self._capture_phases(bucket, kind, top, choices.get(bucket, True), depth=depth)

    def _is_plain(self, kind: str, depth: int | None) -> bool:
        """Whether ``depth``'s graphs are a speculative worker's plain decode step (``plain_step``, or the step
        without speculation that it runs with the draft paused: the target alone either way)."""
        return (depth == 0 or depth == PAUSED_DEPTH) and self.plain_step is not None and not kind.endswith(MASK_VARIANT)

    def _capture_phases(self, bucket: int, kind: str, top: bool, fused: bool, variant: tuple = (),
                        depth: int | None = None) -> list[tuple]:
        """Capture the bucket's phases under their graph keys (plus ``variant``), their forwards running the norms
        inside the linears where they can if ``fused``; returns the keys in order."""
        self.static.reset()
        if self.mask_buffer is not None:  # (captured on all-allowed masks)
            self.mask_buffer.fill_(-1)
        phases = self._callables(bucket, kind, top, depth)
        at = (bucket, kind, top) + _depth_key(depth)
        keys = [(name,) + at + variant for name in phases]
        # (on a CPU the callables run at each replay)
        self.capture_sequence(keys, [self._norms_in_linears(fused)(fn) for fn in phases.values()])
        self.phases[at] = list(phases)
        return keys

    def _folded_models(self) -> list[torch.nn.Module]:
        return [m for m in self.models if getattr(m, "norms_folded", False)]

    def _norm_fusion_open(self, bucket: int) -> bool:
        """Whether this bucket's graphs could run the norms inside the linears: a model's norm weights are folded
        and its bucket-row forward runs small-M kernels in every layer (a verify has more rows than the bucket, never
        fewer, so larger buckets never fuse)."""
        return any(m.fuses_norms(bucket) for m in self._folded_models())

    @contextlib.contextmanager
    def _norms_in_linears(self, on: bool):
        """Forwards inside run their norms inside the linears where they can (``on``) or as norm kernels; also a
        decorator (``_capture_phases``)."""
        models = self._folded_models()
        for m in models:
            m.norms_in_linears = on
        try:
            yield
        finally:
            for m in models:
                m.norms_in_linears = True

    def norm_fusion_key(self, bucket: int) -> str:
        """The tuning cache's key of a bucket's fusion choice: what its graphs run (model shapes, speculation, TP)."""
        shapes = [(m.cfg.architecture, m.cfg.hidden_size, m.cfg.intermediate_size, m.cfg.num_layers,
                   m.cfg.num_heads, m.cfg.num_kv_heads, m.cfg.head_dim, m.cfg.vocab_size)
                  for m in self._folded_models()]
        spec = self.cfg.speculative_config
        spec_key = None if spec is None else (spec.method, spec.num_steps, spec.topk, spec.num_draft_tokens,
                                              self.cfg.fuse_speculative_round)
        return f"norms in linears | {shapes} | {spec_key} | {self.dtype} | tp {self.tp.size} | bucket {bucket}"

    def _capture_faster_fusion(self, bucket: int, kind: str, top: bool, depth: int | None = None) -> bool:
        """Capture the bucket's graphs with the norms inside the linears and with the norm kernels, time their
        replays (alternating, NORM_FUSION_PASSES rounds of NORM_FUSION_REPLAYS, the median), keep the faster and
        return whether it fuses. The fused graphs are kept unless the others are NORM_FUSION_MARGIN faster (which
        way wins depends on the model's shape); a choice in the tuning cache is taken without timing, so that later
        starts run the same kernels."""
        key = self.norm_fusion_key(bucket) + (" | plain step" if self._is_plain(kind, depth) else "")
        cached = self.tuning_cache.get_choice(key) if self.tuning_cache is not None else None
        if self.tp.size > 1:  # every rank takes the same path, and times (replays all-reduces) or none does
            has, value = self.tp.all_reduce_host([cached is not None, bool(cached)], op=dist.ReduceOp.MIN)
            cached = bool(value) if has else None
        if cached is not None:
            self._capture_phases(bucket, kind, top, cached, depth=depth)
            return cached
        keys = {fused: self._capture_phases(bucket, kind, top, fused, variant=(fused,), depth=depth)
                for fused in (True, False)}
        self.replay_ms(keys[True] + keys[False], 2)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(NORM_FUSION_PASSES):
            for fused in (True, False):
                times[fused].append(self.replay_ms(keys[fused], NORM_FUSION_REPLAYS))
        fused_ms, plain_ms = (sorted(times[f])[len(times[f]) // 2] for f in (True, False))
        fused_ms, plain_ms = (t / self.tp.size for t in self.tp.all_reduce_host([fused_ms, plain_ms]))  # the mean
        fused = plain_ms > fused_ms * (1 - NORM_FUSION_MARGIN)
        self.keep(keys[fused], [k[:-1] for k in keys[fused]], drop=keys[not fused])
        if self.tuning_cache is not None:
            self.tuning_cache.put_choice(key, fused)
        logger.info("bucket %d: norms %s the linears (graph replays %.3f ms fused, %.3f ms with norm kernels)",
                    bucket, "inside" if fused else "outside", fused_ms, plain_ms)
        return fused

    # ---- adaptive speculation's cost model -----------------------------------------------------------------------
    @torch.inference_mode()
    def depth_costs(self, tiers: list[int], page_table=None, context: int = 0, passes: int = 3,
                    replays: int = 3) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]]]:
        """Milliseconds of a greedy step per batch bucket and draft depth in ``tiers`` (``speculative.adaptive``):
        with graphs captured, their replays (alternating depths, ``passes`` rounds of ``replays``, the median),
        read from the tuning cache when it has them; otherwise eager calls of the same callables on padding rows,
        at power-of-two buckets up to max_num_seqs. Depth 0 is the plain decode step; each bucket also gets the
        draft's lazy catch-up over L plain steps per request at L = 1 and the stash's size, under key -L
        (``_catch_up_ms``). Padding rows have one token of context; with ``page_table`` and ``context`` > 1 the
        same steps are timed again with every row at ``context`` tokens (``_context_rows``), which gives the second
        table: per bucket and depth, ms per token of the batch's context (empty without)."""
        full = self.spec_round.proposer.full_steps
        depth_of = {d: None if d == full else d for d in tiers}
        context = context if page_table is not None and context > 1 else 0
        if not self.buckets:
            return self._eager_depth_costs(tiers, depth_of, page_table, context)
        lags = self._catch_up_lags()
        # (a table timed with the other catch-up is not reused)
        kv_only = " kv-only" if getattr(self.spec_round.proposer, "kv_only_catch_up", False) else ""
        key = self.norm_fusion_key(self.buckets[-1]).replace(
            "norms in linears", f"step ms at depths {tiers}, plain depth 0, catch-up{kv_only} at {lags}", 1
        ) + self._steps_timed()
        ctx_key = f"{key}, ms per context token at {context}"
        cached = cached_ctx = None
        if self.tuning_cache is not None:
            cached = self.tuning_cache.get_step_costs(key)
            cached_ctx = self.tuning_cache.get_step_costs(ctx_key) if context else {b: {} for b in self.buckets}
        if self.tp.size > 1:  # every rank times (replays all-reduces) or none does
            (has,) = self.tp.all_reduce_host([cached is not None and cached_ctx is not None], op=dist.ReduceOp.MIN)
            cached = cached if has else None
        if cached is not None and cached_ctx is not None and sorted(cached) == self.buckets == sorted(cached_ctx):
            return cached, cached_ctx
        costs: dict[int, dict[int, float]] = {}
        per_token: dict[int, dict[int, float]] = {}
        for bucket in self.buckets:
            keys = {}
            for d in tiers:
                at = (bucket, "greedy", False) + _depth_key(depth_of[d])
                if at not in self.phases:
                    self._capture(bucket, "greedy", False, depth_of[d])
                keys[d] = [(name,) + at for name in self.phases[at]]

            def timed() -> list[float]:  # each tier's median ms on the rows the static inputs hold now
                self.replay_ms([k for d in tiers for k in keys[d]], 1)  # warm-up
                times: dict[int, list[float]] = {d: [] for d in tiers}
                for _ in range(passes):
                    for d in tiers:
                        times[d].append(self.replay_ms(keys[d], replays))
                return [sorted(times[d])[len(times[d]) // 2] for d in tiers]

            self.static.reset()
            medians = timed()
            if context:
                with self._context_rows(page_table, bucket, context):
                    medians += timed()
            medians += [self._catch_up_ms(bucket, lag) for lag in lags]
            medians = [t / self.tp.size for t in self.tp.all_reduce_host(medians)]  # the ranks' mean
            n = len(tiers)
            costs[bucket] = dict(zip(tiers + [-lag for lag in lags], medians[:n] + medians[2 * n if context else n:]))
            per_token[bucket] = self._per_token(tiers, medians[:n], medians[n:2 * n], bucket, context)
        if self.tuning_cache is not None:
            self.tuning_cache.put_step_costs(key, costs)
            if context:
                self.tuning_cache.put_step_costs(ctx_key, per_token)
            self.tuning_cache.save()
        logger.info("step ms by draft depth %s: %s", tiers,
                    "; ".join(f"bs {b}: " + " ".join(f"{ms:.3f}" for ms in row.values()) for b, row in costs.items()))
        if context:
            logger.info("step ms per 1k tokens of context by draft depth %s: %s", tiers, "; ".join(
                f"bs {b}: " + " ".join(f"{1e3 * ms:.3f}" for ms in row.values()) for b, row in per_token.items()))
        return costs, per_token

    def _steps_timed(self) -> str:
        """What the cost tables' tuning-cache key adds to the norm-fusion key's: every model's shape (that key names
        only the models whose norms are folded, none in fp32 or of an architecture that folds none, where another
        model's table would be read) and the attention the steps run (the context's table is mostly attention)."""
        fields = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size")
        shapes = [tuple(getattr(getattr(m, "cfg", None), f, None) for f in fields) for m in self.models]
        decode = self.cfg.resolved_attention_backends(self.device.type)[1]
        return (f" | models {shapes} | attention {decode}, verify {self.cfg.verify_attention_mode}, pages of "
                f"{self.cfg.page_size}, indexer keys {self.cfg.indexer_key_dtype}")

    @staticmethod
    def _per_token(tiers: list[int], short: list[float], long: list[float], bucket: int,
                   context: int) -> dict[int, float]:
        """ms per token of context per tier, from the times at one token and at ``context`` tokens a row (none
        below 0: at a small bucket the difference can be within the timing's noise)."""
        if not context:
            return {}
        return {d: max(0.0, (b - a) / (bucket * (context - 1))) for d, a, b in zip(tiers, short, long)}

    @contextlib.contextmanager
    def _context_rows(self, page_table, bucket: int, context: int):
        """The static inputs' ``bucket`` rows as requests in slots 0 .. bucket - 1 at ``context`` tokens each, over
        distinct pages from page 1 (the pool is still empty at start-up: what a step writes there is overwritten
        before any request reads it, as on any page's reuse), so that a step reads ``bucket`` x ``context`` tokens
        of KV from memory; back to padding rows after."""
        # (``Worker.cost_context`` picks a context whose pages fit the pool and the table's width)
        width = -(-(context + self.spec_round.proposer.lookahead) // page_table.page_size)
        pages = torch.arange(1, 1 + bucket * width, dtype=torch.int32, device=self.device).view(bucket, width)
        page_table.table[:bucket, :width] = pages
        self.static.column("req_slots", bucket).copy_(torch.arange(bucket, device=self.device))
        self.static.column("seq_lens", bucket).fill_(context)
        try:
            yield
        finally:
            page_table.table[:bucket].zero_()
            self.static.reset()

    def _eager_depth_costs(self, tiers: list[int], depth_of: dict, page_table, context: int
                           ) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]]]:
        max_bs = min(self.cfg.cuda_graph_max_bs, self.cfg.max_num_seqs)
        buckets = sorted({min(1 << i, max_bs) for i in range(max_bs.bit_length() + 1)})
        if self.static is None:
            self.static = StaticInputs(max_bs, self.spec_round.proposer.full_steps, self.cfg.max_num_seqs,
                                       self.device)
        self.static.reset()
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        costs: dict[int, dict[int, float]] = {}
        per_token: dict[int, dict[int, float]] = {}
        with torch.inference_mode():
            for bucket in buckets:
                fns = {d: list(self._callables(bucket, "greedy", False, depth_of[d]).values()) for d in tiers}

                def timed() -> list[float]:  # (the fastest of the passes after the first, which warms up)
                    times: dict[int, list[float]] = {d: [] for d in tiers}
                    for _ in range(3):
                        for d in tiers:
                            sync()
                            t0 = time.perf_counter()
                            for fn in fns[d]:
                                fn()
                            sync()
                            times[d].append(1e3 * (time.perf_counter() - t0))
                    return [sorted(times[d][1:])[0] for d in tiers]

                short = timed()
                costs[bucket] = dict(zip(tiers, short))
                if context:
                    with self._context_rows(page_table, bucket, context):
                        per_token[bucket] = self._per_token(tiers, short, timed(), bucket, context)
                else:
                    per_token[bucket] = {}
                costs[bucket].update({-lag: self._catch_up_ms(bucket, lag) for lag in self._catch_up_lags()})
        return costs, per_token

    def _catch_up_lags(self) -> list[int]:
        """The catch-up lengths timed: one plain step's token, and a full stash (none without a draft to keep)."""
        proposer = self.spec_round.proposer
        window = proposer.catch_up_window if proposer.keeps_draft_state else 0
        return sorted({1, window}) if window else []

    def _catch_up_ms(self, bucket: int, lag: int, passes: int = 3) -> float:
        """Milliseconds of the draft's catch-up (``Proposer.catch_up``: it runs eagerly) over ``lag`` positions of
        ``bucket`` padding requests (page 0). On a GPU, device time: CUDA events around the calls, queued behind a
        sleeping kernel so that the host's launches are not timed (the step in flight hides them when serving)."""
        proposer = self.spec_round.proposer
        slots = np.full(bucket, self.static.pad_slot, dtype=np.int64)
        pos = np.full(bucket, lag, dtype=np.int64)  # positions 0 .. lag - 1
        run = lambda: proposer.catch_up(slots, pos, pos)  # noqa: E731
        with torch.inference_mode():
            run()  # warm-up
            if self.device.type != "cuda":
                times = []
                for _ in range(passes):
                    t0 = time.perf_counter()
                    run()
                    times.append(1e3 * (time.perf_counter() - t0))
                return sorted(times)[len(times) // 2]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # (the device busy while the host queues the launches: device time alone)
            start.record()
            for _ in range(passes):
                run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / passes

    # ---- the draft's catch-up on a plain step, replayed -----------------------------------------------------------
    def _captures_catch_up(self) -> bool:
        """Whether the draft's catch-up replays graphs (adaptive speculation with depth 0 among its tiers, a draft
        whose catch-up runs in fixed shapes: ``Proposer.fixed_shape_catch_up``). A plain step catches up when a
        request's stash is full, every ``catch_up_window`` plain steps, and a round after plain steps first:
        eagerly, its launches (over a hundred) cost the host more than a plain step's replay, and where the host
        sets the pace (a small model at a large batch), that is time every such step waits."""
        proposer = None if self.spec_round is None else self.spec_round.proposer
        return (self.plain_step is not None and 0 in self.depth_tiers
                and bool(getattr(proposer, "fixed_shape_catch_up", False)))

    def catch_up_spans(self) -> list[int]:
        """The longest lags the catch-up graphs of a bucket cover: the stash's size (a full stash) and the powers of
        two below it (a round after fewer plain steps: its graph pads each request to the span, so a lag pays at
        most twice the KV-only rows it needs, where the full stash's graph would run the whole window's)."""
        window = self.spec_round.proposer.catch_up_window
        return sorted({window} | {1 << i for i in range(window.bit_length()) if 1 << i < window})

    def catch_up_span(self, lag: int) -> int:
        """The span whose graph replays a catch-up of longest lag ``lag``."""
        spans = self.catch_up_spans()
        return spans[bisect.bisect_left(spans, lag)]

    def _catch_up_key(self, bucket: int, longest: int, plain: bool) -> tuple:
        """The graph of a catch-up before a step: before a plain step (a full stash) all but each request's newest
        position (``Proposer.catch_up_behind``, where the stash holds more than two), before a round every position
        (the graph of the shortest span covering the longest lag)."""
        proposer = self.spec_round.proposer
        if plain and proposer.keeps_newest:
            return ("catch_up_behind", bucket, proposer.catch_up_window)
        return ("catch_up", bucket, self.catch_up_span(longest))

    def _capture_catch_up(self, bucket: int) -> None:
        """The bucket's catch-up graphs (``Proposer.catch_up_fixed``), one per span (``catch_up_spans``, the longest
        first: the shorter reuse its pool memory) and a plain step's (``_catch_up_key``, the KV-only pass of the
        window's): request slots and root positions from the static inputs (which
        the step replayed after it reads too), each row's lag from ``catch_up_lags``; captured on padding rows (lag
        0: the padding slot alone). On the host each is one replay where the eager catch-up launches over a hundred
        kernels, which on a host-bound shape costs more than the step it precedes."""
        proposer = self.spec_round.proposer
        if self.catch_up_lags is None:
            self.catch_up_lags = torch.zeros(self.static.max_bs, dtype=torch.int64, device=self.device)
            self._lag_images = PinnedRing((self.static.max_bs,), torch.int64, self.device, buffers=2)
        self.static.reset()
        self.catch_up_lags.zero_()

        def catch_up(span: int, whole_last: bool = True) -> None:
            proposer.catch_up_fixed(self.static.column("req_slots", bucket),
                                    self.static.column("seq_lens", bucket) - 1, self.catch_up_lags[:bucket],
                                    self.static.pad_slot, span, whole_last)

        for span in reversed(self.catch_up_spans()):
            self.capture(("catch_up", bucket, span), partial(catch_up, span))
        if proposer.keeps_newest:
            self.capture(("catch_up_behind", bucket, proposer.catch_up_window),
                         partial(catch_up, proposer.catch_up_window, False))

    def _fill_catch_up_lags(self, lags: np.ndarray, bucket: int) -> None:
        """The rows' lags, then zeros (padding rows), in one host→device copy of the bucket's rows from a pinned
        image used in turn (as ``fill``: no pinned tensor allocated per catch-up, on the step it already slows)."""
        host, image, i = self._lag_images.take()
        image[:len(lags)] = lags
        image[len(lags):bucket] = 0
        self.catch_up_lags[:bucket].copy_(host[:bucket], non_blocking=self._lag_images.pinned)
        self._lag_images.copied(i)

    # ---- the catch-up's compiles at start-up ---------------------------------------------------------------------
    @torch.inference_mode()
    def warm_catch_up(self) -> list[tuple[int, int, bool]]:
        """Run the draft's catch-up (eager) once at every shape that selects other compiled kernels
        (``catch_up_shapes``: the attention's query block and split count follow the requests behind and their
        longest lag, equal or mixed lags take different launches, small row counts their own linears), so that a
        server's first catch-ups do not compile inside its steps. On padding requests (the padding slot, page 0),
        as the cost model's timing: no request's draft KV or state changes. Returns the shapes run."""
        proposer = self.spec_round.proposer
        window = proposer.catch_up_window if proposer.keeps_draft_state else 0
        if not window:
            return []
        t0 = time.perf_counter()
        shapes = catch_up_shapes(window, self.cfg.max_num_seqs, self._catch_up_compile_key())
        pad = self.cfg.max_num_seqs  # (the padding slot, whose page-table row is the padding page)
        for b, n, uniform in shapes:
            lags = np.array([n] * b if uniform else [n] + [1] * (b - 1), dtype=np.int64)
            proposer.catch_up(np.full(b, pad, dtype=np.int64), lags, lags)  # positions 0 .. lag - 1
        logger.info("draft catch-up warm-up: %d shapes in %.1f s", len(shapes), time.perf_counter() - t0)
        return shapes

    def _catch_up_compile_key(self) -> Callable[[int, int, bool], tuple]:
        """key(requests, longest lag, uniform) of a catch-up: its draft attention's launch (the backend's
        ``compile_key``), how Triton specialises the row counts the other kernels take as ints (= 1, divisible by
        16), and the row buckets of counts up to 16 (the small-M linears' tiles; cuBLAS above). A one-layer head's
        KV-only catch-up (``EagleProposer.kv_only_catch_up``) runs attention on one row per request only."""
        proposer = self.spec_round.proposer
        runner = getattr(proposer, "runner", None)
        layer = None if runner is None else attention_layer_spec(runner)
        table = self.spec_round.ctx.page_table
        capacity = table.table.shape[1] * table.page_size

        def rows(x: int):  # (a small-M linear's tile is chosen per row bucket)
            return (row_bucket(x), int_specialisation(x)) if x <= MAX_ROWS else int_specialisation(x)

        def attn(b: int, n: int, uniform: bool) -> tuple:
            return () if layer is None else runner.attn_backend.compile_key(
                ForwardMode.DRAFT_EXTEND, b, n, uniform, layer, capacity)

        def key(b: int, n: int, uniform: bool) -> tuple:
            if getattr(proposer, "kv_only_catch_up", False):
                # the KV-only pass over the positions before each request's last (here the lagging requests, b
                # or 1, each n - 1: a uniform batch's metadata kernel), then one query row per request
                kv = (int_specialisation(b if uniform else 1), int_specialisation(n - 1),
                      rows((n - 1) * (b if uniform else 1))) if n > 1 else None
                return kv, rows(b), attn(b, 1, True)
            t = n * b if uniform else n + b - 1
            return uniform, int_specialisation(n) if uniform else None, rows(t), rows(b), attn(b, n, uniform)

        return key


def attention_layer_spec(runner) -> AttentionLayerSpec | None:
    """A model runner's (dense) attention layer shape, which its backend's ``compile_key`` reads; None without."""
    return next((m.spec for m in runner.model.modules() if isinstance(getattr(m, "spec", None), AttentionLayerSpec)),
                None)


def catch_up_shapes(window: int, max_requests: int, key: Callable[[int, int, bool], tuple]
                    ) -> list[tuple[int, int, bool]]:
    """The draft catch-up's shapes (requests, longest lag, whether every request has that lag; else the others lag
    by 1) over 1..``max_requests`` requests and lags 1..``window``, one per distinct ``key(requests, lag,
    uniform)`` (what its kernels are compiled for), each with the fewest requests."""
    seen, shapes = set(), []
    for uniform in (True, False):
        for n in range(1 if uniform else 2, window + 1):
            for b in range(1 if uniform else 2, max_requests + 1):
                k = key(b, n, uniform)
                if k not in seen:
                    seen.add(k)
                    shapes.append((b, n, uniform))
    return shapes


def eager_extend_shapes(max_requests: int, max_len: int, max_tokens: int,
                        key: Callable[[int, int, bool], tuple | None]) -> list[tuple[int, int, bool]]:
    """Eager prefills' shapes (requests, longest chunk, whether every chunk has that length; else the others have
    one token) up to ``max_requests`` requests, chunks of ``max_len`` tokens and ``max_tokens`` a step, one per
    distinct ``key(requests, longest, uniform)`` (what their kernels are compiled for; None: a shape that replays
    a prefill graph), each with the fewest requests. Chunk lengths: the powers of two and their neighbours, where
    the attention's blocks and Triton's specialisation of a length (= 1, divisible by 16) change."""
    lengths, p = set(), 1
    while p <= 2 * max_len:
        lengths |= {x for x in (p - 1, p, p + 1) if 1 <= x <= max_len}
        p *= 2
    seen, shapes = set(), []
    for uniform in (True, False):
        for n in sorted(lengths):
            if not uniform and n == 1:  # (one token each: that is a uniform batch)
                continue
            for b in range(1 if uniform else 2, max_requests + 1):
                if (n * b if uniform else n + b - 1) > max_tokens:
                    break
                k = key(b, n, uniform)
                if k is not None and k not in seen:
                    seen.add(k)
                    shapes.append((b, n, uniform))
    return shapes


# prefills whose graphs are captured: tokens per step (padded up to a bucket) and requests per step
EXTEND_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
EXTEND_REQUEST_BUCKETS = (1, 2, 4, 8)
EXTEND_FIELDS = STEP_INT_FIELDS[:8]
assert EXTEND_FIELDS[-2:] == ("extend_lens", "next_ids")


class ExtendGraphs(GraphRunner):
    """Prefill (EXTEND) steps of few tokens in CUDA graphs, per (token bucket, request bucket, sampling kind): an
    eager prefill launches every layer's kernels from Python, which for short prompts takes far longer than the
    GPU's work (the first token waits for it; a step in flight does not hide it at one request).

    A step's tokens are padded to the token bucket by one extra padding request on ``pad_slot`` (its page table row
    is all page 0, which nothing reads), its requests to the request bucket by padding requests with no tokens. With
    a draft, the padding request holds at least one token: an empty request's logits row is the step's last token,
    which the draft's prefill writes the token after each chunk into (``Proposer.after_extend``), so the last real
    request's row must not be it. Without one (``exact_fit``), a step of exactly a bucket's tokens replays that
    bucket (the padding rows' tokens are sampled into the pad slot and never read). The lengths exist only on the
    device (``ForwardBatch.build(max_extend=...)``); the attention launch covers the bucket's tokens for every
    request, and programs past a request's tokens do no work.
    With speculation the draft's prefill over the same tokens is captured with it. Greedy graphs of every bucket
    are captured at start-up, with the sampling kinds the worker asks for; other kinds on first use. Only steps
    without logits processing, prompt or top logprobs, structured output or decode rows (``buckets_for``): the
    others run eagerly.

    ``extend``: (token ids, request slots, KV lengths, new-token counts, the token after each chunk, the token
    bucket, sampling) → the sampled ids and their logprobs, as the eager prefill computes them."""

    def __init__(self, device: torch.device, extend: Callable, max_tokens: int, pad_slot: int, rank: int = 0,
                 exact_fit: bool = False):
        super().__init__(device)
        self.extend = extend
        self.exact_fit = exact_fit
        self.token_buckets = [t for t in EXTEND_TOKEN_BUCKETS if t <= max_tokens]
        self.request_buckets = list(EXTEND_REQUEST_BUCKETS)
        self.rank = rank
        self.static = StaticInputs(self.request_buckets[-1] + 1, 0, pad_slot, device, int_fields=EXTEND_FIELDS,
                                   max_tokens=self.token_buckets[-1] if self.token_buckets else 0)
        self.captured: set[tuple[int, int, str]] = set()

    @torch.inference_mode()
    def capture_all(self, pool=None, kinds: tuple[str, ...] = ("greedy",)) -> None:
        """The graphs of every (token, request) bucket and sampling kind in ``kinds``, largest first, in ``pool``
        (the decode graphs')."""
        from tqdm import tqdm

        self.clear()
        self.captured.clear()
        self.pool = pool
        shapes = [(t, r) for t in reversed(self.token_buckets) for r in reversed(self.request_buckets)]
        serving, self.serving = self.serving, False  # (what this captures is start-up's, whenever it runs)
        for t, r in tqdm(shapes, desc="capturing prefill graphs", disable=self.rank != 0):
            for kind in kinds:
                self._capture(t, r, kind)
        self.serving = serving

    def takes(self, tokens: int, requests: int) -> tuple[int, int] | None:
        """(token bucket, request bucket) of a plain prefill of this size, else None (it runs eagerly)."""
        # with a draft, at least one padding token: every empty request's logits row is then the padding request's
        # (a draft's prefill writes the token after each chunk at that row)
        tb = next((x for x in self.token_buckets if x > tokens or (x == tokens and self.exact_fit)), None)
        rb = next((x for x in self.request_buckets if x >= requests), None)
        return None if tb is None or rb is None else (tb, rb)

    def buckets_for(self, step) -> tuple[int, int] | None:
        """(token bucket, request bucket) of an EXTEND step that can replay a graph, else None (it runs eagerly)."""
        if step.mode != ForwardMode.EXTEND:
            return None
        buckets = self.takes(len(step.input_ids), step.batch_size)
        if buckets is None or step.logits_processing or step.top_logprobs:
            return None
        if step.mask_follows or step.token_mask is not None or int(step.input_ids.min()) < 0:
            return None
        if step.prompt_logprobs is not None and max(step.prompt_logprobs) >= 0:
            return None
        return buckets

    def replay_step(self, step, tb: int, rb: int, kind: str) -> PackedOutputs:
        """Run ``step`` through its buckets' graph (captured now on first use of ``kind``); returns its rows' packed
        outputs, valid until the next replay."""
        if (tb, rb, kind) not in self.captured:
            self._capture(tb, rb, kind)
        self.static.fill(step, tb)
        return self.replay(("extend", tb, rb, kind)).rows(step.batch_size)

    def _capture(self, tb: int, rb: int, kind: str) -> None:
        self.static.reset()
        rows = rb + 1  # + the request that holds the bucket's padding tokens
        c = lambda name: self.static.column(name, rows)  # noqa: E731

        def run():
            sampling = self.static.sampling(rows, kind, c("counters"))
            return PackedOutputs.pack(*self.extend(self.static.tokens[:tb], c("req_slots"), c("seq_lens"),
                                                   c("extend_lens"), c("next_ids"), tb, sampling))

        # capture on padding: one padding request holding all the bucket's tokens
        self.static.ints[EXTEND_FIELDS.index("seq_lens"), 0] = tb
        self.static.ints[EXTEND_FIELDS.index("extend_lens"), 0] = tb
        self.capture(("extend", tb, rb, kind), run)
        self.captured.add((tb, rb, kind))


def _depth_key(depth: int | None) -> tuple:
    """A phase's key suffix for a round of ``depth`` drafts (none for num_steps: the plain round's keys)."""
    return () if depth is None else (depth,)
