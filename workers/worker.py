"""A worker = one TP rank: the target model (and the draft), the shared page table, and step execution.

The controller sends every rank the same ``WorkerStep``; ranks compute identical sampled tokens (sampling is a pure
function of logits, seeds and counters), and the controller reads rank 0's ``StepResult``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from speculative.proposers import RoundInputs
from workers.config import EngineConfig
from workers.forward_batch import to_device
from workers.graph_runner import GraphRunner, StaticInputs, batch_buckets
from workers.kernels.metadata import overlap_step_inputs
from workers.kernels.verdict import record_round
from workers.kv_cache import PageTable
from workers.layers import TPGroup
from workers.messages import ForwardMode, StepResult, WorkerStep
from workers.model_config import ModelConfig
from workers.model_runner import ModelRunner
from workers.sampling import (
    TOP_LOGPROBS,
    SamplingTensors,
    sample,
    sampling_kind,
    top_logprobs,
)

logger = logging.getLogger(__name__)

# choosing a bucket's graphs with or without the norms inside the linears (Worker._capture_faster_fusion): rounds of
# alternating timings, graph replays per timing, and how much faster the graphs with norm kernels must be to be kept
NORM_FUSION_PASSES = 5
NORM_FUSION_REPLAYS = 10
NORM_FUSION_MARGIN = 0.01


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, device: str,
                     dtype: torch.dtype = torch.float32, custom_all_reduce: bool = True) -> TPGroup:
    """The TP group. On GPUs this also picks the rank's device (before anything starts CUDA in this process)."""
    if world_size == 1:
        return TPGroup()
    index = None
    if not dist.is_initialized():
        # our own store first: the ranks can swap GPU ids over it before the NCCL group (which starts CUDA) exists
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                              timeout=timedelta(minutes=30))  # ranks may start minutes apart (model downloads)
        if device == "cuda" and custom_all_reduce:
            index = share_node_gpus(store, rank, world_size)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size)
    nccl = custom = None
    if device == "cuda":
        from workers.kernels.all_reduce import create_custom_all_reduce
        from workers.nccl import NcclCommunicator

        if index is not None and torch._C._cuda_getDeviceCount() != world_size:
            if torch._C._cuda_getDeviceCount() != 1:
                raise RuntimeError(f"rank {rank}: CUDA_VISIBLE_DEVICES was widened to "
                                   f"{os.environ['CUDA_VISIBLE_DEVICES']} but CUDA sees "
                                   f"{torch._C._cuda_getDeviceCount()} GPUs")
            # the driver had started before the visibility was widened: this rank still sees only its own GPU
            logger.warning("rank %d: the GPU visibility could not be widened; the custom all-reduce may be off", rank)
            index = 0
        torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", 0)))
        here = torch.device("cuda", torch.cuda.current_device())
        nccl = NcclCommunicator(dist.group.WORLD, rank, world_size, here)
        if custom_all_reduce:
            custom = create_custom_all_reduce(dist.group.WORLD, rank, world_size, dtype, here)
    return TPGroup(rank=rank, size=world_size, group=dist.group.WORLD, nccl=nccl, custom_all_reduce=custom)


def share_node_gpus(store, rank: int, world_size: int) -> int | None:
    """Make every rank's GPU visible to every rank, so that the custom all-reduce can map its peers' memory.

    A launcher that isolates each rank on its own GPU (Ray sets CUDA_VISIBLE_DEVICES=<id> for a one-GPU actor) hides
    the peers. Before CUDA starts here, the ranks swap their GPU ids over ``store``; each then sees
    all of them in rank order and uses device ``rank``, which is returned. None leaves the visibility as it is: some
    rank sees more or less than one GPU (e.g. a launcher that sets LOCAL_RANK), two ranks share one, or CUDA already
    started in this process."""
    from workers.kernels.all_reduce import widened_visibility

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    store.set(f"specserve/gpu/{rank}", visible)
    everyone = [store.get(f"specserve/gpu/{r}").decode() for r in range(world_size)]
    joined = widened_visibility(everyone)
    if joined is None or torch.cuda.is_initialized():
        return None
    os.environ["CUDA_VISIBLE_DEVICES"] = joined
    os.environ["LOCAL_RANK"] = str(rank)  # a later Worker in this process finds its GPU again
    return rank


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
class _Launched:
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


def _token_result(lists: list[list]) -> StepResult:
    ids, logprobs, *top = lists
    res = StepResult(tokens=[[t] for t in map(int, ids)], logprobs=[[lp] for lp in logprobs])
    if top:  # [B, K] ids and logprobs
        res.top_logprobs = [[list(zip(map(int, i), v))] for i, v in zip(*top)]
    return res


class Worker:
    def __init__(self, cfg: EngineConfig, rank: int = 0, dist_addr: tuple[str, int] | None = None):
        self.cfg = cfg
        self.rank = rank
        device_type = cfg.resolved_device()
        model_cfg = ModelConfig.from_pretrained(cfg.model)
        self.model_config = model_cfg
        self.dtype = cfg.resolved_dtype(model_cfg.checkpoint_dtype)
        addr = dist_addr or ("127.0.0.1", 29500)
        # first: under TP this chooses the GPU, which must happen before CUDA starts
        self.tp = init_distributed(rank, cfg.tensor_parallel_size, addr[0], addr[1], device_type, self.dtype,
                                   not cfg.disable_custom_all_reduce)
        if device_type == "cuda":
            if self.tp.size == 1:  # Ray: the actor's one GPU (CUDA_VISIBLE_DEVICES); process launchers: LOCAL_RANK
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(cfg.seed)
        self.max_model_len = min(cfg.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        # RoPE tables reach past the context: a speculative round near the end drafts up to 241 positions further
        self.rope_len = model_cfg.max_position_embeddings + 256
        self.target = ModelRunner(
            cfg.model, device=self.device, dtype=self.dtype, tp=self.tp, config=model_cfg,
            max_positions=self.rope_len,
            prefill_backend=cfg.prefill_attention_backend, decode_backend=cfg.decode_attention_backend,
            verify_attention_mode=cfg.verify_attention_mode,
        )
        spec = cfg.speculative_config
        self.proposer = None
        self.lookahead = 1
        self.max_advance = 1  # most tokens one DECODE step appends to a request
        if spec is not None:
            from speculative.proposers import make_proposer

            draft_tp = spec.draft_tensor_parallel_size or self.tp.size
            if draft_tp not in (1, self.tp.size):
                raise ValueError(f"draft_tensor_parallel_size must be 1 or {self.tp.size}, got {draft_tp}")
            self.draft_tp = self.tp if draft_tp == self.tp.size else TPGroup()
            self.proposer = make_proposer(self, spec)
            self.lookahead = self.proposer.lookahead
            self.max_advance = self.proposer.max_depth + 1
        self.graph_refusal = self._graph_refusal()
        self.tuning_cache = None  # the small-M tuning cache (TuningCache), when graphs are on and one is configured
        self._fold_norm_weights()
        if self.graph_refusal is None:
            self._tune_small_m_linears()
        self.page_table: PageTable | None = None
        self.pad_slot = cfg.max_num_seqs  # the page-table row (all page 0) padded graph rows use
        self.graphs: GraphRunner | None = None  # set by capture_graphs, with the three below
        self.static: StaticInputs | None = None
        self.graph_buckets: list[int] = []
        # (bucket, sampling kind, top logprobs) → graph names in replay order
        self.graph_phases: dict[tuple[int, str, bool], list[str]] = {}
        # batch bucket → whether its graphs run the norms inside the linears (decided at its greedy capture)
        self.norm_fusion: dict[int, bool] = {}
        # per request slot: the newest token, which the next DECODE step feeds (written on the device by every step,
        # so a step can be launched before the host has read the previous step's tokens)
        self.last_token = torch.zeros(cfg.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        # per request slot: how many tokens its last DECODE step appended (1, or accepted drafts + 1), which the next
        # step adds to the host's lengths and counters where the host has not read them yet (``WorkerStep.pending``)
        self.advance = torch.ones(cfg.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self._launched: deque[_Launched] = deque()  # steps queued on the device whose results are not yet read

    # ---- KV sizing -------------------------------------------------------------------------------------------
    def _on_device(self) -> None:
        """Make this rank's GPU current in the calling thread. The current device is per thread, and Ray runs a
        compiled graph's calls on a thread of its own: after the TP ranks widened their visibility, that thread's
        default (device 0) is rank 0's GPU, and rank 1's kernels and collectives would go there."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

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

    def allocate_kv(self, num_pages: int) -> None:
        self._on_device()
        page = self.cfg.page_size
        self.target.allocate_kv_cache(num_pages, page)
        if self.proposer is not None:
            self.proposer.allocate_kv(num_pages, page)
        max_pages_per_req = -(-(self.max_model_len + self.lookahead) // page)
        self.page_table = PageTable(self.cfg.max_num_seqs + 1, max_pages_per_req, page, self.device)
        if self.graph_refusal is None:
            self.capture_graphs()
        elif self.device.type == "cuda" and not self.cfg.disable_cuda_graph:
            logger.warning("CUDA graphs are off: %s", self.graph_refusal)

    def _runners(self) -> list:
        return [self.target] + ([self.proposer.runner] if getattr(self.proposer, "runner", None) else [])

    def _graph_refusal(self) -> str | None:
        """Why decode steps and speculative rounds will run eagerly (None: they are captured in CUDA graphs)."""
        for runner in self._runners():  # first, so that CPU runs exercise it too
            spec = runner.attention_specs[0]
            refusal = runner.attn_backend.graph_refusal(self.cfg.page_size, self.dtype, spec.head_dim)
            if refusal is not None:
                return f"{refusal} (use triton, or flashinfer with XQA on sm90+ and verify_attention_mode=decode)"
        if self.device.type != "cuda":
            return "not on a CUDA device"
        if self.cfg.disable_cuda_graph:
            return "disable_cuda_graph is set"
        return None

    def _fold_norm_weights(self) -> None:
        """On GPUs with 16-bit weights, each decoder layer's norm weights go into the projections after them
        (``LlamaForCausalLM.fold_norms``), with or without CUDA graphs, so that eager and graph runs use the same
        weights; forwards that can (``fuses_norms``) then run the norms inside the linears."""
        for model in (runner.model for runner in self._runners()):
            if (hasattr(model, "fold_norms") and self.device.type == "cuda"
                    and next(model.parameters()).dtype in (torch.float16, torch.bfloat16)):
                model.fold_norms()

    def _tune_small_m_linears(self) -> None:
        """Time the small-M linear kernel against cuBLAS for every layer and row bucket, once, before the KV cache
        takes the memory. Only for graph runs: eagerly, Triton's Python launch cost outweighs what it saves. A draft
        replicated on every TP rank keeps cuBLAS, so that all ranks run the very same kernels and draft the same
        tokens (each rank's own timing could pick a different kernel, whose rounding differs). Choices are kept in
        the tuning cache (``EngineConfig.tuning_cache_dir``): later starts read them, run the same kernels, and so
        give the same tokens."""
        from workers.kernels.tuning import (
            TuningCache,
            tune_small_m_linears,
            tuning_environment,
        )

        models = [self.target.model]
        runner = getattr(self.proposer, "runner", None)
        if runner is not None and not (self.tp.size > 1 and self.draft_tp.size == 1):
            models.append(runner.model)
        cache_dir = self.cfg.resolved_tuning_cache_dir()
        cache = (TuningCache(os.path.join(cache_dir, "small_m_linear.json"), tuning_environment(self.device))
                 if cache_dir else None)
        self.tuning_cache = cache
        t0 = time.perf_counter()
        timed = sum(tune_small_m_linears(m, cache) for m in models)
        torch.cuda.empty_cache()  # the timing buffers must not count as used when the KV cache is sized
        if cache is not None:
            cache.save()
        logger.info("small-M linear kernels: %d (shape, rows) pairs timed in %.1fs%s", timed,
                    time.perf_counter() - t0, f" (the others from {cache.path})" if cache is not None else "")

    # ---- CUDA graphs -----------------------------------------------------------------------------------------
    def _graph_callables(self, bucket: int, kind: str, top: bool) -> dict[str, object]:
        """What one bucket captures: name → callable over the static inputs, in replay order; the last returns the
        step's outputs packed for the host (``PackedOutputs``; ``top``: with each token's top logprobs)."""
        if self.proposer is None:
            return {"decode": lambda: PackedOutputs.pack(*self._decode(self._static_inputs(bucket, kind), top))}
        if self.cfg.fuse_speculative_round:
            return {"round": lambda: PackedOutputs.pack(*self._round(self._static_inputs(bucket, kind), top))}
        state: dict = {}  # tensors the phases hand to each other (outputs of the previous phase's graph)

        def draft():
            state["inp"] = inp = self._static_inputs(bucket, kind)
            state["tree"] = self.proposer.propose(inp)

        def verify():
            state["verified"] = self._verify(state["inp"], state["tree"], top)

        return {"draft": draft, "verify": verify,
                "draft_extend": lambda: PackedOutputs.pack(*self._finish_round(state["inp"], state["tree"],
                                                                                *state["verified"]))}

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the greedy graphs of every bucket now (largest first, so smaller graphs reuse its pool memory);
        the sampling variants of a bucket ("sample": temperatures only; "filter": with the top-k/top-p sort, which
        needs much more memory) and the variants with top logprobs on their first use."""
        from tqdm import tqdm

        buckets = batch_buckets(min(self.cfg.cuda_graph_max_bs, self.cfg.max_num_seqs))
        draft_cols = self.proposer.num_steps if self.proposer is not None else 0
        self.static = StaticInputs(buckets[-1], draft_cols, self.pad_slot, self.device)
        self.graphs = GraphRunner(self.device)
        self.graph_phases.clear()
        self.norm_fusion.clear()
        self.graph_buckets = buckets
        for bucket in tqdm(list(reversed(buckets)), desc="capturing CUDA graphs", disable=self.rank != 0):
            self._capture(bucket, "greedy", top=False)
        if self.tuning_cache is not None:
            self.tuning_cache.save()

    def _capture(self, bucket: int, kind: str, top: bool) -> None:
        """Capture one bucket's graphs on padding rows (a capture runs its callables three times). Where its
        forwards can run the norms inside the linears (``_norm_fusion_open``), the bucket's first capture takes
        them both ways and keeps the faster (``_capture_faster_fusion``); its later captures follow that choice."""
        if bucket not in self.norm_fusion and self._norm_fusion_open(bucket):
            self.norm_fusion[bucket] = self._capture_faster_fusion(bucket, kind, top)
        else:
            self._capture_phases(bucket, kind, top, self.norm_fusion.get(bucket, True))

    def _capture_phases(self, bucket: int, kind: str, top: bool, fused: bool, variant: tuple = ()) -> list[tuple]:
        """Capture the bucket's phases under their graph keys (plus ``variant``), their forwards running the norms
        inside the linears where they can if ``fused``; returns the keys in order."""
        self.static.reset()
        phases = self._graph_callables(bucket, kind, top)
        keys = [(name, bucket, kind, top) + variant for name in phases]
        for key, fn in zip(keys, phases.values()):
            self.graphs.capture(key, self._norms_in_linears(fused)(fn))  # (on a CPU the callable runs each time)
        self.graph_phases[(bucket, kind, top)] = list(phases)
        return keys

    def _folded_models(self) -> list[torch.nn.Module]:
        return [runner.model for runner in self._runners() if getattr(runner.model, "norms_folded", False)]

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

    def _norm_fusion_key(self, bucket: int) -> str:
        """The tuning cache's key of a bucket's fusion choice: what its graphs run (model shapes, speculation, TP)."""
        shapes = [(m.cfg.architecture, m.cfg.hidden_size, m.cfg.intermediate_size, m.cfg.num_layers,
                   m.cfg.num_heads, m.cfg.num_kv_heads, m.cfg.head_dim, m.cfg.vocab_size)
                  for m in self._folded_models()]
        spec = self.cfg.speculative_config
        spec_key = None if spec is None else (spec.method, spec.num_steps, spec.topk, spec.num_draft_tokens,
                                              self.cfg.fuse_speculative_round)
        return f"norms in linears | {shapes} | {spec_key} | {self.dtype} | tp {self.tp.size} | bucket {bucket}"

    def _capture_faster_fusion(self, bucket: int, kind: str, top: bool) -> bool:
        """Capture the bucket's graphs with the norms inside the linears and with the norm kernels, time their
        replays (alternating, NORM_FUSION_PASSES rounds of NORM_FUSION_REPLAYS, the median), keep the faster and
        return whether it fuses. The fused graphs are kept unless the others are NORM_FUSION_MARGIN faster; a
        choice in the tuning cache is taken without timing, so that later starts run the same kernels.
        (Measured: at the 8B shape the fused bs=1 step is 1.4% faster, at the 1B shape 4% slower:
        bench/results/norms_in_linears_landed_h100.md.)"""
        key = self._norm_fusion_key(bucket)
        cached = self.tuning_cache.get_choice(key) if self.tuning_cache is not None else None
        if self.tp.size > 1:  # every rank takes the same path, and times (replays all-reduces) or none does
            has, value = self.tp.all_reduce_host([cached is not None, bool(cached)], op=dist.ReduceOp.MIN)
            cached = bool(value) if has else None
        if cached is not None:
            self._capture_phases(bucket, kind, top, cached)
            return cached
        keys = {fused: self._capture_phases(bucket, kind, top, fused, variant=(fused,)) for fused in (True, False)}
        self.graphs.replay_ms(keys[True] + keys[False], 2)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(NORM_FUSION_PASSES):
            for fused in (True, False):
                times[fused].append(self.graphs.replay_ms(keys[fused], NORM_FUSION_REPLAYS))
        fused_ms, plain_ms = (sorted(times[f])[len(times[f]) // 2] for f in (True, False))
        fused_ms, plain_ms = (t / self.tp.size for t in self.tp.all_reduce_host([fused_ms, plain_ms]))  # the mean
        fused = plain_ms > fused_ms * (1 - NORM_FUSION_MARGIN)
        self.graphs.keep(keys[fused], [k[:-1] for k in keys[fused]], drop=keys[not fused])
        if self.tuning_cache is not None:
            self.tuning_cache.put_choice(key, fused)
        logger.info("bucket %d: norms %s the linears (graph replays %.3f ms fused, %.3f ms with norm kernels)",
                    bucket, "inside" if fused else "outside", fused_ms, plain_ms)
        return fused

    # ---- steps -----------------------------------------------------------------------------------------------
    def _apply_pages(self, step: WorkerStep) -> None:
        if step.page_updates[0]:  # (most DECODE steps grant no page) one host→device copy for the three columns
            slots, pos, ids = to_device(step.page_updates, torch.int64, self.device).unbind(0)
            self.page_table.apply(slots, pos, ids)

    def _sampling(self, step: WorkerStep, counters: list[int] | None = None) -> SamplingTensors:
        return SamplingTensors.from_lists(step.temperature, step.top_k, step.top_p, step.min_p, step.seeds,
                                          step.counters if counters is None else counters, self.device)

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
                    # the page grants first: a step planned after this one counts on them even if this one fails
                    self._apply_pages(step)
                    copy, finish = self._launch(step)
                self._launched.append(_Launched(step.step_id, copy, finish, time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - this step's requests fail; those before and after it go on
                logger.exception("worker step failed")
                self._launched.append(_Launched(step.step_id, None, None, time.perf_counter() - t0,
                                                error=f"{type(e).__name__}: {e}"))
        results = []
        while len(self._launched) > keep:
            results.append(self._launched.popleft().result())
        return results

    def execute(self, step: WorkerStep) -> StepResult:
        """One step, waited for (tools and benchmarks); raises RuntimeError if it failed."""
        if self._launched:
            raise RuntimeError("execute() with overlapped steps still in flight")
        (result,) = self.step(step, keep=0)
        if result.error is not None:
            raise RuntimeError(result.error)
        return result

    def _launch(self, step: WorkerStep) -> tuple[HostCopy, Callable[[list[list]], StepResult]]:
        if step.mode == ForwardMode.DECODE:
            return self._launch_decode(step)
        fb = self.target.new_batch(step.mode, step.input_ids, step.req_slots, step.seq_lens, step.extend_lens,
                                   page_table=self.page_table)
        sampling = self._sampling(step)
        hidden = self.target.forward(fb)
        logits = self.target.logits(hidden[fb.logits_indices])
        ids, logprobs = sample(logits, sampling)
        self.last_token[fb.req_slots] = ids  # what the next DECODE feeds (a non-final chunk's is overwritten later)
        if self.proposer is not None:  # prefill: the draft catches up on the same tokens
            self.proposer.after_extend(step, fb, self._features(fb, hidden), ids)
        top = top_logprobs(logits, TOP_LOGPROBS) if step.top_logprobs else ()
        return HostCopy(PackedOutputs.pack(ids, logprobs, *top)), _token_result

    def _features(self, fb, hidden: torch.Tensor) -> torch.Tensor:
        fn = getattr(self.proposer, "target_features", None)
        return fn(fb, hidden) if fn else hidden

    # ---- DECODE: a plain step or a speculative round, eager or replayed from a CUDA graph -----------------------
    def _launch_decode(self, step: WorkerStep) -> tuple[HostCopy, Callable[[list[list]], StepResult]]:
        b = len(step.req_slots)
        kind, top = sampling_kind(step.temperature, step.top_k, step.top_p, step.min_p), step.top_logprobs
        bucket = next((x for x in self.graph_buckets if x >= b), None)  # None: no graphs, or a larger batch
        if bucket is None:
            inp = self._eager_inputs(step)
            out = self._decode(inp, top) if self.proposer is None else self._round(inp, top)
            packed = PackedOutputs.pack(*out)
        else:
            if (bucket, kind, top) not in self.graph_phases:
                self._capture(bucket, kind, top)
            self.static.fill(step, bucket)
            for name in self.graph_phases[(bucket, kind, top)]:  # the last phase returns the packed outputs
                out = self.graphs.replay((name, bucket, kind, top))
            packed = out.rows(b)
        # copied now: the next replay overwrites a graph's outputs
        return HostCopy(packed), (_token_result if self.proposer is None else self._round_result)

    def _round_result(self, lists: list[list]) -> StepResult:
        accept, tokens, logprobs, *top = lists
        accept = [int(a) for a in accept]
        d = self.proposer.tree_size
        res = StepResult(
            tokens=[[int(x) for x in t[: a + 1]] for t, a in zip(tokens, accept)],
            logprobs=[lp[: a + 1] for lp, a in zip(logprobs, accept)],
            spec=[(d - 1, list(range(a))) for a in accept],
        )
        if top:  # [B, S+1, K] ids and logprobs, each request's row flattened by the copy
            res.top_logprobs = []
            for t, ti, tv, a in zip(tokens, *top, accept):
                k = len(ti) // len(t)
                res.top_logprobs.append([list(zip(map(int, ti[j * k:(j + 1) * k]), tv[j * k:(j + 1) * k]))
                                         for j in range(a + 1)])
        return res

    def _eager_inputs(self, step: WorkerStep) -> RoundInputs:
        slots = to_device(step.req_slots, torch.int64, self.device)
        seq_lens, counters = list(step.seq_lens), list(step.counters)
        if step.pending and any(step.pending):  # eager rounds need host lengths: wait for the step in flight
            ahead = [1] * len(seq_lens) if self.proposer is None else self.advance[slots].tolist()
            seq_lens = [s + p * a for s, p, a in zip(seq_lens, step.pending, ahead)]
            counters = [c + p * a for c, p, a in zip(counters, step.pending, ahead)]
        seq = to_device(seq_lens, torch.int64, self.device)
        drafts = to_device(step.draft_tokens, torch.int64, self.device) if step.draft_tokens is not None else None
        return RoundInputs(root=self.last_token[slots], req_slots=slots, seq_lens=seq_lens,
                           root_pos=seq - 1, sampling=self._sampling(step, counters), drafts=drafts)

    def _static_inputs(self, bucket: int, kind: str) -> RoundInputs:
        st = self.static
        slots = st.column("req_slots", bucket)
        # what the step in flight appends (overlap) moves lengths and counters ahead: one kernel on the GPU
        seq, root, root_pos, counters = overlap_step_inputs(
            slots, st.column("pending", bucket), st.column("seq_lens", bucket), st.column("counters", bucket),
            self.advance, self.last_token)
        return RoundInputs(root=root, req_slots=slots, seq_lens=seq, root_pos=root_pos,
                           sampling=st.sampling(bucket, kind, counters),
                           drafts=st.drafts(bucket) if self.proposer is not None else None)

    def _decode(self, inp, top: bool = False) -> tuple[torch.Tensor, ...]:
        """One DECODE forward and sampling: (ids [B], logprobs [B]), and with ``top`` the TOP_LOGPROBS most likely
        tokens' (ids [B, K], logprobs [B, K])."""
        fb = self.target.new_batch(ForwardMode.DECODE, inp.root, inp.req_slots, inp.seq_lens, [1] * inp.batch_size,
                                   page_table=self.page_table, positions=inp.root_pos)
        hidden = self.target.forward(fb)
        logits = self.target.logits(fb.logits_rows(hidden))
        ids, logprobs = sample(logits, inp.sampling)
        self.last_token[inp.req_slots] = ids
        return (ids, logprobs, *top_logprobs(logits, TOP_LOGPROBS)) if top else (ids, logprobs)

    def _round(self, inp, top: bool = False) -> tuple[torch.Tensor, ...]:
        """draft → TARGET_VERIFY → accept → compact accepted KV → draft catch-up; nothing leaves the device.
        Returns (accept_len [B], out_tokens [B, S+1], out_logprobs [B, S+1]), and with ``top`` the TOP_LOGPROBS
        most likely tokens at each emitted position (ids [B, S+1, K], logprobs [B, S+1, K])."""
        tree = self.proposer.propose(inp)
        return self._finish_round(inp, tree, *self._verify(inp, tree, top))

    def _verify(self, inp, tree, top: bool = False):
        from speculative.verify import simulated_acceptance, verify_tree

        b, d, m = inp.batch_size, tree.num_nodes, inp.root_pos
        # the nodes at m .. m+D-1, RoPE at the root's position + depth (a chain's: its storage positions)
        fb = self.target.new_batch(
            ForwardMode.TARGET_VERIFY, tree.tokens.reshape(-1), inp.req_slots, inp.seq_lens, [d] * b,
            page_table=self.page_table, seq_offset=d - 1, all_logits=True, tree_mask=tree.mask,
            positions=None if tree.is_chain else (m.unsqueeze(1) + tree.depths).reshape(-1),
        )
        hidden = self.target.forward(fb)
        logits = self.target.logits(hidden).view(b, d, -1)
        simulated = self.cfg.speculative_config.simulated_accept_length
        if simulated is None:
            verdict = verify_tree(tree, logits, inp.sampling, self.proposer.max_depth)
        else:
            verdict = simulated_acceptance(tree, logits, inp.sampling, self.proposer.max_depth, simulated)
        if self.proposer.topk > 1:  # tree: accepted nodes move to positions m, m+1, ... (a chain already is there)
            depth = torch.arange(verdict.path.shape[1], device=self.device)
            slots = inp.req_slots.unsqueeze(1).expand_as(verdict.path)
            src = self.page_table.slots(slots, m.unsqueeze(1) + verdict.path)
            dst = self.page_table.slots(slots, m.unsqueeze(1) + depth)
            keep = depth.unsqueeze(0) <= verdict.accept_len.unsqueeze(1)
            self.target.kv_cache.move(torch.where(keep, src, dst).reshape(-1), dst.reshape(-1))
        alternatives = None
        if top:  # at each emitted token's position: the node whose logits chose it (verdict.path)
            ids, lps = top_logprobs(logits, TOP_LOGPROBS)  # [B, D, K]
            at = verdict.path.unsqueeze(2).expand(-1, -1, ids.shape[2])
            alternatives = (ids.gather(1, at), lps.gather(1, at))
        return verdict, self._features(fb, hidden), alternatives

    def _finish_round(self, inp, tree, verdict, features, alternatives=None):
        self.proposer.after_verify(inp, tree, verdict, features)
        # the next round's root: the last token this one emits (the bonus token after the accepted drafts)
        record_round(inp.req_slots, verdict.accept_len, verdict.out_tokens, self.last_token, self.advance)
        outputs = (verdict.accept_len, verdict.out_tokens, verdict.out_logprobs)
        return outputs + alternatives if alternatives is not None else outputs

    def shutdown(self) -> None:
        self._on_device()
        self.graphs = None  # captured graphs hold NCCL kernels: release them before the communicator
        if self.tp.custom_all_reduce is not None:
            self.tp.custom_all_reduce.close()
        if self.tp.nccl is not None:
            self.tp.nccl.close()
        if self.tp.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
