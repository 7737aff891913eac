"""The engine: tokenizer + scheduler + workers. Used offline (``specserve generate``, tests, benchmarks) and by the
controller actor, which drives ``step()`` in its loop.

Executors hide where the workers live: ``LocalExecutor`` runs rank 0 in this process; the Ray executor
(deployments/engine/executor.py) drives one actor per TP rank.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import replace
from typing import Protocol

import numpy as np

from deployments.engine import freeze_startup_heap, grammar  # noqa: F401 - (freeze_startup_heap: re-exported)
from deployments.engine.pages import PageAllocator
from deployments.engine.prefix_cache import PrefixCache
from deployments.engine.request import (
    Completion,
    InvalidRequest,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from deployments.engine.scheduler import Scheduler, StepPlan
from deployments.engine.tokenizer import Detokenizer, detokenize_run, load_tokenizer
from speculative.adaptive import DepthChooser
from workers.config import EngineConfig
from workers.messages import ForwardMode, StepResult, WorkerStep
from workers.worker import Worker

logger = logging.getLogger("specserve")


class Executor(Protocol):
    model_config: object
    max_model_len: int
    lookahead: int
    max_advance: int
    decode_graphs: bool  # DECODE steps replay CUDA graphs (else they run eagerly)
    depth_costs: dict | None  # adaptive speculation: ms of a step per batch bucket and draft depth (None: off)
    context_costs: dict | None  # and per bucket and depth, ms per token of the batch's context

    def step(self, step: WorkerStep | None, keep: int) -> list[StepResult]:
        """Launch ``step`` on every rank; rank 0's results of the oldest launched steps until ``keep`` are left."""

    def shutdown(self) -> None: ...


class LocalExecutor:
    """A single in-process worker (TP = 1)."""

    failure: str | None = None  # why it can run no more steps (an exception escaped the worker's step), else None

    def __init__(self, cfg: EngineConfig):
        if cfg.tensor_parallel_size != 1:
            raise ValueError("LocalExecutor runs TP=1; use the Ray executor for tensor_parallel_size > 1")
        self.worker = Worker(cfg)
        self.model_config = self.worker.model_config
        self.max_model_len = self.worker.max_model_len
        self.lookahead = self.worker.lookahead
        self.max_advance = self.worker.max_advance
        self.decode_graphs = self.worker.graph_refusal is None
        self.num_pages = self.worker.kv_capacity_pages()
        # adaptive speculation's cost model (ms per batch bucket and draft depth; per token of context), or None
        self.depth_costs, self.context_costs = self.worker.allocate_kv(self.num_pages) or (None, None)

    def step(self, step: WorkerStep | None, keep: int) -> list[StepResult]:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        try:
            return self.worker.step(step, keep)
        except Exception as e:
            # (a step's own errors come back in its results): what escaped leaves the worker in an unknown state
            self.failure = f"the in-process worker failed: {type(e).__name__}"
            raise

    def compile_stats(self) -> dict | None:
        """The in-process worker's Triton compiles after its start-up (each a stall inside a step), or None."""
        return self.worker.compile_stats()

    def shutdown(self) -> None:
        self.worker.shutdown()


class Engine:
    def __init__(self, cfg: EngineConfig, executor: Executor | None = None, metrics=None, detokenize: bool = True):
        self.cfg = cfg
        self.metrics = metrics  # deployments.engine.metrics.EngineMetrics (step and load figures), or None offline
        # offline the engine detokenizes and ends requests on stop strings itself; served, the ingress does both
        # (its replicas hold the tokenizer) and the engine deals in token ids only
        self.detokenize = detokenize
        self.executor = executor or LocalExecutor(cfg)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        mc = self.executor.model_config
        self.max_model_len = self.executor.max_model_len
        self.sampling_defaults = dict(mc.sampling_defaults)  # the HTTP API's defaults for unset sampling fields
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        spec = cfg.speculative_config
        # an EAGLE head's KV at a page's last slot depends on the token after the page: the cache keys on it too
        cache = PrefixCache(cfg.page_size, key_next_token=spec is not None and spec.method in (
            "eagle", "eagle3", "naive")) if cfg.enable_prefix_caching else None
        self.allocator = PageAllocator(self.executor.num_pages, cfg.page_size, cache)
        host_drafter = None
        if spec is not None and spec.method == "ngram":
            from speculative.proposers import propose_ngram

            def host_drafter(tokens: list[int]) -> list[int]:
                return propose_ngram(tokens, spec.num_steps, spec.ngram_min, spec.ngram_max)

        # overlap (SGLang's overlap scheduler): the next DECODE step (or speculative round) is launched before the
        # previous one's tokens are read, so the host's work (reading tokens, detokenizing, planning) hides behind
        # the device's. Host-drafted n-grams need the tokens first: those rounds run one at a time.
        self.overlap = not cfg.disable_overlap_schedule and host_drafter is None
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=cfg.max_num_seqs,
            max_prefill_tokens=cfg.max_prefill_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(sorted(eos)),
            vocab_size=mc.vocab_size,
            decode_lookahead=self.executor.lookahead,
            decode_max_advance=self.executor.max_advance,
            max_queue_len=cfg.max_queue_len,
            host_drafter=host_drafter,
            mixed_decode_rows=self._mixed_decode_rows(cfg, self.executor),
            draft_catch_up_window=spec.catch_up_window if spec is not None and spec.method != "ngram" else 0,
            delay_factor=cfg.scheduler_delay_factor,
            overlap=int(self.overlap),
        )
        # adaptive speculation: the policy choosing each speculative step's draft depth (None: num_steps). Tests
        # and benchmarks may replace it (``speculative.adaptive.DepthSchedule``)
        self.depth_policy = None
        costs = getattr(self.executor, "depth_costs", None)
        if spec is not None and costs:
            self.depth_policy = DepthChooser(costs, spec.num_steps, pause_after=spec.pause_draft_after,
                                             context_costs=getattr(self.executor, "context_costs", None))
        self.steps_by_depth: dict[int, int] = {}  # speculative steps applied, by draft depth (0: plain steps)
        # the draft's pause (``DepthPolicy.paused``): whether the last decode step ran paused, whether any request
        # has ever run paused (its verdicts are then sorted out of the chooser's), the paused steps launched
        self._draft_paused = False
        self._draft_holes = False
        self.paused_steps = 0
        # the depth policy's host clock (``DepthPolicy.launched``), where decode steps replay CUDA graphs (the cost
        # table then times the device alone; eager, it times the calls, host included): whether the last launch
        # was a decode step it chose, the seconds the host has waited for the device since, and the collections of
        # GC generation 1 so far (one since the last launch: a pause that is not the step's cost)
        self.host_clock = bool(getattr(self.executor, "decode_graphs", False))
        self._decode_launched = False
        # whether a decode step may be in flight: if not, the requests' landed draft lags are the worker's, and the
        # depth policy's count of plain steps is set from them (``DepthPolicy.sync_lag``)
        self._decode_in_flight = False
        self._waited = 0.0
        self._gc_gen1 = gc.get_count()[2]
        self._detok: dict[str, Detokenizer] = {}
        self._eos = sorted(eos)
        self._grammar: grammar.GrammarEngine | None = None  # built on the first structured-output request
        self._grammar_lock = threading.Lock()  # (requests are validated on the core's submitting thread)
        self.in_flight: deque[tuple[int, StepPlan]] = deque()  # (step id, plan) launched, results unread, oldest first
        self._step_ids = itertools.count(1)
        self.num_steps = 0
        # host time of every step, cumulative (served at /v1/stats)
        self.step_time = {"steps": 0, "schedule_s": 0.0, "execute_s": 0.0, "worker_s": 0.0, "outputs_s": 0.0,
                          "grammar_s": 0.0, "extend_steps": 0,  # (extend_steps: how many pieces arrivals came in)
                          "wait_s": 0.0, "extend_wall_s": 0.0}  # (the host's waits for the device; prefill steps' wall)
        # finished requests' phases (``Request.phases``), summed: where a request's time went, served at /v1/stats
        self.request_phases: dict = {"requests": 0}

    @staticmethod
    def _mixed_decode_rows(cfg: EngineConfig, executor: Executor) -> int:
        """Where DECODE steps run eagerly, a mixed step saves a whole forward; where they replay CUDA graphs, it
        trades a graph replay for eager rows in the prefill's forward, which is off until measured on a GPU."""
        if cfg.mixed_decode_rows is not None:
            return cfg.mixed_decode_rows
        return 0 if getattr(executor, "decode_graphs", True) else cfg.max_num_seqs

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, rid: str | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue. Raises InvalidRequest (bad input) or OverflowError (queue full); nothing else changes."""
        req = self.new_request(prompt, params, rid, arrival_time)
        self.enqueue(req)
        return req

    def new_request(self, prompt: str | list[int], params: SamplingParams | None = None, rid: str | None = None,
                    arrival_time: float | None = None, queued: int = 0) -> Request:
        """A validated request, not queued yet. Reads no state that a step changes (the queue length is only
        compared, with ``queued`` requests accepted but not queued yet), so the engine core calls it from its submitting
        thread while a step runs."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids")
        if params.max_tokens is None:  # up to the end of the context, or of what the KV cache can ever hold
            cache_tokens = self.allocator.capacity_pages * self.cfg.page_size - self.executor.lookahead
            params = replace(params, max_tokens=max(1, min(self.max_model_len, cache_tokens) - len(prompt_ids)))
        req = Request(rid=rid or uuid.uuid4().hex, prompt_ids=prompt_ids, params=params)
        if params.guided is not None:
            req.matcher = self.grammar_engine().matcher(params.guided)
        if arrival_time is not None:  # when the server received it (TTFT and end-to-end latency start there)
            req.arrival_time = arrival_time
        self.scheduler.check(req, queued)
        return req

    def grammar_engine(self) -> grammar.GrammarEngine:
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = grammar.GrammarEngine(self.tokenizer, self.executor.model_config.vocab_size,
                                                      self._eos)
            return self._grammar

    def enqueue(self, req: Request) -> None:
        """Queue a request from ``new_request`` (on the thread that steps)."""
        req.queued_time = time.time()
        self.scheduler.add(req)
        if self.detokenize:
            self._detok[req.rid] = Detokenizer(self.tokenizer, req.params.stop, min_tokens=req.params.min_tokens)

    def abort(self, rid: str) -> bool:
        req = self.scheduler.abort(rid)
        self._drop_detokenizer(rid, req)
        if req is not None and self.metrics is not None:
            self.metrics.record_load(self.step_stats())
        return req is not None

    @property
    def failure(self) -> str | None:
        """Why the workers can no longer run steps (a Ray executor's ``WorkersFailed``), else None."""
        return getattr(self.executor, "failure", None)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.in_flight)

    # ---- stepping --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and launch one step, and return an output for every request that got tokens or finished. With
        overlap, a DECODE step's tokens come back from the next call (each call still reads one step's results)."""
        outputs: list[RequestOutput] = []
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        for req in self.scheduler.failed:
            outputs.append(self._failed_output(req))
        self.scheduler.failed.clear()
        if plan is None and not self.in_flight:
            self._decode_launched = False  # (idle: the next launch's interval is no step's cost)
            return outputs
        if plan is None:  # (the steps in flight are read now)
            self._decode_in_flight = False
        # a prefill overlaps too: the scheduler counts its chunks as done when it plans them, and the next step reads
        # a completed prompt's first token on the device
        keep = 1 if self.overlap and plan is not None else 0
        step = None
        if plan is not None:
            step = plan.to_worker_step()
            step.step_id = next(self._step_ids)
            self.in_flight.append((step.step_id, plan))
            if plan.mode == ForwardMode.EXTEND:
                self.step_time["extend_steps"] += 1
                now = time.time()
                for req in plan.requests:  # (a prefill's first plan ends its queue time)
                    if req.scheduled_time is None:
                        req.scheduled_time = now
                if self._draft_paused:  # (the paused steps it joins leave holes in its draft KV)
                    for req in plan.requests:
                        req.draft_holes = True
            # (no pass over the batch until a structured-output request has been seen)
            guided = self._grammar is not None and any(r.matcher is not None for r in plan.requests)
            if self.depth_policy is not None and plan.mode == ForwardMode.DECODE:
                policy = self.depth_policy
                if guided:  # (a full round whatever is chosen: it ends a pause, and begins none, whose steps are
                    policy.unpause()  # no chosen steps, while this one sends verdicts)
                if not self._decode_in_flight and not policy.paused:  # (a new batch's requests have no lag: the
                    policy.sync_lag(max(r.draft_lag for r in plan.requests))  # policy's count may be old)
                # (the context each row's step reads: a round's share of a step shrinks as the batch's KV grows)
                step.spec_depth = policy.choose(step.batch_size, int(step.seq_lens.sum()))
                paused = policy.paused  # (never on a structured-output step: unpaused above)
                if paused != self._draft_paused:
                    self._pause_draft(paused)
                if paused:
                    step.draft_paused = plan.draft_paused = True
                    self.paused_steps += 1
            self._decode_in_flight = bool(keep) and plan.mode == ForwardMode.DECODE
            if guided:
                self._decode_launched = False
                if self.depth_policy is not None and plan.mode == ForwardMode.DECODE:
                    self.depth_policy.sync_lag(0)  # (a full round whatever was chosen: the draft caught up)
                return outputs + self._guided_step(plan, step, keep, t0)  # (its rounds run at full depth)
            if step.spec_depth >= 0:  # a plain step appends one token, a round of depth d at most d + 1
                plan.max_advance = step.spec_depth + 1
        t1 = time.perf_counter()
        if self.depth_policy is not None and self.host_clock:  # (a paused step is no chosen step: not timed)
            self._launching(t1, plan is not None and plan.mode == ForwardMode.DECODE and not plan.draft_paused)
        try:
            results = self.executor.step(step, keep)
        except Exception as e:  # noqa: BLE001 - the workers are unreachable: every launched step fails
            return outputs + self._workers_failed(e)
        t2 = time.perf_counter()
        for r in results:  # (the host's waits for the device since this launch: not host work)
            self._waited += r.timings.get("wait_s", 0.0)
        outputs += self._read(results)
        self._count_step_time(t0, t1, t2, results, plan is not None and plan.mode == ForwardMode.EXTEND)
        return outputs

    def _pause_draft(self, paused: bool) -> None:
        """The draft's pause begins (``paused``) or ends. As it begins, the worker drops every request's pending
        draft inputs: the running requests' draft KV will have holes, and they count no draft lag (the plain step
        in flight, read later, may still add its one: above the worker's count, which is safe)."""
        self._draft_paused = paused
        if paused:
            self._draft_holes = True
            for req in self.scheduler.running:
                req.draft_holes, req.draft_lag = True, 0

    def _launching(self, now: float, decode: bool) -> None:
        """Tell the depth policy a decode step it chose is being launched (its host-time samples: the intervals
        between such launches less the waits for the device; none across a prefill, an idle loop or a collection of
        the older GC generations, whose pause is no step's cost)."""
        if decode:
            gen1 = gc.get_count()[2]
            self.depth_policy.launched(now, self._waited, self._decode_launched and gen1 == self._gc_gen1)
            self._gc_gen1 = gen1
        self._decode_launched = decode
        self._waited = 0.0

    def _workers_failed(self, e: Exception) -> list[RequestOutput]:
        if self.failure is not None and str(e) == self.failure:  # the executor logged why: no trace again
            logger.error("step failed: the workers failed (%s)", self.failure)
        else:
            logger.exception("step failed")
        return self._fail_in_flight(f"{type(e).__name__}: {e}")

    def _count_step_time(self, t0: float, t1: float, t2: float, results: list[StepResult],
                         extend: bool = False) -> None:
        st = self.step_time
        st["steps"] += 1
        st["schedule_s"] += t1 - t0
        st["execute_s"] += t2 - t1
        # rank 0's own time: execute minus this is transport (and, overlapped, waiting)
        st["worker_s"] += sum(r.timings.get("worker_s", 0.0) for r in results)
        st["wait_s"] += sum(r.timings.get("wait_s", 0.0) for r in results)
        end = time.perf_counter()
        st["outputs_s"] += end - t2
        if extend:
            st["extend_wall_s"] += end - t0

    def _read(self, results: list[StepResult]) -> list[RequestOutput]:
        """Apply the results of the oldest steps in flight, in order."""
        outputs: list[RequestOutput] = []
        for result in results:
            step_id, done = self.in_flight.popleft()
            if result.step_id != step_id:  # the workers' queue and ours disagree: no result can be placed
                logger.error("the workers returned step %d's result for step %d", result.step_id, step_id)
                self.in_flight.appendleft((step_id, done))
                outputs += self._fail_in_flight(f"the workers answered step {step_id} with step {result.step_id}")
                break
            if result.error is not None:
                outputs += self._fail_plan(done, result.error)
            else:
                self.num_steps += 1
                outputs += self._apply(done, result)
        return outputs

    def _guided_step(self, plan: StepPlan, step: WorkerStep, keep: int, t0: float) -> list[RequestOutput]:
        """Launch a step with structured-output requests (already in flight on the host) and read what is due.

        A step whose masks are known now (every grammar request's tokens on the host; no drafts to mask) carries them
        and overlaps as any step. Otherwise the step is launched up to its logits (``mask_follows``): a round also
        drafts, returning the drafts, and runs the target's verify forward. The older steps' results are read and
        applied (the matchers advance), the masks computed on the host while the device runs that forward, and sent
        (``WorkerStep.mask_message``); the step then samples / verifies and stays in flight under overlap, as vLLM's
        async scheduling does with structured outputs (its bitmask computed while the forward runs)."""
        matchers = [r.matcher for r in plan.requests]
        words = grammar.mask_words(self.executor.model_config.vocab_size)
        st = self.step_time
        spec = self.cfg.speculative_config is not None and plan.mode == ForwardMode.DECODE
        nxt = plan.next_ids
        # a grammar request whose newest tokens are still in flight (this plan's own sampling counts one)
        stale = any(m is not None and r.num_inflight > (1 if nxt is None or nxt[i] < 0 else 0)
                    for i, (r, m) in enumerate(zip(plan.requests, matchers)))
        outputs: list[RequestOutput] = []
        try:
            if not spec and not stale:
                tg = time.perf_counter()
                step.token_mask = grammar.step_masks(matchers, words, self._grammar.batch)
                st["grammar_s"] += time.perf_counter() - tg
                t1 = time.perf_counter()
                results = self.executor.step(step, keep)
                t2 = time.perf_counter()
                outputs += self._read(results)
                self._count_step_time(t0, t1, t2, results)
                return outputs
            probe_id = next(self._step_ids) if spec else step.step_id
            t1 = time.perf_counter()
            results = self.executor.step(replace(step, mask_follows=True, step_id=probe_id), 0)
            proposal = results.pop() if spec and results and results[-1].step_id == probe_id else None
            t2 = time.perf_counter()
            outputs += self._read(results)  # (the older steps: this plan's requests' tokens reach their matchers)
            self._count_step_time(t0, t1, t2, results)
            if not self.in_flight or self.in_flight[-1][0] != step.step_id:  # its launch failed (read just now)
                return outputs
            if spec and (proposal is None or proposal.error is not None):
                self.in_flight.pop()
                return outputs + self._fail_plan(plan, proposal.error if proposal else "no drafts came back")
            tg = time.perf_counter()
            if spec:
                b = step.batch_size
                tokens = np.asarray(proposal.tokens, dtype=np.int64).reshape(b, -1)
                parents = np.asarray(proposal.draft_parents, dtype=np.int64).reshape(b, -1)
                mask = grammar.tree_masks(matchers, tokens, None if parents[0, 0] == -2 else parents, words,
                                          self._grammar.batch)
            else:
                mask = grammar.step_masks(matchers, words, self._grammar.batch)
            st["grammar_s"] += time.perf_counter() - tg
            results = self.executor.step(WorkerStep.mask_message(step.step_id, mask), keep)
        except Exception as e:  # noqa: BLE001 - the workers are unreachable, or the masks failed: every step fails
            return outputs + self._workers_failed(e)
        return outputs + self._read(results)

    def _apply(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """A finished step's tokens: requests, detokenizers (offline), metrics."""
        outputs = []
        now = time.time()
        detoks = self._detok
        if result.counts is not None:  # a speculative round: its depth and verdicts
            depth = result.num_drafts
            self.steps_by_depth[depth] = self.steps_by_depth.get(depth, 0) + 1
            if self.depth_policy is not None:  # (a plain step's: none accepted, without a pass over the batch)
                if not depth:
                    accepted = [0] * len(result.counts)
                elif self._draft_holes:  # (a draft with holes accepts less: its verdicts are not the draft's rate)
                    accepted = [c - 1 for c, r in zip(result.counts, plan.requests) if not r.draft_holes]
                else:
                    accepted = [c - 1 for c in result.counts]
                self.depth_policy.observe(depth, accepted)
        detokenize, finished, generated = self.detokenize, RequestStatus.FINISHED, 0
        for req, new_ids, spec in self.scheduler.update(plan, result):
            if req.matcher is not None:
                used = grammar.advance(req.matcher, new_ids)
                # the grammar is complete: the output ends here even where its stop token does not end it (ignore_eos)
                if req.matcher.is_terminated() and not req.finished:
                    if used < len(new_ids):
                        self.scheduler.drop_newest(req, len(new_ids) - used)
                        new_ids = new_ids[:used]
                    self.scheduler.finish(req, "stop")
            new_text = ""
            if detokenize:
                detok = detoks[req.rid]
                new_text, hit_stop, used = detokenize_run(detok, new_ids, req.finished,
                                                          stop_token=req.finished and req.finish_reason == "stop")
                if used < len(new_ids):  # a stop string ended it inside a speculative round's run
                    self.scheduler.drop_newest(req, len(new_ids) - used)
                    new_ids = new_ids[:used]
                if hit_stop and not req.finished:
                    self.scheduler.finish(req, "stop")
                elif hit_stop and req.finish_reason == "length":  # the stop string came with the last allowed token
                    req.finish_reason = "stop"
                if req.finished:
                    req.text = detok.text
                    del detoks[req.rid]
            if spec is not None and spec[0]:  # (a depth-0 step drafted nothing)
                self.scheduler.count_accepted(req, spec, len(new_ids))
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            n, p = len(new_ids), req.params
            generated += n
            new_logprobs = req.output_logprobs[-n:] if p.logprobs and n else []
            new_top = req.output_top_logprobs[-n:] if p.top_logprobs and n else []
            # the prompt's logprobs go with its first output (its tokens: this step's)
            first = p.prompt_logprobs is not None and len(req.output_ids) == n
            done = req.status is finished
            if done:
                self._count_phases(req)
            outputs.append(RequestOutput(req.rid, new_ids, new_text, done, req.finish_reason, req,
                                         new_logprobs, new_top, req.prompt_logprobs if first else None,
                                         req.num_cached_tokens))
        if self.metrics is not None:
            prompt_tokens = 0
            if plan.mode == ForwardMode.EXTEND:  # its prompt chunks (a mixed step's decode rows, first, have id -1)
                ids, lens = plan.input_ids, plan.extend_lens
                rows = next((i for i, t in enumerate(ids) if t != -1), len(ids))
                prompt_tokens = sum(lens) - rows
            self.metrics.record_generated(generated, prompt_tokens)
            stats = self.step_stats(result, policy=False)
            if plan.draft_paused:  # (a plain step the depth policy did not choose: counted apart)
                stats["spec_depth"] = "paused"
            self.metrics.record_step(stats)
        return outputs

    def _count_phases(self, req: Request) -> None:
        """A finished request's phases added to the totals /v1/stats serves (``request_phases``), and kept on it for
        its last output (``Request.phase_times``)."""
        phases = req.phase_times = req.phases()
        if phases is None:
            return
        totals = self.request_phases
        totals["requests"] += 1
        for name, seconds in phases.items():
            totals[name + "_s"] = totals.get(name + "_s", 0.0) + seconds

    def _fail_in_flight(self, error: str) -> list[RequestOutput]:
        """Every launched step fails; results the workers may still hold are dropped (they would be taken for a
        later step's)."""
        outputs = []
        while self.in_flight:
            outputs += self._fail_plan(self.in_flight.popleft()[1], error)
        if self.failure is not None:  # the workers are gone: nothing of theirs to drain
            return outputs
        try:
            self.executor.step(None, 0)
        except Exception:  # noqa: BLE001 - still unreachable: nothing is held there either
            logger.exception("could not drain the workers after a failed step")
        return outputs

    def _fail_plan(self, plan: StepPlan, error: str) -> list[RequestOutput]:
        """The step failed: its requests fail, their KV is freed, the engine goes on."""
        if self.depth_policy is not None and plan.mode == ForwardMode.DECODE and not plan.draft_paused:
            self.depth_policy.lost()  # (chosen, no verdicts to come: the next ones are for the steps after it)
        self.scheduler.landed(plan)
        self.scheduler.clear_prefix_cache()  # pages indexed when it was planned may hold garbage
        outputs = []
        for req in plan.requests:
            if not req.finished:
                req.error = f"the engine step failed: {error}"
                self.scheduler.finish(req, "error")
                outputs.append(self._failed_output(req))
        return outputs

    def _drop_detokenizer(self, rid: str, req: Request | None) -> None:
        """A request that ends outside a step's results keeps the text it had emitted."""
        detok = self._detok.pop(rid, None)
        if detok is not None and req is not None:
            req.text = detok.text

    def _failed_output(self, req: Request) -> RequestOutput:
        self._drop_detokenizer(req.rid, req)
        if self.metrics is not None:
            self.metrics.record_load(self.step_stats())
        return RequestOutput(req.rid, [], "", True, req.finish_reason, req)

    def step_stats(self, result: StepResult | None = None, policy: bool = True) -> dict:
        """The engine's figures (/v1/stats), with ``result`` a step's too; ``policy``: with the depth policy's
        (the metrics of every step read none of them: a speculative engine's step builds no dicts for them)."""
        # a request whose prompt is being prefilled in chunks counts as running, as in vLLM
        prefilling = self.scheduler.num_admitted_waiting
        cache = self.allocator.cache
        stats = {"running": len(self.scheduler.running) + prefilling,
                 "waiting": len(self.scheduler.waiting) - prefilling,
                 "kv_usage": self.scheduler.kv_usage, "preemptions": self.scheduler.num_preemptions,
                 "prefix_cache_queries": cache.queries if cache is not None else 0,
                 "prefix_cache_hits": cache.hits if cache is not None else 0,
                 "step_time": dict(self.step_time)}
        if result is not None and result.counts is not None:  # a speculative step (depth 0: a plain one)
            stats["spec_depth"] = result.num_drafts
        if self.cfg.speculative_config is not None and policy:
            shown = self.depth_policy.stats() if self.depth_policy is not None else {"policy": "fixed"}
            # (steps run with the draft paused are plain steps outside steps_by_depth: paused_steps)
            stats["adaptive"] = {"steps_by_depth": {str(d): n for d, n in sorted(self.steps_by_depth.items())},
                                 "paused_steps": self.paused_steps, **shown}
        if result is not None and result.counts and result.num_drafts:  # a round: rows append accepted + 1 each
            counts = result.counts
            by_count = Counter(counts)  # (per position: the rows that accepted past it, from a count per length)
            per_pos = [sum(n for c, n in by_count.items() if c - 1 > p) for p in range(max(by_count) - 1)]
            stats["spec"] = {"drafts": len(counts), "draft_tokens": result.num_drafts * len(counts),
                             "accepted": sum(counts) - len(counts), "per_pos": per_pos}
        return stats

    # ---- offline API -----------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[Completion]:
        """Run prompts to completion. Invalid prompts come back with ``error`` set; the others are unaffected."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs: list[Request | None] = []
        errors: dict[int, str] = {}
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            try:
                reqs.append(self.add_request(p, sp))
            except (InvalidRequest, OverflowError) as e:
                reqs.append(None)
                errors[i] = str(e)
        while self.has_work():
            self.step()
        out = []
        for i, req in enumerate(reqs):
            if req is None:
                out.append(Completion("", [], [], "", "error", [], error=errors[i]))
                continue
            spec = req.spec.as_dict() if self.cfg.speculative_config else None
            if spec is not None and self.cfg.speculative_config.simulated_accept_length is not None:
                spec["simulated"] = True  # the tokens are drafts forced through, not the model's output
            out.append(Completion(req.rid, req.prompt_ids, req.output_ids, req.text, req.finish_reason,
                                  req.output_logprobs, spec=spec, error=req.error,
                                  prompt_logprobs=req.prompt_logprobs, num_cached_tokens=req.num_cached_tokens))
        return out

    def shutdown(self) -> None:
        self.executor.shutdown()
