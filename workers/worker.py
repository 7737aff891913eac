"""A worker = one TP rank: the target model (and the draft), the shared page table, and step execution.

The controller sends every rank the same ``WorkerStep``; ranks compute identical sampled tokens (sampling is a pure
function of logits, seeds and counters), and the controller reads rank 0's ``StepResult``. A step is launched now
(its device work queued, its outputs copied to the host asynchronously) and read later (``step``'s ``keep``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Callable

import numpy as np
import torch

from attention.base import int_specialisation
from speculative.proposers import DraftContext, RoundInputs, make_proposer
from speculative.round import SpecRound
from workers.config import EngineConfig
from workers.distributed import close_distributed, init_distributed, rank_device
from workers.forward_batch import StagedCopies, to_device
from workers.graphs import (LOGITS_VARIANT, MASK_VARIANT, PAUSED_DEPTH, DecodeGraphs, ExtendGraphs,
                            SelectionVariant, attention_layer_spec, eager_extend_shapes, graph_refusal,
                            tune_for_graphs)
from workers.kernels.launch import compile_watch
from workers.kernels.metadata import uniform_token_block
from workers.kernels.small_m_linear import MAX_ROWS, row_bucket
from workers.kv_cache import PageTable
from workers.layers import TPGroup
from workers.logits_processing import LogitsState, record_tokens
from workers.messages import INT_FIELDS, ForwardMode, StepResult, WorkerStep
from workers.model_config import ModelConfig
from workers.model_runner import ModelRunner
from workers.outputs import (
    HostCopy,
    Launched,
    PackedOutputs,
    plain_round_result,
    proposal_result,
    round_result,
    token_result,
    with_prompt_logprobs,
)
from workers.token_mask import apply_token_mask, raw_logprobs
from workers.sampling import (
    TOP_LOGPROBS,
    SamplingTensors,
    sample,
    sampling_kind,
    top_logprobs,
)

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, cfg: EngineConfig, rank: int = 0, dist_addr: tuple[str, int] | None = None):
        self.cfg = cfg
        self.rank = rank
        device_type = cfg.resolved_device()
        self.model_config = model_cfg = ModelConfig.from_pretrained(cfg.model)
        self.dtype = cfg.resolved_dtype(model_cfg.checkpoint_dtype)
        addr = dist_addr or ("127.0.0.1", 29500)
        # first: under TP this chooses the GPU, which must happen before CUDA starts
        self.tp = init_distributed(rank, cfg.tensor_parallel_size, addr[0], addr[1], device_type, self.dtype,
                                   not cfg.disable_custom_all_reduce)
        self.device = rank_device(device_type, self.tp)
        torch.manual_seed(cfg.seed)
        self.max_model_len = min(cfg.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        # RoPE tables reach past the context: a speculative round near the end drafts up to 241 positions further
        rope_len = model_cfg.max_position_embeddings + 256
        prefill_backend, decode_backend = cfg.resolved_attention_backends(device_type)
        if cfg.indexer_key_dtype == "fp8" and model_cfg.architecture != "DeepseekV32ForCausalLM":
            raise ValueError(f"indexer_key_dtype fp8 is for DeepSeek-V3.2 (its lightning indexer); "
                             f"{model_cfg.architecture} has none")
        attention = {"prefill_backend": prefill_backend, "decode_backend": decode_backend,
                     "verify_attention_mode": cfg.verify_attention_mode, "indexer_key_dtype": cfg.indexer_key_dtype}
        self.target = ModelRunner(cfg.model, device=self.device, dtype=self.dtype, tp=self.tp, config=model_cfg,
                                  max_positions=rope_len, **attention)
        spec = cfg.speculative_config
        self.proposer = None
        self.lookahead = 1
        self.max_advance = 1  # most tokens one DECODE step appends to a request
        if spec is not None:
            draft_tp = spec.draft_tensor_parallel_size or self.tp.size
            if draft_tp not in (1, self.tp.size):
                raise ValueError(f"draft_tensor_parallel_size must be 1 or {self.tp.size}, got {draft_tp}")
            self.draft_ctx = DraftContext(
                self.device, self.dtype, tp=self.tp if draft_tp == self.tp.size else TPGroup(), rope_len=rope_len,
                max_requests=cfg.max_num_seqs + 1, target=self.target.model, attention=attention)
            self.proposer = make_proposer(self.draft_ctx, spec)
            self.target.model.capture_aux_hidden(self.proposer.target_aux_layers)
            self.lookahead = self.proposer.lookahead
            self.max_advance = self.proposer.max_depth + 1
        self.graph_refusal = self._graph_refusal()
        self.tuning_cache = None  # the small-M tuning cache (TuningCache), when graphs are on and one is configured
        for runner in self._runners():
            runner.fold_norm_weights()
        if self.graph_refusal is None:
            self.tuning_cache = tune_for_graphs(self._tuned_models(), cfg.resolved_tuning_cache_dir(), self.device)
        self.page_table: PageTable | None = None
        # per request slot: the newest token, which the next DECODE step feeds (written on the device by every step,
        # so a step can be launched before the host has read the previous step's tokens)
        self.last_token = torch.zeros(cfg.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        # per request slot: how many tokens its last DECODE step appended (1, or accepted drafts + 1), which the next
        # step adds to the host's lengths and counters where the host has not read them yet (``WorkerStep.pending``)
        self.advance = torch.ones(cfg.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        # penalties / logit_bias / min_tokens per request slot (allocated when a request first uses them)
        self.logits_state = LogitsState(cfg.max_num_seqs + 1, model_cfg.vocab_size, self.device)
        self.spec_round = None if spec is None else SpecRound(
            self.proposer, self.target, self.draft_ctx, self.last_token, self.advance, spec.simulated_accept_length)
        self.graphs: DecodeGraphs | None = DecodeGraphs(
            cfg, self.device, self.dtype, self.tp, [r.model for r in self._runners()], self._decode, self.spec_round,
            self.last_token, self.advance, rank, logits_state=self.logits_state,
            decode_phases=(self._decode_logits, self._decode_sample))
        self.graphs.selection = self.selection_variant()
        # short prefills replay graphs too (with the draft's prefill over the same tokens)
        self.extend_graphs: ExtendGraphs | None = None
        if cfg.cuda_graph_max_prefill_tokens and all(r.attn_backend.graph_safe_extend for r in self._runners()):
            # (a bucket's padding request stores its tokens at positions up to the bucket: within a page table row)
            self.extend_graphs = ExtendGraphs(self.device, self._extend_graph_step, min(
                cfg.cuda_graph_max_prefill_tokens, cfg.max_prefill_tokens, self.max_model_len), cfg.max_num_seqs, rank,
                exact_fit=self.proposer is None)
        # adaptive speculation (speculative/adaptive.py): rounds draft the depth each step names, timed per depth
        # at start-up (``allocate_kv`` returns the table, which the engine's chooser reads)
        self.adaptive = spec is not None and spec.resolved_adaptive(self.graph_refusal is None)
        self.depth_costs: dict[int, dict[int, float]] | None = None
        self.context_costs: dict[int, dict[int, float]] | None = None
        if self.adaptive:
            self.graphs.depth_tiers = spec.tiers()
        # adaptive speculation's depth 0 is the plain decode step (``_plain_step``): per request slot, the plain
        # steps since the draft last consumed a token, counted on the host (``_lazy_catch_up``); the draft's inputs
        # of those positions wait in the proposer's stash, allocated now where the chooser may pick depth 0 (else
        # on a first forced plain step)
        self.plain_run = np.zeros(cfg.max_num_seqs + 1, dtype=np.int64)
        self.catch_ups = [0, 0]  # catch-ups run, positions they covered (tests, stats)
        self._caught_up = False  # whether the last ``_lazy_catch_up`` caught up (its plain step's result says so)
        self._draft_paused = False  # whether the last DECODE step ran with the draft paused (``_pause_draft``)
        if spec is not None:
            self.graphs.plain_step = self._plain_step
            if self.adaptive and 0 in spec.tiers() and self.proposer.keeps_draft_state:
                self.proposer.allocate_stash(spec.catch_up_window)
                # the draft's pause runs the step without speculation: its graphs captured at start-up too
                self.graphs.paused_graphs = spec.pause_draft_after != 0
        self._page_grants = StagedCopies(self.device)  # each step's page grants to the device
        self._launched: deque[Launched] = deque()  # steps queued on the device whose results are not yet read
        # a ``mask_follows`` step launched up to its logits: its mask → (the copy of its outputs, finish)
        self._awaiting_mask: Callable | None = None
        self._awaiting_s = 0.0  # the waiting step's launch time so far

    def _runners(self) -> list[ModelRunner]:
        return [self.target] + ([self.proposer.runner] if getattr(self.proposer, "runner", None) else [])

    def _graph_refusal(self) -> str | None:
        return graph_refusal(self._runners(), self.cfg, self.device, self.dtype)

    def _tuned_models(self) -> list[torch.nn.Module]:
        """The models whose linears get small-M kernels. A draft replicated on every TP rank keeps cuBLAS, so that
        all ranks run the very same kernels and draft the same tokens (each rank's own timing could pick a different
        kernel, whose rounding differs)."""
        replicated = self.proposer is not None and self.tp.size > 1 and self.draft_ctx.tp.size == 1
        return [r.model for r in self._runners() if r is self.target or not replicated]

    def _on_device(self) -> None:
        """Make this rank's GPU current in the calling thread. The current device is per thread, and Ray runs a
        compiled graph's calls on a thread of its own: after the TP ranks widened their visibility, that thread's
        default (device 0) is rank 0's GPU, and rank 1's kernels and collectives would go there."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    # ---- KV sizing -------------------------------------------------------------------------------------------
    def kv_capacity_pages(self) -> int:
        """How many KV pages this rank can hold (the controller uses the minimum over ranks)."""
        self._on_device()
        page = self.cfg.page_size
        if self.cfg.kv_cache_tokens is not None:
            tokens = self.cfg.kv_cache_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.cfg.gpu_memory_utilization) * total
            tokens = int(budget // self.kv_bytes_per_token())
            # one request at full context, with the positions a speculative round writes past it
            if tokens < self.max_model_len + self.lookahead:
                raise RuntimeError(
                    f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
                    f"leaves room for {max(tokens, 0)} tokens (< max_model_len {self.max_model_len} + "
                    f"{self.lookahead} speculative); raise gpu_memory_utilization, lower max_model_len, or set "
                    "kv_cache_tokens")
        else:  # CPU: enough for every sequence at full length, capped at 64k tokens (but one full request fits)
            tokens = max(min(self.cfg.max_num_seqs * self.max_model_len, 65536), self.max_model_len + self.lookahead)
        return tokens // page + 1  # + the reserved padding page

    def kv_bytes_per_token(self) -> int:
        return self.target.kv_bytes_per_token + (self.proposer.kv_bytes_per_token() if self.proposer else 0)

    def cost_context(self, num_pages: int, longest: int = 512) -> int:
        """The context per row at which the start-up cost model times each step a second time (its growth per token
        of context is the model's second table): ``longest`` tokens, or what the pool's pages hold for the largest
        batch bucket and a request's page-table row (0: too short to time, the context left out)."""
        page, rows = self.cfg.page_size, min(self.cfg.cuda_graph_max_bs, self.cfg.max_num_seqs)
        pages = min((num_pages - 1) // rows, self.page_table.table.shape[1])  # (page 0 is not used)
        context = min(longest, pages * page - self.lookahead, self.max_model_len)
        return context if context >= 64 else 0

    def allocate_kv(self, num_pages: int) -> tuple[dict, dict] | None:
        """Allocate the KV caches and capture the graphs. Returns adaptive speculation's cost model, or None
        without it: ms of a step per batch bucket and draft depth, and per bucket and depth the ms a step grows by
        per token of the batch's context (``DecodeGraphs.depth_costs``)."""
        self._on_device()
        page = self.cfg.page_size
        self.target.allocate_kv_cache(num_pages, page)
        if self.proposer is not None:
            self.proposer.allocate_kv(num_pages, page)
        max_pages_per_req = -(-(self.max_model_len + self.lookahead) // page)
        self.page_table = PageTable(self.cfg.max_num_seqs + 1, max_pages_per_req, page, self.device)
        if self.proposer is not None:
            self.draft_ctx.page_table = self.page_table
        if self.graph_refusal is None:
            self.capture_graphs()
        elif self.device.type == "cuda" and not self.cfg.disable_cuda_graph:
            logger.warning("CUDA graphs are off: %s", self.graph_refusal)
        if self.adaptive:
            self.depth_costs, self.context_costs = self.graphs.depth_costs(
                self.cfg.speculative_config.tiers(), self.page_table, self.cost_context(num_pages))
            if self.device.type == "cuda":  # the eager catch-up's Triton compiles now, not in a server's first steps
                self.graphs.warm_catch_up()
        if self.device.type == "cuda":
            try:  # (and the eager prefills')
                self.warm_eager_extend()
            except Exception:
                # without it a lone rank still serves, compiling inside its first steps; but ranks that run
                # collectives in lockstep would be left out of step, and a CUDA error stays in the context
                if self.tp.size > 1:
                    raise
                torch.cuda.synchronize()
                logger.exception("the eager prefill warm-up failed; serving without it")
            compile_watch().start()  # from here on a compile is a stall inside a step: logged, counted
            for runner in (self.graphs, self.extend_graphs):  # and so is a graph captured on first use
                if runner is not None:
                    runner.serving = True
        return None if self.depth_costs is None else (self.depth_costs, self.context_costs)

    @torch.inference_mode()
    def warm_eager_extend(self) -> list[tuple[int, int, bool]]:
        """Run an eager prefill once at every shape whose kernels compile differently (``eager_extend_shapes``):
        more requests or tokens than the prefill graphs take, chunks cut by the token budget. Served arrivals come
        in such pieces, and each new variant compiled inside a step stalled every stream for 0.1-1 s. Greedy; the
        sampling kernels (plain, and with a top-k / top-p / min-p floor), whose compiles follow only the request
        count's specialisation, once per such class. On the padding slot (its page-table row is page 0, which
        nothing reads, as the prefill graphs' padding request), every chunk ending its prompt; no request's KV or
        state changes. Returns the shapes run greedily."""
        t0 = time.perf_counter()
        pad = self.cfg.max_num_seqs
        shapes = eager_extend_shapes(self.cfg.max_num_seqs, min(self.cfg.max_prefill_tokens, self.max_model_len),
                                     self.cfg.max_prefill_tokens, self._eager_extend_key())

        def prefill(b: int, n: int, uniform: bool, temperature: float = 0.0, top_k: int = 0) -> None:
            lens, zeros = [n] * b if uniform else [n] + [1] * (b - 1), [0] * b
            self.execute(WorkerStep.pack(ForwardMode.EXTEND, req_slots=[pad] * b, input_ids=[0] * sum(lens),
                                         seq_lens=lens, extend_lens=lens, page_updates=([], [], []),
                                         temperature=[temperature] * b, top_k=[top_k] * b, top_p=[1.0] * b,
                                         min_p=[0.0] * b, seeds=zeros, counters=zeros))

        for shape in shapes:
            prefill(*shape)
        sampled = {}
        for b, n, uniform in shapes:  # (the first, short, eager shape of each request-count class)
            sampled.setdefault((int_specialisation(b), row_bucket(b) if b <= MAX_ROWS else None), (b, n, uniform))
        for shape in sampled.values():
            prefill(*shape, temperature=1.0)  # "sample"
            prefill(*shape, temperature=1.0, top_k=20)  # "filter"
        logger.info("eager prefill warm-up: %d shapes in %.1f s", len(shapes) + 2 * len(sampled),
                    time.perf_counter() - t0)
        return shapes

    def compile_stats(self) -> dict | None:
        """What was built inside steps since the worker's start-up, each a stall of every stream: this process's
        Triton compiles (``CompileWatch``; None before it started) and the CUDA graphs captured on first use."""
        watch = compile_watch()
        if not watch.started:
            return None
        runners = [r for r in (self.graphs, self.extend_graphs) if r is not None]
        return {**watch.stats(), "graph_captures": sum(r.late_captures for r in runners),
                "graph_capture_s": round(sum(r.late_capture_s for r in runners), 6)}

    def _eager_extend_key(self) -> Callable[[int, int, bool], tuple | None]:
        """key(requests, longest chunk, uniform) of an eager prefill (None where it replays a prefill graph): the
        target's and the draft's attention launch (the backends' ``compile_key``), how Triton specialises the
        chunk length (and the uniform metadata kernel's block for it), the request and token counts the other
        kernels take as ints, and the row buckets of the logits rows and of the tokens (the small-M linears' tiles,
        up to 16 rows)."""
        graphs = self.extend_graphs if self.extend_graphs is not None and self.extend_graphs.captured else None
        capacity = self.page_table.table.shape[1] * self.page_table.page_size
        parts = [(self.target, ForwardMode.EXTEND)]
        if getattr(self.proposer, "runner", None) is not None:
            parts.append((self.proposer.runner, ForwardMode.DRAFT_EXTEND))
        attention = [(runner, mode, spec) for runner, mode in parts
                     for spec in [attention_layer_spec(runner)] if spec is not None]

        def key(b: int, n: int, uniform: bool) -> tuple | None:
            tokens = n * b if uniform else n + b - 1
            if graphs is not None and graphs.takes(tokens, b) is not None:
                return None
            return (uniform, (int_specialisation(n), uniform_token_block(n)) if uniform else None,
                    int_specialisation(b), int_specialisation(tokens), row_bucket(b) if b <= MAX_ROWS else None,
                    row_bucket(tokens) if tokens <= MAX_ROWS else None,
                    tuple(runner.attn_backend.compile_key(mode, b, n, uniform, spec, capacity)
                          for runner, mode, spec in attention))

        return key

    # ---- CUDA graphs (``workers.graphs``) --------------------------------------------------------------------
    def selection_variant(self) -> SelectionVariant | None:
        """Sparse MLA's long-rows graphs, for the runners' backends with the mode (``SelectionVariant``)."""
        return SelectionVariant.of(self._runners())

    def capture_graphs(self) -> None:
        self.graphs.capture_all(self.tuning_cache)
        if self.extend_graphs is not None and self.extend_graphs.token_buckets:
            self.extend_graphs.capture_all(self.graphs.pool, ("greedy", *self.cfg.cuda_graph_sampling_kinds))

    # ---- stepping: launch now, results later ----------------------------------------------------------------------
    def step(self, step: WorkerStep | None, keep: int = 0) -> list[StepResult]:
        """Queue ``step``'s device work (if any), then return the results of the oldest queued steps, in order,
        until at most ``keep`` are still in flight. ``keep=1`` overlaps: the device runs this step while the caller
        handles the previous step's result and plans the next one. A step that raises comes back with ``error``."""
        self._on_device()
        if step is not None:
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    if step.mask_for:  # the masks of the step waiting for them: it samples / verifies now
                        step_id, launched = step.mask_for, self._finish_masked(step.token_mask)
                    else:
                        step_id, self._awaiting_mask = step.step_id, None
                        # the page grants first: a step planned after this one counts on them even if this one fails
                        self._apply_pages(step)
                        launched = self._launch(step)
                launch_s = time.perf_counter() - t0
                if step.mask_for:  # the step's time before its masks came counts as its launch too
                    launch_s += self._awaiting_s
                elif step.mask_follows:
                    self._awaiting_s = launch_s
                if launched is not None:  # (None: a step now waiting for its masks)
                    self._launched.append(Launched(step_id, *launched, launch_s))
            except Exception as e:  # noqa: BLE001 - this step's requests fail; those before and after it go on
                logger.exception("worker step failed")
                self._awaiting_mask = None
                self._launched.append(Launched(step.mask_for or step.step_id, None, None, time.perf_counter() - t0,
                                               error=f"{type(e).__name__}: {e}"))
        results = []
        while len(self._launched) > keep:
            results.append(self._launched.popleft().result())
        return results

    def _finish_masked(self, mask):
        """A mask message: the waiting step runs on from its logits (None if it had failed: its error is queued)."""
        awaiting, self._awaiting_mask = self._awaiting_mask, None
        return None if awaiting is None else awaiting(mask)

    def execute(self, step: WorkerStep) -> StepResult:
        """One step, waited for (tools and benchmarks); raises RuntimeError if it failed."""
        if self._launched:
            raise RuntimeError("execute() with overlapped steps still in flight")
        (result,) = self.step(step, keep=0)
        if result.error is not None:
            raise RuntimeError(result.error)
        return result

    def _apply_pages(self, step: WorkerStep) -> None:
        if step.page_updates.shape[1]:  # (most DECODE steps grant no page) one host→device copy for the three rows
            slots, pos, ids = self._page_grants(step.page_updates).unbind(0)
            self.page_table.apply(slots, pos, ids)

    def _sampling(self, step: WorkerStep, counters=None, slots=None) -> SamplingTensors:
        p = SamplingTensors.from_lists(step.temperature, step.top_k, step.top_p, step.min_p, step.seeds,
                                       step.counters if counters is None else counters, self.device)
        if step.logits_processing:
            p.logits_state = self.logits_state
            p.req_slots = to_device(step.req_slots, torch.int64, self.device) if slots is None else slots
        return p

    def _launch(self, step: WorkerStep) -> tuple[HostCopy, Callable[[list[list]], StepResult]] | None:
        """The step's device work queued, and what reads its outputs; None for a ``mask_follows`` step that waits
        for its masks (``_awaiting_mask``)."""
        if step.mode == ForwardMode.DECODE:
            return self._launch_decode(step)
        if self.proposer is not None:  # a prefill's draft consumes its tokens (``after_extend``): none behind
            self.plain_run[step.req_slots] = 0
        if step.logits_setup is not None:
            self.logits_state.setup(step.logits_setup)
        buckets = self.extend_graphs.buckets_for(step) if self.extend_graphs and self.extend_graphs.captured else None
        if buckets is not None:
            kind = sampling_kind(step.temperature, step.top_k, step.top_p, step.min_p)
            return HostCopy(self.extend_graphs.replay_step(step, *buckets, kind)), token_result
        fb = self.target.new_batch(step.mode, self._extend_ids(step), step.req_slots, step.seq_lens.tolist(),
                                   step.extend_lens.tolist(), page_table=self.page_table)
        sampling = self._sampling(step, slots=fb.req_slots)
        hidden = self.target.forward(fb)
        logits = self.target.logits(hidden[fb.logits_indices])
        sample_phase = partial(self._extend_sample, step, fb, sampling, hidden, logits)
        if step.mask_follows:
            self._awaiting_mask = sample_phase
            return None
        return sample_phase(step.token_mask)

    def _extend_sample(self, step: WorkerStep, fb, sampling: SamplingTensors, hidden: torch.Tensor,
                       logits: torch.Tensor, token_mask) -> tuple[HostCopy, Callable[[list[list]], StepResult]]:
        """An EXTEND step from its logits on: sampling (under ``token_mask``), the draft's catch-up, outputs."""
        ids, logprobs = sample(apply_token_mask(logits, token_mask), sampling)
        if token_mask is not None:
            logprobs = raw_logprobs(logits, ids)
        if sampling.logits_state is not None:  # a chunk that does not end its prompt samples a token nobody keeps
            record_tokens(sampling, ids.unsqueeze(1), to_device(step.next_ids < 0, torch.bool, self.device)[:, None])
        self._prefill_sampled(fb, hidden, ids, step.next_ids)
        top = top_logprobs(logits, TOP_LOGPROBS) if step.top_logprobs else ()
        copy = HostCopy(PackedOutputs.pack(ids, logprobs, *top))
        if step.prompt_logprobs is None or max(step.prompt_logprobs) < 0:
            return copy, token_result
        rows, packed = self._prompt_logprobs(step, hidden)
        return copy, partial(with_prompt_logprobs, prompt=HostCopy(packed), rows=rows, batch=step.batch_size)

    def _prefill_sampled(self, fb, hidden: torch.Tensor, ids: torch.Tensor, next_ids) -> None:
        """A prefill's device state once its tokens are sampled: each request's newest token, and the draft run over
        the same tokens (``next_ids``: the token after each chunk, -1 where it ends the prompt)."""
        self.last_token[fb.req_slots] = ids  # what the next DECODE feeds (a non-final chunk's is overwritten later)
        if self.proposer is not None:  # prefill: the draft catches up on the same tokens
            # a round launched before this step is read adds the one token it samples (not the slot's last round's);
            # index_fill_, not ``advance[slots] = 1``: that copies the number over with a blocking copy, which waits
            # for the device (with the overlap schedule, for the step in flight as well)
            self.advance.index_fill_(0, fb.req_slots, 1)
            self.proposer.after_extend(fb, self.proposer.target_features(fb, hidden), ids, next_ids)

    def _extend_graph_step(self, ids: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                           extend_lens: torch.Tensor, next_ids: torch.Tensor, max_extend: int,
                           sampling: SamplingTensors):
        """A prefill graph's work (``ExtendGraphs``): the eager prefill's forward, sampling and draft, on lengths
        that only the device has."""
        fb = self.target.new_batch(ForwardMode.EXTEND, ids, slots, seq_lens, extend_lens, page_table=self.page_table,
                                   max_extend=max_extend)
        hidden = self.target.forward(fb)
        sampled, logprobs = sample(self.target.logits(hidden[fb.logits_indices]), sampling)
        self._prefill_sampled(fb, hidden, sampled, next_ids)
        return sampled, logprobs

    PROMPT_LOGITS_ROWS = 1024  # prompt positions whose [rows, vocab] logits exist at once (bounded memory)

    def _prompt_logprobs(self, step: WorkerStep, hidden: torch.Tensor) -> tuple[list[tuple[int, int, int]], PackedOutputs]:
        """Prompt logprobs of the requests that asked: at each position of a request's chunk, the log_softmax of the
        target's logits (no temperature or filter) at the next prompt token, which the host knows (the next chunk's
        first token is ``next_ids``; the position that ends the prompt predicts an output token: none there). Returns
        (request index, values, alternatives) per asking request and the values packed [N, 1 + 2K]."""
        want, lens, nxt = step.prompt_logprobs, step.extend_lens.tolist(), step.next_ids.tolist()
        host_ids = step.input_ids.tolist() if hasattr(step.input_ids, "tolist") else list(step.input_ids)
        index, targets, rows, start = [], [], [], 0
        for i, (k, n) in enumerate(zip(want, lens)):
            if k >= 0:
                following = host_ids[start + 1:start + n] + ([nxt[i]] if nxt[i] >= 0 else [])
                index.extend(range(start, start + len(following)))
                targets.extend(following)
                rows.append((i, len(following), k))
            start += n
        kmax = max(k for _, _, k in rows)
        if not index:  # (one-token prompts: nothing to compute, a placeholder to copy)
            return rows, PackedOutputs.pack(torch.zeros(1, device=self.device))
        idx = to_device(index, torch.int64, self.device)
        tgt = to_device(targets, torch.int64, self.device)
        lps, top_ids, top_lps = [], [], []
        for a in range(0, len(index), self.PROMPT_LOGITS_ROWS):
            logits = self.target.logits(hidden[idx[a:a + self.PROMPT_LOGITS_ROWS]]).float()
            lse = torch.logsumexp(logits, dim=-1)
            lps.append(logits.gather(1, tgt[a:a + self.PROMPT_LOGITS_ROWS, None]).squeeze(1) - lse)
            if kmax:
                vals, ids = logits.topk(min(kmax, logits.shape[-1]), dim=-1)
                top_ids.append(ids)
                top_lps.append(vals - lse[:, None])
        return rows, PackedOutputs.pack(torch.cat(lps), *([torch.cat(top_ids), torch.cat(top_lps)] if kmax else []))

    def _extend_ids(self, step: WorkerStep) -> torch.Tensor:
        """The EXTEND step's token ids on the device. A decode row riding in it (-1, one token) feeds its request's
        newest token, read on the device as a DECODE step does (the host may not have read it yet)."""
        ids = to_device(step.input_ids, torch.int64, self.device)
        host = step.input_ids  # (a list, or an array: its own min, not a Python loop over it)
        if (min(host) if isinstance(host, list) else int(host.min())) >= 0:
            return ids
        if self.proposer is not None:  # (its lengths would be the device's, and the draft's catch-up needs ids)
            raise ValueError("decode rows ride in EXTEND steps only without speculation")
        slots = to_device(step.req_slots, torch.int64, self.device)
        ext = to_device(step.extend_lens, torch.int64, self.device)
        token_slots = torch.repeat_interleave(slots, ext, output_size=len(step.input_ids))
        return torch.where(ids >= 0, ids, self.last_token[token_slots])

    # ---- DECODE: a plain step or a speculative round, eager or replayed from a CUDA graph -----------------------
    def _launch_decode(self, step: WorkerStep) -> tuple[HostCopy, Callable[[list[list]], StepResult]] | None:
        kind, top = sampling_kind(step.temperature, step.top_k, step.top_p, step.min_p), step.top_logprobs
        if step.logits_processing:
            kind += LOGITS_VARIANT
        bucket = self.graphs.bucket_for(step.batch_size)
        masked = step.mask_follows or step.token_mask is not None  # structured output drafts num_steps
        # adaptive speculation's depth for this round (None: num_steps; 0: the plain decode step)
        depth = None
        if self.spec_round is not None and 0 <= step.spec_depth != self.proposer.full_steps and not masked:
            depth = step.spec_depth
        if step.draft_paused and not masked:
            return self._paused_step(step, bucket, kind, top)
        self._draft_paused = False
        catch_up_lags = None  # (the draft's catch-up replayed before the step)
        if self.spec_round is not None:
            replayed = bucket is not None and not masked and self.graphs.catch_up_graphs
            step, catch_up_lags = self._lazy_catch_up(step, plain=depth == 0, replayed=replayed)
        if masked:
            return self._launch_masked(step, bucket, kind + MASK_VARIANT, top)
        if bucket is None:
            inp = self._eager_inputs(step)
            if self.spec_round is None:
                packed = PackedOutputs.pack(*self._decode(inp, top, step.token_mask))
            elif depth == 0:
                packed = PackedOutputs.pack(*self._plain_step(inp, top))
            else:
                with self.proposer.at_depth(depth):
                    packed = PackedOutputs.pack(*self.spec_round.run(inp, top))
        else:
            packed = self.graphs.replay_step(step, bucket, kind, top, depth, catch_up_lags)
        # copied now: the next replay overwrites a graph's outputs
        if self.spec_round is None:
            return HostCopy(packed), token_result
        if depth == 0:  # (the scheduler counts each row's lag by whether the step caught up: the whole batch did)
            return HostCopy(packed), partial(plain_round_result, caught_up=self._caught_up)
        tree_size = self.proposer.tree_size if depth is None else depth + 1
        finish = partial(round_result, tree_size=tree_size)
        return HostCopy(packed), finish

    def _paused_step(self, step: WorkerStep, bucket: int | None, kind: str, top: bool
                     ) -> tuple[HostCopy, Callable[[list[list]], StepResult]]:
        """A plain step with the draft paused: what a worker without speculation launches (``_decode``, eagerly or
        from the bucket's paused graph) and its result read as one; the first of a pause drops the pending draft
        inputs first (``_pause_draft``)."""
        entering = not self._draft_paused
        if entering:
            step = self._pause_draft(step)
        if bucket is None:  # (after the first, every slot's advance is one: read as decoding without speculation)
            packed = PackedOutputs.pack(*self._decode(self._eager_inputs(step, one_each=not entering), top))
        else:
            packed = self.graphs.replay_step(step, bucket, kind, top, PAUSED_DEPTH)
        if entering:  # (after the step, which read the advance of a round in flight where it follows one)
            self.advance.fill_(1)
        return HostCopy(packed), token_result

    def _pause_draft(self, step: WorkerStep) -> WorkerStep:
        """The draft's pause begins: every request's pending draft inputs are dropped (no catch-up: its draft KV
        keeps holes there; verification decides every token, so outputs do not change). Its plain steps leave the
        device's per-slot ``advance`` alone, so from here the step's lengths are moved on the host where a row's last
        step was plain (as ``_lazy_catch_up``); after the step every slot's advance is one, the next steps appending
        one token each, and the paused steps read it as decoding without speculation does."""
        self._draft_paused = True
        run = self.plain_run[step.req_slots]
        if run.any():
            step = _with_host_lengths(step, run)
        self.plain_run[:] = 0
        return step

    def _launch_masked(self, step: WorkerStep, bucket: int | None, kind: str, top: bool):
        """A DECODE step under structured-output masks, eagerly or through the bucket's ``+mask`` graphs (the masks
        a static input). With ``mask_follows`` it runs up to its logits (a round: proposes its drafts, returned now,
        and runs the target's verify forward) and waits for the masks; else its masks came with it (a plain step)."""
        b = step.batch_size
        spec = self.spec_round
        finish = token_result if spec is None else partial(round_result, tree_size=self.proposer.tree_size)
        if spec is not None and not step.mask_follows:
            raise ValueError("a speculative round's masks follow its drafts (mask_follows)")
        if bucket is not None:
            proposal = self.graphs.replay_until_mask(step, bucket, kind, top)
            rest = lambda mask: (HostCopy(self.graphs.replay_after_mask(mask, b, bucket, kind, top)), finish)  # noqa: E731
        else:
            inp = self._eager_inputs(step)
            if spec is None:
                logits = self._decode_logits(inp)
                proposal = None
                rest = lambda mask: (HostCopy(PackedOutputs.pack(  # noqa: E731
                    *self._decode_sample(inp, logits, top, mask))), finish)
            else:
                tree = spec.propose(inp)
                parents = tree.parents if tree.parents is not None else torch.full_like(tree.tokens, -2)
                proposal = PackedOutputs.pack(tree.tokens, parents)
                forward = spec.verify_forward(inp, tree)

                def rest(mask):
                    verdict, features, alternatives = spec.verify_accept(inp, tree, forward, top, mask)
                    outs = spec.catch_up(inp, tree, verdict, features, alternatives)
                    return HostCopy(PackedOutputs.pack(*outs)), finish
        if not step.mask_follows:
            return rest(step.token_mask)
        self._awaiting_mask = rest
        # a round's drafts now (copied before the verify forward runs), for the host's masks
        return None if proposal is None else (HostCopy(proposal), proposal_result)

    def _lazy_catch_up(self, step: WorkerStep, plain: bool, replayed: bool = False
                       ) -> tuple[WorkerStep, np.ndarray | None]:
        """Adaptive speculation's bookkeeping before a speculative DECODE step (``plain``: depth 0), from the host's
        per-slot counts of plain steps (``plain_run``), reading nothing from the device:

        - a request whose last step was plain appended exactly one token there, so its lengths come from the host
          (plain steps leave the device's per-slot ``advance`` as it was, as no-speculation decoding does);
        - before a round, the draft catches up on every position its requests' plain steps left; before a plain step
          only when some request's stash is full (``catch_up_window`` positions), and then on all but each
          request's newest (``Proposer.catch_up_behind``: the whole-layer pass there waits for a round). With
          ``replayed`` (the step replays its bucket's graphs, and the catch-up has its own per span of lags:
          ``DecodeGraphs._capture_catch_up``) the catch-up is left to those graphs (their rows padded to the span);
          else it runs eagerly, one ragged DRAFT_EXTEND over exactly the positions behind (over a hundred
          launches).

        Returns the step (with the lengths moved where they are known) and, where the graph is to catch up, each
        row's lag (0: not behind); else None."""
        slots = step.req_slots
        run = self.plain_run[slots]
        longest = int(run.max()) if len(run) else 0  # (run >= 0: a request is behind where it is > 0)
        lags = None
        caught_up = False
        p = self.proposer
        if plain and p.keeps_draft_state and p.catch_up_window == 0:  # a plain step forced without adaptive
            p.allocate_stash(self.cfg.speculative_config.catch_up_window)
        # a plain step's catch-up frees one column of the ring, keeping the newest position (``lag_after_plain_step``)
        keep_newest = plain and p.keeps_newest
        if longest:
            step = _with_host_lengths(step, run)
            if p.keeps_draft_state and (not plain or longest >= p.catch_up_window):
                if replayed:
                    lags = run
                else:
                    i = np.flatnonzero(run)
                    (p.catch_up_behind if keep_newest else p.catch_up)(slots[i], step.seq_lens[i] - 1, run[i])
                self.catch_ups[0] += 1
                self.catch_ups[1] += int(run.sum()) - (int(np.count_nonzero(run)) if keep_newest else 0)
                caught_up = True
        self._caught_up = caught_up
        if not plain:
            self.plain_run[slots] = 0
        elif not longest:  # (every row's run is now 1: no new array)
            self.plain_run[slots] = 1
        elif caught_up and keep_newest:  # (each row behind kept its newest position)
            self.plain_run[slots] = np.minimum(run, 1) + 1
        elif caught_up:
            self.plain_run[slots] = 1
        else:
            self.plain_run[slots] = run + 1
        return step, lags

    def _plain_step(self, inp: RoundInputs, top: bool = False) -> tuple[torch.Tensor, ...]:
        """Adaptive speculation's depth 0: the plain decode step (``_decode``, what no speculation runs), and the
        draft's inputs at the root's position stashed for its catch-up (``Proposer.stash``)."""
        seen: dict = {}
        logits = self._decode_logits(inp, seen)
        out = self._decode_sample(inp, logits, top)
        self.proposer.stash(inp, seen["fb"], seen["hidden"], out[0])
        return out

    def _eager_inputs(self, step: WorkerStep, one_each: bool = False) -> RoundInputs:
        """``one_each``: every step in flight appends one token (no speculation's, or the draft's pause's)."""
        slots = to_device(step.req_slots, torch.int64, self.device)
        seq_lens, counters = step.seq_lens, step.counters
        if step.pending.any():  # eager rounds need host lengths: wait for the step in flight
            ahead = 1 if self.proposer is None or one_each else self.advance[slots].cpu().numpy()
            seq_lens, counters = seq_lens + step.pending * ahead, counters + step.pending * ahead
        seq = to_device(seq_lens, torch.int64, self.device)
        drafts = to_device(step.draft_tokens, torch.int64, self.device) if step.draft_tokens is not None else None
        return RoundInputs(root=self.last_token[slots], req_slots=slots, seq_lens=seq_lens.tolist(),
                           root_pos=seq - 1, sampling=self._sampling(step, counters, slots), drafts=drafts)

    def _decode(self, inp: RoundInputs, top: bool = False, token_mask=None) -> tuple[torch.Tensor, ...]:
        """One DECODE forward and sampling: (ids [B], logprobs [B]), and with ``top`` the TOP_LOGPROBS most likely
        tokens' (ids [B, K], logprobs [B, K])."""
        return self._decode_sample(inp, self._decode_logits(inp), top, token_mask)

    def _decode_logits(self, inp: RoundInputs, seen: dict | None = None) -> torch.Tensor:
        """The target's DECODE forward to the logits (``seen`` gets its batch and hidden states)."""
        fb = self.target.new_batch(ForwardMode.DECODE, inp.root, inp.req_slots, inp.seq_lens, [1] * inp.batch_size,
                                   page_table=self.page_table, positions=inp.root_pos)
        hidden = self.target.forward(fb)
        if seen is not None:
            seen.update(fb=fb, hidden=hidden)
        return self.target.logits(fb.logits_rows(hidden))

    def _decode_sample(self, inp: RoundInputs, logits: torch.Tensor, top: bool = False,
                       token_mask=None) -> tuple[torch.Tensor, ...]:
        ids, logprobs = sample(apply_token_mask(logits, token_mask), inp.sampling)
        if token_mask is not None:
            logprobs = raw_logprobs(logits, ids)
        self.last_token[inp.req_slots] = ids
        record_tokens(inp.sampling, ids.unsqueeze(1))
        return (ids, logprobs, *top_logprobs(logits, TOP_LOGPROBS)) if top else (ids, logprobs)

    def shutdown(self) -> None:
        self._on_device()
        self.graphs = None  # captured graphs hold NCCL kernels: release them before the communicator
        close_distributed(self.tp)


_SEQ, _COUNTERS, _PENDING = (INT_FIELDS.index(f) for f in ("seq_lens", "counters", "pending"))
_SEQ_AND_COUNTERS = slice(_SEQ, _COUNTERS + 1, _COUNTERS - _SEQ)


def _with_host_lengths(step: WorkerStep, run: np.ndarray) -> WorkerStep:
    """``step`` with the lengths and counters of its rows whose last step was plain (``run`` > 0: one token
    appended, which the device's ``advance`` does not say) moved past the step in flight. Pending is 0 or 1 (one
    step in flight at most). Few whole-row numpy ops and no dataclasses.replace: this runs on every plain step, over
    every row."""
    moved = np.minimum(step.pending, run)
    ints = step.ints.copy()
    ints[_SEQ_AND_COUNTERS] += moved  # (both rows in one op: a strided view)
    ints[_PENDING] -= moved
    return _with_ints(step, ints)


def _with_ints(step: WorkerStep, ints: np.ndarray) -> WorkerStep:
    """``step`` with other ``ints``, a shallow copy (``dataclasses.replace`` runs ``__init__`` over every field, and
    ``copy.copy`` would go through ``WorkerStep.__getstate__``'s bytes): the caller's step is left as it was."""
    moved = object.__new__(WorkerStep)
    moved.__dict__.update(step.__dict__)
    moved.ints = ints
    return moved
