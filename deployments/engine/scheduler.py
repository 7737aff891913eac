"""Continuous-batching scheduler: admission by KV budget, chunked prefill, preemption by retract-and-recompute.

Each ``schedule()`` returns one ``StepPlan``: an EXTEND step when prompts are waiting and fit (with the running
requests' decode rows in it too, one token each, when mixing is on: one token budget for both), otherwise a DECODE
step over every running request. ``update()`` applies the worker's sampled tokens, detects token-level stops and
frees the KV of finished requests. The scheduler owns the page allocator; workers only see page grants.

Overlap: a step may be planned while the previous one still runs (its tokens unread). A plan counts as done when it
is made: prompt chunks count as computed, and a request whose prompt an EXTEND step completes is running at once,
its first token in flight like a decode's. A DECODE step appends 1 token to a request, or up to
``decode_max_advance`` with speculation, and only the device knows how many: the plan marks the request ``pending``
and the worker adds them to the host's length and sampling counter. KV pages are granted for the most it can be; a
request sits out a step that its in-flight tokens may already finish by length. Whether they ended it (EOS, a stop)
is known only when they are read: the next step has by then computed for it, and that is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from deployments.engine.pages import OutOfPages, PageAllocator
from deployments.engine.request import NEVER, InvalidRequest, Request, RequestStatus
from speculative.adaptive import lag_after_plain_step
from workers.messages import ForwardMode, LogitsSetup, StepResult, WorkerStep


@dataclass
class StepPlan:
    """One scheduled step: the requests in batch order and what each contributes."""

    mode: ForwardMode
    requests: list[Request]
    input_ids: list[int]
    seq_lens: list[int]  # KV length after the step
    extend_lens: list[int]
    page_updates: tuple[list[int], list[int], list[int]]
    counters: list[int]  # per request: tokens sampled before this step (its sampling counter)
    pending: list[int] | None = None  # DECODE: 1 where the request's previous step is in flight, whose tokens
    # seq_lens and counters leave out (the worker adds them). An EXTEND step's decode rows count them on the host
    next_ids: list[int] | None = None  # EXTEND: token after each chunk, -1 when it is the one to be sampled (a
    # chunk that ends its prompt, or a decode row: those are -1 in input_ids too, read on the device)
    draft_tokens: list[list[int]] | None = None  # DECODE with host-side drafts
    prompt_logprobs: list[int] | None = None  # EXTEND: WorkerStep.prompt_logprobs (None: no request asks)
    logits_setup: LogitsSetup | None = None  # EXTEND: the logits-processing state of the requests it starts
    # DECODE: the most tokens the step appends to a request (None: the scheduler's ``decode_max_advance``). The engine
    # lowers it once the step's draft depth is chosen: a plain step (depth 0) appends one, as without speculation,
    # so a request near its end is not held back a step as if a full round were in flight
    max_advance: int | None = None
    # DECODE: a plain step with adaptive speculation's draft paused (the step no speculation runs; no chosen depth)
    draft_paused: bool = False
    # the requests' values that stay while they run (``step_constants``), when the scheduler had them already
    constants: dict | None = None

    def to_worker_step(self) -> WorkerStep:
        """The plain-data message sent to every worker (no Request objects cross the process boundary)."""
        c = self.constants or step_constants(self.requests)
        return WorkerStep.pack(
            self.mode,
            input_ids=self.input_ids,
            seq_lens=self.seq_lens,
            extend_lens=self.extend_lens,
            page_updates=self.page_updates,
            counters=self.counters,
            pending=self.pending,
            next_ids=self.next_ids,
            draft_tokens=self.draft_tokens,
            prompt_logprobs=self.prompt_logprobs,
            logits_setup=self.logits_setup,
            **c,
        )


def step_constants(reqs: list[Request]) -> dict:
    """A step's per-request values that do not change while the requests run (slots, sampling settings, seeds), as
    ``WorkerStep.pack``'s keywords."""
    params = [r.params for r in reqs]
    return {"req_slots": [r.req_slot for r in reqs], "temperature": [p.temperature for p in params],
            "top_k": [p.top_k for p in params], "top_p": [p.top_p for p in params],
            "min_p": [p.min_p for p in params], "seeds": [r.seed for r in reqs],
            "top_logprobs": any(p.top_logprobs for p in params),
            "logits_processing": any(p.logits_processing for p in params)}


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        *,
        max_num_seqs: int,
        max_prefill_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        decode_lookahead: int = 1,
        decode_max_advance: int = 1,
        max_queue_len: int = 1 << 30,
        host_drafter=None,
        mixed_decode_rows: int = 0,
        draft_catch_up_window: int = 0,
        delay_factor: float = 0.0,
        clock=time.monotonic,
        overlap: int = 0,
    ):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.decode_lookahead = decode_lookahead  # KV slots a decode step writes per request (1, or draft tokens)
        self.decode_max_advance = decode_max_advance  # tokens a decode step appends per request at most
        self.max_queue_len = max_queue_len
        self.host_drafter = host_drafter  # tokens -> draft tokens (n-gram speculation), or None
        self.mixed_decode_rows = mixed_decode_rows  # most running requests whose decode rows prefill chunks join
        # adaptive speculation with a draft that keeps KV: the worker's stash size (0: no plain steps leave a lag)
        self.draft_catch_up_window = draft_catch_up_window
        # arrivals wait while requests run, up to this many times the last prefill step's wall (vLLM's
        # scheduler_delay_factor): a burst that reaches the engine spread over a few steps then costs one prefill
        # step, not one stall of every running request per piece
        self.delay_factor = delay_factor
        self.clock = clock
        # steps the engine leaves in flight after each plan (overlap: 1): a step's device time then falls in the
        # interval between the next two plans, not between its own plan and the next (which holds the step before)
        self.overlap = overlap
        self._prefill_wall = 0.0  # the wall of the last prefill step measured (``_measure_prefill``)
        self._prefill_age: int | None = None  # plans since that step's own, while it is measured
        self._prefill_longest = 0.0  # the longest interval between plans since it was planned
        self._last_plan = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._by_id: dict[str, Request] = {}
        self._page_updates: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.num_preemptions = 0
        # the last DECODE plan's requests and their ``step_constants``: the next plan over the same requests reuses
        # them. Dropped whenever a request lets go of its slot (``_release``), the only way its values change
        self._constants: tuple[list[Request], dict] | None = None
        self.failed: list[Request] = []  # finished with an error during scheduling; the engine reports them

    # ---- requests in and out ---------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        req.params.validate()
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        if req.params.top_k > self.vocab_size:
            req.params.top_k = 0  # keeping more tokens than the vocabulary has is no filter at all
        if req.params.logit_bias and any(t >= self.vocab_size for t in req.params.logit_bias):
            raise InvalidRequest(f"logit_bias keys must be token ids in [0, {self.vocab_size})", "logit_bias")
        if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if any(not 0 <= t < self.vocab_size for t in req.params.stop_token_ids):  # (one no step could emit)
            raise InvalidRequest(f"stop_token_ids must be token ids in [0, {self.vocab_size})", "stop_token_ids")
        if n >= self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens",
                "prompt", "context_length_exceeded")
        if req.params.max_tokens >= self.max_model_len:  # too many whatever the prompt: the parameter is at fault
            raise InvalidRequest(f"max_tokens must be less than this model's maximum context length "
                                 f"({self.max_model_len} tokens), got {req.params.max_tokens}", "max_tokens",
                                 "integer_above_max_value")
        if n + req.params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested {n} prompt "
                f"tokens + {req.params.max_tokens} max_tokens = {n + req.params.max_tokens} tokens", "prompt",
                "context_length_exceeded")
        need = self.allocator.pages_for(n + req.params.max_tokens + self.decode_lookahead)
        if need > self.allocator.capacity_pages:
            raise InvalidRequest(f"the request needs {need} KV pages but the whole cache has "
                                 f"{self.allocator.capacity_pages}; shorten the prompt or max_tokens", "prompt")

    def check(self, req: Request, queued_elsewhere: int = 0) -> None:
        """Raises InvalidRequest for bad input, OverflowError when the queue (with ``queued_elsewhere`` requests
        accepted but not added yet) is full. Changes nothing."""
        self.validate(req)
        if req.rid in self._by_id:
            raise InvalidRequest(f"duplicate request id {req.rid!r}")
        waiting = len(self.waiting) + queued_elsewhere
        if waiting >= self.max_queue_len:
            raise OverflowError(f"the server is overloaded: {waiting} requests are waiting")

    def add(self, req: Request) -> None:
        """Queue a request. Raises InvalidRequest (nothing queued) for bad input, OverflowError when full."""
        self.check(req)
        self._by_id[req.rid] = req
        req.queued_at = self.clock()
        self.waiting.append(req)

    def abort(self, rid: str) -> Request | None:
        """Drop a request wherever it is and free its KV now."""
        req = self._by_id.get(rid)
        if req is None or req.finished:
            return None
        self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str) -> None:
        if reason in ("stop", "length") and req.pages:  # (running: its prefill is done) every token but the last
            req.num_computed = req.num_tokens - 1  # has its KV written, accepted drafts included: cache those pages
            self._cache_pages(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self._by_id.pop(req.rid, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_admitted_waiting(self) -> int:
        """Waiting requests that hold a slot: their prompt is being prefilled in chunks (no scan of the queue)."""
        return self.max_num_seqs - len(self._free_slots) - len(self.running)

    @property
    def kv_usage(self) -> float:
        a = self.allocator
        return 1.0 - a.num_free / a.capacity_pages

    # ---- KV bookkeeping --------------------------------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int) -> None:
        start = len(req.pages)
        if num_tokens <= start * self.allocator.page_size:  # (most steps: the last page has room)
            return
        new = self.allocator.grow(req.pages, num_tokens)
        if new:
            slots, pos, ids = self._page_updates
            slots.extend([req.req_slot] * len(new))
            pos.extend(range(start, start + len(new)))
            ids.extend(new)

    def _release(self, req: Request) -> None:
        self._constants = None
        if self.allocator.cache is not None:  # (its deferred pages stay cached, as one record: see _cache_pages)
            start, end = self.allocator.cache.release_request(req)
            if end > start:
                self.allocator.give_to_cache(req.pages, start, end)
        self.allocator.free(req.pages)  # (cached pages stay cached: a preempted request's recompute may reuse them)
        if req.req_slot is not None:
            self._free_slots.append(req.req_slot)
            req.req_slot = None
        req.num_computed = req.prefix_start = req.draft_lag = 0
        req.cache_nodes = []
        req.cache_at = NEVER

    # ---- prefix caching (deployments/engine/prefix_cache.py) -------------------------------------------------
    def _match_prefix(self, req: Request) -> list[tuple[int, int]]:
        """The cached pages a request being admitted can start from. Its last token is always computed (its logits
        are needed, and no step writes into a shared page): a wholly cached prompt leaves its last page out. Prompt
        logprobs need every position's logits: such requests match nothing."""
        cache = self.allocator.cache
        if cache is None or req.params.prompt_logprobs is not None:
            return []
        return cache.match(req.prompt_ids, req.num_tokens - 1, req.output_ids)

    def _share_prefix(self, req: Request, hit: list[tuple[int, int]]) -> None:
        """Hold the matched pages, grant them to the request's slot, and start its prefill after them."""
        if hit:
            slots, pos, ids = self._page_updates
            for page, _ in hit:
                self.allocator.share(req.pages, page)
                ids.append(page)
            slots.extend([req.req_slot] * len(hit))
            pos.extend(range(len(hit)))
            req.cache_nodes = [node for _, node in hit]
        req.num_computed = req.prefix_start = len(hit) * self.allocator.page_size
        if self.allocator.cache is not None:
            req.cache_at = req.num_computed + self.allocator.page_size

    def _cache_pages(self, req: Request) -> None:
        """Index the request's full pages whose KV (target and draft) every launched step has written (the draft's but
        at the positions of steps run with the draft paused, which nothing writes: design.md, "The draft's pause"):
        those before ``num_computed``; no step writes below it again (a speculative round writes from its root's
        position on, rejected drafts included), so no indexed page holds an unproven position. Nothing to do until
        ``num_computed`` reaches ``cache_at`` (the end of its first page not indexed yet; never with the cache off).

        Keys are built only until the request makes a node of its own (its first page that no one else computed):
        then it is deferred (``PrefixCache.defer``), and its later pages are keyed only when a lookup reaches that
        node, or kept as a record when it lets go of them. With nothing shared, a request keys one page."""
        written = req.num_computed - req.draft_lag  # (the draft's KV of its last plain steps is not written yet)
        if written < req.cache_at:
            return
        cache = self.allocator.cache
        if cache.index(req.cache_nodes, req.prompt_ids, req.output_ids, req.pages, written, until_new=True):
            cache.defer(req)
            req.cache_at = NEVER
        else:
            req.cache_at = (len(req.cache_nodes) + 1) * cache.page_size

    def clear_prefix_cache(self) -> None:
        """Forget every cached page: a failed step may have left garbage in pages indexed when it was planned."""
        self.allocator.clear_cache()

    def _preempt(self, req: Request) -> None:
        """Retract a running request: free its KV; it is recomputed (prompt + outputs so far) when readmitted."""
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _take_page_updates(self):
        out = self._page_updates
        self._page_updates = ([], [], [])
        return out

    # ---- scheduling ------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        due = bool(self.waiting)
        if self.delay_factor:
            now = self.clock()
            self._measure_prefill(now)
            due = due and self._prefill_due(now)
        plan = None
        if due:
            plan = self._schedule_mixed() if self._may_mix() else self._schedule_extend()
            if plan is not None and plan.mode == ForwardMode.EXTEND and self.delay_factor:
                self._prefill_age, self._prefill_longest = 0, 0.0
        return plan or self._schedule_decode()

    def _measure_prefill(self, now: float) -> None:
        """The last prefill step's wall: the longest interval between plans from its plan to the ``overlap`` + 1-th
        plan after it. Read at once, a step's wall is the interval to the next plan; overlapped, that interval holds
        its launch and the read of the step before (a decode step, on a busy device), and its own device time falls
        in the interval after."""
        if self._prefill_age is not None:
            self._prefill_age += 1
            self._prefill_longest = max(self._prefill_longest, now - self._last_plan)
            if self._prefill_age > self.overlap:
                self._prefill_wall, self._prefill_age = self._prefill_longest, None
        self._last_plan = now

    def _prefill_due(self, now: float) -> bool:
        """Whether the waiting requests are admitted now: when nothing runs, when the first is partly prefilled or
        has waited ``delay_factor`` times the last prefill step's wall (it is the oldest: admission is in order),
        or when they already fill a step (its token budget, or the free batch slots), which waiting would not
        make larger."""
        first = self.waiting[0]
        if (not self.running or first.req_slot is not None
                or now - first.queued_at >= self.delay_factor * self._prefill_wall):
            return True
        slots, tokens = self.max_num_seqs - len(self.running), 0
        for r in self.waiting:
            tokens += r.num_tokens - r.num_computed
            slots -= 1
            if tokens >= self.max_prefill_tokens or slots <= 0:
                return True
        return False

    def _may_mix(self) -> bool:
        """Whether this step's prefill chunks ride in a step with the running requests' decode rows: only without
        speculation (a decode row then appends exactly one token, so the host knows its length even while its
        previous step is in flight), for at most ``mixed_decode_rows`` rows, leaving some of the token budget to
        the chunks."""
        n = len(self.running)
        return (0 < n <= self.mixed_decode_rows and n < self.max_prefill_tokens and self.host_drafter is None
                and self.decode_max_advance == 1 and self.decode_lookahead == 1)

    def _schedule_extend(self) -> StepPlan | None:
        if not self.waiting:  # (a decode-only step: no pass over the running requests' reserves)
            return None
        batch = self._extend_batch(self.max_prefill_tokens)
        return self._plan(batch, []) if batch else None

    def _extend_batch(self, budget: int) -> list[tuple[Request, int]]:
        """Waiting requests' prompt chunks under ``budget`` tokens, admitting requests (a slot, pages) in order."""
        batch: list[tuple[Request, int]] = []
        # pages kept free for what admitted requests still need (running ones' next steps, partially prefilled ones'
        # remaining prompt), so a new admission can neither force a preemption nor starve a half-done prefill
        holders = self.running + [r for r in self.waiting if r.req_slot is not None]
        reserve = sum(max(0, self.allocator.pages_for(self._most_tokens(r) + self.decode_lookahead)
                             - len(r.pages)) for r in holders)
        for req in self.waiting:
            if budget <= 0:
                break
            if req.req_slot is None:
                if req.num_inflight:  # retracted while its last step runs: recomputed once its tokens are read
                    break
                if len(self.running) + len(batch) >= self.max_num_seqs or not self._free_slots:
                    break
                hit = self._match_prefix(req)
                # pages it still needs, and the cached ones it takes that nobody holds (they leave the free pool)
                need_new = self.allocator.pages_for(req.num_tokens + self.decode_lookahead) - len(hit)
                taken = sum(1 for page, _ in hit if self.allocator.refs(page) == 0) if hit else 0
                if need_new + taken > self.allocator.num_free - reserve:
                    break
                req.req_slot = self._free_slots.pop()
                req.draft_lag = 0  # (a preempted request's step in flight, read after its release, counted on)
                self._share_prefix(req, hit)
                reserve += need_new
                admitted = True
            else:
                admitted = False
            chunk = min(req.num_tokens - req.num_computed, budget)
            pages_before = len(req.pages)
            try:
                self._grow(req, req.num_computed + chunk)
            except OutOfPages:
                if admitted:
                    self._release(req)
                break
            if admitted and req.num_preemptions == 0 and self.allocator.cache is not None:
                self._count_prefix_hit(req)
            batch.append((req, chunk))
            reserve -= len(req.pages) - pages_before  # these reserved pages are now in use
            budget -= chunk
        return batch

    def _count_prefix_hit(self, req: Request) -> None:
        """A request's first admission: its prompt's cached tokens (final now: its prefill starts) and the cache's
        query and hit counters (tokens, as vLLM counts them; a prompt-logprobs request does not look up)."""
        if req.params.prompt_logprobs is None:
            cache = self.allocator.cache
            req.num_cached_tokens = min(req.prefix_start, len(req.prompt_ids))
            cache.queries += len(req.prompt_ids)
            cache.hits += req.num_cached_tokens

    def _schedule_mixed(self) -> StepPlan | None:
        """The running requests' decode rows first, then prompt chunks in the rest of the token budget, in one
        EXTEND step; a plain DECODE step when no chunk fits."""
        rows = self._decode_rows()
        batch = self._extend_batch(self.max_prefill_tokens - len(rows))
        if batch:
            return self._plan(batch, rows)
        return self._decode_plan(rows) if rows else None

    def _plan(self, batch: list[tuple[Request, int]], rows: list[Request]) -> StepPlan:
        """An EXTEND step: decode rows (``rows``: one token each, its id read on the device: -1 in ``input_ids``),
        then prompt chunks. The plan is taken as done: chunks count as computed, and a request whose prompt this
        step completes is running, with the token the step samples for it in flight, like a decode row's."""
        ids: list[int] = [-1] * len(rows)
        next_ids: list[int] = [-1] * len(rows)
        seq_lens, counters = [], []
        prompt_lps: list[int] = [-1] * len(rows)
        for r in rows:  # without speculation each step in flight appends one token: the host knows its lengths
            seq_lens.append(r.num_tokens + r.num_inflight)
            counters.append(len(r.output_ids) + r.num_inflight)
            r.num_inflight += 1
            r.inflight_plan = None
        starting = []
        for req, chunk in batch:
            all_ids = req.all_ids
            start, end = req.num_computed, req.num_computed + chunk
            if start == req.prefix_start:  # (its prefill starts: after the cached pages it matched, if any)
                starting.append(req)
            ids.extend(all_ids[start:end])
            next_ids.append(all_ids[end] if end < len(all_ids) else -1)
            k = req.params.prompt_logprobs
            prompt_lps.append(-1 if k is None or req.prompt_logprobs_done else k)
            seq_lens.append(end)
            counters.append(len(req.output_ids))
            req.num_computed = end
            self._cache_pages(req)  # (a later plan reads them after this step writes them: steps run in order)
            if end == len(all_ids):
                self.waiting.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                req.num_inflight += 1
                req.inflight_plan = None
        return StepPlan(
            mode=ForwardMode.EXTEND,
            requests=rows + [r for r, _ in batch],
            input_ids=ids,
            seq_lens=seq_lens,
            extend_lens=[1] * len(rows) + [c for _, c in batch],
            page_updates=self._take_page_updates(),
            counters=counters,
            next_ids=next_ids,
            prompt_logprobs=prompt_lps if max(prompt_lps, default=-1) >= 0 else None,
            logits_setup=self._logits_setup(starting) if starting else None,
        )

    def _logits_setup(self, starting: list[Request]) -> LogitsSetup:
        """The slots of the requests whose prefill starts (or restarts, after a preemption, with its outputs)."""
        entries, reset = [], []
        for r in starting:
            p = r.params
            if not p.logits_processing:
                reset.append(r.req_slot)
                continue
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))
            entries.append((r.req_slot, p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_tokens,
                            stops, p.logit_bias or {}, r.prompt_ids, r.output_ids))
        return LogitsSetup.build(entries, reset)

    def _schedule_decode(self) -> StepPlan | None:
        rows = self._decode_rows()
        return self._decode_plan(rows) if rows else None

    def _decode_rows(self) -> list[Request]:
        """Every running request whose in-flight tokens cannot have ended it, each with KV pages for the most this
        step appends; when pages run out, the newest running requests are preempted until they fit
        (``_most_tokens``'s rule inlined: this runs over every row of every step). A request sits out the step when
        its in-flight tokens may already reach max_tokens or the context length."""
        reqs: list[Request] = []
        running, i = self.running, 0
        page, lookahead, max_len = self.allocator.page_size, self.decode_lookahead, self.max_model_len
        while i < len(running):
            req = running[i]
            i += 1
            n_out = len(req.output_ids)
            n_tokens = len(req.prompt_ids) + n_out
            ahead = req.num_inflight
            if ahead:
                plan = req.inflight_plan
                ahead *= plan.max_advance if plan is not None and plan.max_advance is not None \
                    else self.decode_max_advance
                if n_out + ahead >= req.params.max_tokens or n_tokens + ahead >= max_len:
                    continue  # its in-flight tokens may already end it
            # its length once its in-flight steps land, at most, plus what this step appends
            need = n_tokens + ahead - 1 + lookahead
            if need > len(req.pages) * page:
                try:
                    self._grow(req, need)
                except OutOfPages:  # the newest request gives way (it comes after every request taken so far)
                    i -= 1
                    victim = running[-1]
                    if victim is req and len(running) == 1:
                        req.error = "the KV cache cannot hold this request even alone"
                        self.finish(req, "error")
                        self.failed.append(req)
                        continue
                    self._preempt(victim)
                    continue
            reqs.append(req)
        return reqs

    def _decode_plan(self, reqs: list[Request]) -> StepPlan:
        counters = [len(r.output_ids) for r in reqs]
        pending = [r.num_inflight for r in reqs]
        assert max(pending) <= 1, "one step in flight at most"
        plan = StepPlan(
            mode=ForwardMode.DECODE,
            requests=reqs,
            input_ids=[],  # each request's last token is on the device already (it may not have reached the host)
            seq_lens=[len(r.prompt_ids) + n for r, n in zip(reqs, counters)],
            extend_lens=[1] * len(reqs),
            page_updates=self._take_page_updates(),
            counters=counters,
            pending=pending,
            draft_tokens=[self.host_drafter(r.all_ids) for r in reqs] if self.host_drafter else None,
        )
        for r in reqs:
            r.num_inflight += 1
            r.inflight_plan = plan
        cached = self._constants
        if cached is not None and cached[0] == reqs:  # (list equality: the very same requests, in order)
            plan.constants = cached[1]
        else:
            plan.constants = step_constants(reqs)
            self._constants = (reqs, plan.constants)
        return plan

    def _inflight_advance(self, req: Request) -> int:
        """The most tokens its step in flight appends (that plan's depth, once chosen; else a full round's)."""
        plan = req.inflight_plan
        return plan.max_advance if plan is not None and plan.max_advance is not None else self.decode_max_advance

    def _most_tokens(self, req: Request) -> int:
        """The request's length once its in-flight steps land, at most (the one rule for ending, growing and
        reserving pages: counted otherwise, a plain step near the context's end outgrows the page table;
        ``_decode_rows`` inlines it)."""
        return req.num_tokens + req.num_inflight * self._inflight_advance(req)

    # ---- results ---------------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, list[int], tuple | None]]:
        """Apply sampled tokens; returns (request, new tokens, its round's drafts: ``count_accepted``'s ``spec``, or
        None) for every request that produced tokens."""
        if plan.next_ids is None and result.num_drafts == 0 and result.top_logprobs is None \
                and result.prompt_logprobs is None and len(result.tokens) == len(plan.requests):
            return self._update_one_each(plan, result)
        if plan.next_ids is None and result.num_drafts and result.counts is not None and result.top_logprobs is None \
                and result.prompt_logprobs is None and len(result.counts) == len(plan.requests):
            return self._update_round(plan, result)
        produced = []
        self.landed(plan)
        tops, specs, at = result.top_logprobs, result.spec(), result.offsets()
        prompt_lps = result.prompt_logprobs
        window = self.draft_catch_up_window if result.counts is not None else 0  # (a speculative DECODE step)
        plain = window and result.num_drafts == 0
        caught = result.caught_up  # (the worker caught every row behind up: one row's stash was full)
        after_full = lag_after_plain_step(window, window)  # (a row behind's lag after a plain step that caught up)
        for i, req in enumerate(plan.requests):
            if req.status == RequestStatus.FINISHED:  # aborted, or ended by a token read after this step was launched
                continue
            if prompt_lps is not None and prompt_lps[i] is not None:
                self._place_prompt_logprobs(req, plan.seq_lens[i] - plan.extend_lens[i], *prompt_lps[i])
            if plan.next_ids is not None and plan.next_ids[i] >= 0:
                continue  # a prompt chunk with more to go: its sampled token is not output
            a, b = at[i], at[i + 1]
            if window:  # as the worker's stash: a plain step on a full one catches the draft up first
                req.draft_lag = ((after_full if req.draft_lag else 1) if caught else req.draft_lag + 1) if plain else 0
            new = self._append_tokens(req, result.tokens[a:b], result.logprobs[a:b], tops[i] if tops else None)
            produced.append((req, new, specs[i] if specs else None))
            if req.status == RequestStatus.FINISHED:
                self.finish(req, req.finish_reason)
        return produced

    def _update_one_each(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, list[int], None]]:
        """``update`` of a step that appended one token to every row and carries nothing else (a plain DECODE step,
        or adaptive speculation's depth 0; no prompt chunks, alternatives or prompt logprobs): ``landed`` and
        ``_append_tokens`` in one pass, with the same stop rules (EOS / stop ids, then the length limit)."""
        produced = []
        finished, running = RequestStatus.FINISHED, RequestStatus.RUNNING
        eos, max_len = self.eos_token_ids, self.max_model_len
        window = self.draft_catch_up_window if result.counts is not None else 0  # (a speculative engine's plain step)
        caught = result.caught_up  # (the worker caught every row behind up: one row's stash was full)
        after_full = lag_after_plain_step(window, window)  # (inline below: this loop runs over every row)
        kv_ahead = self.decode_max_advance - 1 + self.decode_lookahead  # KV slots each step in flight may write
        page = self.allocator.page_size
        for req, tok, lp in zip(plan.requests, result.tokens, result.logprobs, strict=True):
            req.num_inflight -= 1
            if req.status is finished:  # aborted, or ended by a token read after this step was launched
                continue
            if window:  # as the worker's stash: a plain step on a full one catches the draft up first
                req.draft_lag = (after_full if req.draft_lag else 1) if caught else req.draft_lag + 1
            p, out = req.params, req.output_ids
            out.append(tok)
            req.output_logprobs.append(lp)
            new = [tok]
            produced.append((req, new, None))
            n_tokens = len(req.prompt_ids) + len(out)
            if (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids:
                req.status, req.finish_reason = finished, "stop"
            elif len(out) >= p.max_tokens or n_tokens >= max_len:
                req.status, req.finish_reason = finished, "length"
            if req.status is finished:
                self.finish(req, req.finish_reason)
                continue
            if req.status is running:  # (as _append_tokens: the newest token's K/V is not written yet)
                req.num_computed = n_tokens - 1
                if req.num_computed - req.draft_lag >= req.cache_at:
                    self._cache_pages(req)
                keep = req.num_computed + req.num_inflight * kv_ahead
                if len(req.pages) * page >= keep + page:  # (a page to give back: rare without speculation)
                    self.allocator.shrink(req.pages, keep)
        return produced

    def _update_round(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, list[int], tuple]]:
        """``update`` of a speculative round that carries nothing else (no prompt chunks, alternatives or prompt
        logprobs): ``landed`` and ``_append_tokens`` in one pass over the flat tokens, with the same stop rules (EOS /
        stop ids within the accepted run, then the length limit) and the same KV shrink and page caching."""
        produced = []
        finished, running = RequestStatus.FINISHED, RequestStatus.RUNNING
        eos, max_len = self.eos_token_ids, self.max_model_len
        window = self.draft_catch_up_window  # (a round leaves the draft caught up)
        kv_ahead = self.decode_max_advance - 1 + self.decode_lookahead  # KV slots each step in flight may write
        page = self.allocator.page_size
        depth, tokens, logprobs = result.num_drafts, result.tokens, result.logprobs
        b = 0
        for req, c in zip(plan.requests, result.counts, strict=True):
            a, b = b, b + c
            req.num_inflight -= 1
            if req.status is finished:  # aborted, or ended by a token read after this step was launched
                continue
            if window:
                req.draft_lag = 0
            p, out = req.params, req.output_ids
            run = tokens[a:b]
            stop_ids = p.stop_token_ids
            n_prompt = len(req.prompt_ids)
            limit = min(p.max_tokens, max_len - n_prompt) - len(out)  # output tokens left before the length limit
            n, reason = c, None
            if limit <= c or (not p.ignore_eos and not eos.isdisjoint(run)) \
                    or (stop_ids and any(t in stop_ids for t in run)):  # (else: the whole run is kept)
                stop_eos = () if p.ignore_eos else eos
                for j, tok in enumerate(run):
                    if tok in stop_eos or tok in stop_ids:
                        n, reason = j + 1, "stop"
                        break
                    if j + 1 >= limit:
                        n, reason = j + 1, "length"
                        break
            if n < c:
                run = run[:n]
            out.extend(run)
            req.output_logprobs.extend(logprobs[a:a + n])
            produced.append((req, run, (depth, range(c - 1))))
            if reason is not None:
                req.status, req.finish_reason = finished, reason
                self.finish(req, reason)
                continue
            if req.status is running:  # (as _append_tokens: the newest token's K/V is not written yet)
                req.num_computed = n_prompt + len(out) - 1
                if req.num_computed - req.draft_lag >= req.cache_at:
                    self._cache_pages(req)
                keep = req.num_computed + req.num_inflight * kv_ahead
                if len(req.pages) * page >= keep + page:  # (pages past the accepted run: rejected drafts' KV)
                    self.allocator.shrink(req.pages, keep)
        return produced

    @staticmethod
    def _place_prompt_logprobs(req: Request, start: int, lps: list[float], tops: list) -> None:
        """A chunk's prompt logprobs (of the prompt tokens after its positions ``start``...) into the request's list;
        a recomputed chunk writes the same values again."""
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * len(req.prompt_ids)
        for j, lp in enumerate(lps):
            req.prompt_logprobs[start + 1 + j] = (lp, tops[j] if tops else [])
        if start + 1 + len(lps) >= len(req.prompt_ids):
            req.prompt_logprobs_done = True

    def drop_newest(self, req: Request, num: int) -> None:
        """A stop string ended ``req`` before the last ``num`` tokens its newest step appended: they are not output
        (their ids, logprobs and alternatives go), as the tokens a stop id or EOS leaves behind never were."""
        if num:
            del req.output_ids[-num:], req.output_logprobs[-num:]
            if req.params.top_logprobs and req.output_top_logprobs:
                del req.output_top_logprobs[-num:]

    @staticmethod
    def count_accepted(req: Request, spec: tuple[int, range], num_new: int) -> None:
        """A speculative round's drafts and accepted positions; drafts cut by a stop condition do not count."""
        kept = min(len(spec[1]), num_new - 1)
        stats = req.spec
        stats.num_drafts += 1
        stats.num_draft_tokens += spec[0]
        if kept:  # (none accepted: nothing more to count, as for most requests at low acceptance)
            stats.num_accepted_tokens += kept
            per = stats.accepted_per_position
            if len(per) < kept:
                per.extend([0] * (kept - len(per)))
            for pos_ok in range(kept):
                per[pos_ok] += 1

    def landed(self, plan: StepPlan) -> None:
        """The plan's step has finished (or failed): its tokens are no longer in flight."""
        nxt = plan.next_ids
        for i, req in enumerate(plan.requests):
            if nxt is None or nxt[i] < 0:  # (a step samples for a request unless it prefills a chunk short of its end)
                req.num_inflight -= 1

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list[float],
                       top: list[list[tuple[int, float]]] | None = None) -> list[int]:
        """Append tokens up to the first stop condition; sets req.finish_reason when one is hit. ``top``: each
        token's most likely alternatives (kept, cut to its request's ``top_logprobs``, when it asked for them)."""
        p = req.params
        eos = () if p.ignore_eos else self.eos_token_ids
        # output length that ends it: max_tokens, or the context's end
        limit = min(p.max_tokens, self.max_model_len - len(req.prompt_ids)) - len(req.output_ids)
        n, reason = len(tokens), None
        for j, tok in enumerate(tokens):
            if tok in eos or tok in p.stop_token_ids:
                n, reason = j + 1, "stop"
                break
            if j + 1 >= limit:
                n, reason = j + 1, "length"
                break
        new = tokens if n == len(tokens) else tokens[:n]
        req.output_ids.extend(new)
        req.output_logprobs.extend(logprobs[:n])
        if p.top_logprobs and top is not None:
            req.output_top_logprobs.extend(t[: p.top_logprobs] for t in top[:n])
        if reason is not None:
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        # every token but the newest has its K/V cached now. A speculative round wrote K/V for all draft nodes;
        # only the accepted ones are kept, and whole pages past them go back to the pool (not those a step still in
        # flight writes to). A request preempted while this step ran holds no KV: it is recomputed on readmission.
        if req.status == RequestStatus.RUNNING:
            req.num_computed = req.num_tokens - 1
            if req.num_computed - req.draft_lag >= req.cache_at:  # a page filled up (once per page_size tokens)
                self._cache_pages(req)
            in_flight = req.num_inflight * (self.decode_max_advance - 1 + self.decode_lookahead)
            self.allocator.shrink(req.pages, req.num_computed + in_flight)
        return new
