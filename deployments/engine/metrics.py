"""Metrics through ``ray.util.metrics`` (exported by Ray's metrics agent with a ``ray_`` prefix), recorded where vLLM
records them: the engine core's step and load figures (``EngineMetrics``), and each request's latencies and outcome
in the ingress replica that serves it (``RequestMetrics``).

Names are vLLM's with the ``vllm:`` prefix written ``vllm_`` (Ray no longer accepts ':' in metric names), so a
vLLM query such as ``rate(vllm:spec_decode_num_accepted_tokens_total[1m])`` becomes
``rate(ray_vllm_spec_decode_num_accepted_tokens_total[1m])``. Every metric carries the label ``model_name``.
"""

from __future__ import annotations

import time

from ray.util.metrics import Counter, Gauge, Histogram

# vLLM's bucket boundaries (seconds) for each histogram, so quantiles interpolate alike; the inter-token ones add
# 1 and 5 ms below vLLM's first bucket (per-step gaps of a few milliseconds are ordinary on a GPU)
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]
# token counts per request (vLLM's 1-2-5 series, here up to a million tokens whatever the model's context, so every
# replica and model registers the same boundaries), n, and tokens per engine step (vLLM's)
_TOKEN_BUCKETS = [m * 10 ** e for e in range(6) for m in (1, 2, 5)] + [1_000_000]
_N_BUCKETS = [1, 2, 5, 10, 20]
_ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_TAGS = ("model_name",)


class EngineMetrics:
    """The engine core's figures: load gauges, generated tokens, speculation counters. Each step's figures are added
    up on the host and reach Ray at most every FLUSH_INTERVAL_S (and when the loop goes idle, ``flush_pending``):
    a Ray metric call costs microseconds and may hand the interpreter lock to another thread, and the loop makes
    hundreds of steps a second. Counters keep their totals; a gauge shows the newest step's value."""

    FLUSH_INTERVAL_S = 0.1

    def __init__(self, model_name: str, replica: str = ""):
        self.tags = {"model_name": model_name}
        c = lambda name, desc, keys=_TAGS: Counter(f"vllm_{name}", desc, tag_keys=keys)  # noqa: E731
        g = lambda name, desc: Gauge(f"vllm_{name}", desc, tag_keys=_TAGS)  # noqa: E731
        self.num_drafts = c("spec_decode_num_drafts", "Speculative rounds (one per request per round)")
        self.num_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = c("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per position",
                                  _TAGS + ("position",))
        self.steps_by_depth = c("spec_decode_num_steps", "Speculative steps by draft depth (adaptive speculation; "
                                "depth 0: a plain step; paused: a plain step with the draft paused)",
                                _TAGS + ("depth",))
        self.mean_accept_length = g("spec_decode_mean_accept_length", "1 + accepted / drafts over the last step")
        self.generation_tokens = c("generation_tokens", "Generated tokens")
        self.iteration_tokens = Histogram("vllm_iteration_tokens_total", "Tokens per engine step: prompt tokens "
                                          "computed and tokens generated", boundaries=_ITERATION_BUCKETS,
                                          tag_keys=_TAGS)
        self.iteration_tokens.set_default_tags(self.tags)
        self.num_running = g("num_requests_running", "Requests in the running batch")
        self.num_waiting = g("num_requests_waiting", "Requests waiting for admission")
        self.kv_usage = g("kv_cache_usage_perc", "Fraction of KV pages in use (0..1)")
        # vLLM's prefix cache counters (prompt tokens looked up / found), per engine replica (data parallel); fed
        # from the engine's cumulative stats of the same names
        self.prefix_cache_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      _TAGS + ("replica",))
        self.prefix_cache_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache", _TAGS + ("replica",))
        self.num_preemptions = c("num_preemptions", "Cumulative number of preemption from the engine",
                                 _TAGS + ("replica",))
        self._replica_tags = {**self.tags, "replica": replica}
        # the engine's cumulative stats fed to counters per replica: stat name -> (counter, the total already counted)
        self._totals = {"prefix_cache_queries": [self.prefix_cache_queries, 0],
                        "prefix_cache_hits": [self.prefix_cache_hits, 0], "preemptions": [self.num_preemptions, 0]}
        self._accept_length: float | None = None  # the gauge's last value, re-set while idle (see record_load)
        # recorded, not sent yet: the newest step's stats, generated tokens, steps by depth, and the speculative
        # counters (drafts, draft tokens, accepted, accepted per position)
        self._stats: dict | None = None
        self._generated = 0
        self._iterations: list[int] = []  # each step's tokens (prompt tokens computed + generated)
        self._depths: dict[str, int] = {}
        self._spec = [0, 0, 0]
        self._per_pos: list[int] = []
        self._due = 0.0  # (monotonic) when the next recorded step sends
        self.record_load({"running": 0, "waiting": 0, "kv_usage": 0.0})  # exported (as 0) before any request

    def record_load(self, stats: dict) -> None:
        """The gauges now (running and waiting requests, KV use, the last speculative step's mean accept length),
        with whatever the steps recorded since the last flush. Called after requests end outside a step and, while
        idle, periodically (Ray drops a gauge from the export when it is not set for a while: an idle server's
        accept length would vanish from Prometheus)."""
        self.flush_pending()
        t = self.tags
        self.num_running.set(stats["running"], tags=t)
        self.num_waiting.set(stats["waiting"], tags=t)
        self.kv_usage.set(stats["kv_usage"], tags=t)
        if self._accept_length is not None:
            self.mean_accept_length.set(self._accept_length, tags=t)

    def record_step(self, stats: dict) -> None:
        """A step's figures (``Engine.step_stats``), sent with the others at the next flush."""
        self._stats = stats
        if "spec_depth" in stats:
            depth = str(stats["spec_depth"])
            self._depths[depth] = self._depths.get(depth, 0) + 1
        spec = stats.get("spec")
        if spec and spec["drafts"]:
            acc = self._spec
            acc[0] += spec["drafts"]
            acc[1] += spec["draft_tokens"]
            acc[2] += spec["accepted"]
            per = self._per_pos
            if len(per) < len(spec["per_pos"]):
                per.extend([0] * (len(spec["per_pos"]) - len(per)))
            for pos, n in enumerate(spec["per_pos"]):
                per[pos] += n
            self._accept_length = 1.0 + spec["accepted"] / spec["drafts"]
        if time.monotonic() >= self._due:
            self.flush_pending()

    def record_generated(self, num_tokens: int, num_prompt_tokens: int = 0) -> None:
        """A step's new tokens, all requests together, and the prompt tokens it computed (sent with its
        ``record_step``)."""
        self._generated += num_tokens
        self._iterations.append(num_tokens + num_prompt_tokens)

    def flush_pending(self) -> None:
        """Send what the steps recorded since the last flush (nothing to do: no Ray call)."""
        self._due = time.monotonic() + self.FLUSH_INTERVAL_S
        stats, self._stats = self._stats, None
        t = self.tags
        if self._generated:
            self.generation_tokens.inc(self._generated, tags=t)
            self._generated = 0
        for n in self._iterations:
            self.iteration_tokens.observe(n)
        self._iterations.clear()
        for depth, n in self._depths.items():
            self.steps_by_depth.inc(n, tags={**t, "depth": depth})
        self._depths.clear()
        drafts, draft_tokens, accepted = self._spec
        if drafts:
            self.num_drafts.inc(drafts, tags=t)
            self.num_draft_tokens.inc(draft_tokens, tags=t)
            if accepted:
                self.num_accepted_tokens.inc(accepted, tags=t)
            for pos, n in enumerate(self._per_pos):
                if n:
                    self.accepted_per_pos.inc(n, tags={**t, "position": str(pos)})
            self._spec = [0, 0, 0]
            self._per_pos = []
        if stats is None:
            return
        for name, (counter, seen) in self._totals.items():
            total = stats.get(name, 0)
            if total < seen:  # a fresh engine (its workers were restarted) counts from 0 again
                seen = 0
            if total > seen:
                counter.inc(total - seen, tags=self._replica_tags)
            self._totals[name][1] = total
        self.num_running.set(stats["running"], tags=t)
        self.num_waiting.set(stats["waiting"], tags=t)
        self.kv_usage.set(stats["kv_usage"], tags=t)
        if self._accept_length is not None:
            self.mean_accept_length.set(self._accept_length, tags=t)


class RequestMetrics:
    """Each request's latencies and outcome, recorded by the ingress replica that streams it (as vLLM's API server
    does): TTFT and end-to-end latency start when the HTTP request arrived."""

    def __init__(self, model_name: str):
        self.tags = {"model_name": model_name}
        h = lambda name, desc, b: Histogram(f"vllm_{name}", desc, boundaries=b, tag_keys=_TAGS)  # noqa: E731
        self.prompt_tokens = Counter("vllm_prompt_tokens", "Prefilled prompt tokens", tag_keys=_TAGS)
        self.request_success = Counter("vllm_request_success", "Finished requests",
                                       tag_keys=_TAGS + ("finished_reason",))
        self.ttft = h("time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between a request's steps that produced tokens",
                     _ITL_BUCKETS)
        self.tpot = h("request_time_per_output_token_seconds", "A finished request's mean time per output token "
                      "after the first", _ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency", _REQUEST_BUCKETS)
        self.request_prompt_tokens = h("request_prompt_tokens", "Number of prefill tokens processed (a finished "
                                       "request's prompt)", _TOKEN_BUCKETS)
        self.request_generation_tokens = h("request_generation_tokens", "Number of generation tokens processed (a "
                                           "finished request's output)", _TOKEN_BUCKETS)
        self.request_max_tokens = h("request_params_max_tokens", "Histogram of the max_tokens request parameter",
                                    _TOKEN_BUCKETS)
        self.request_n = h("request_params_n", "Histogram of the n request parameter", _N_BUCKETS)
        # the engine's phases of a finished request (vLLM's request metrics, from the engine core's timestamps); the
        # parts of TTFT get TTFT's finer buckets, as Ray exports a histogram's sum from its buckets' midpoints
        self.phases = {
            "queue": h("request_queue_time_seconds", "Time spent in WAITING phase for request", _TTFT_BUCKETS),
            "prefill": h("request_prefill_time_seconds", "Time spent in PREFILL phase for request", _TTFT_BUCKETS),
            "decode": h("request_decode_time_seconds", "Time spent in DECODE phase for request", _REQUEST_BUCKETS),
            "inference": h("request_inference_time_seconds", "Time spent in RUNNING phase for request",
                           _REQUEST_BUCKETS)}
        # the model tag as every metric's default: a record without tags skips Ray's merge of tag dicts (an
        # inter-token sample is recorded for every streamed chunk)
        for metric in (self.prompt_tokens, self.request_success, self.ttft, self.itl, self.tpot, self.e2e,
                       self.request_prompt_tokens, self.request_generation_tokens, self.request_max_tokens,
                       self.request_n, *self.phases.values()):
            metric.set_default_tags(self.tags)

    def record_tokens(self, num_prompt: int, arrival: float, now: float, prev_token_time: float | None) -> None:
        """TTFT for a request's first tokens, else one inter-token sample: the time since its previous delivery of
        tokens, however many it carried (vLLM's definition: a speculative round is one sample)."""
        if prev_token_time is None:
            self.prompt_tokens.inc(num_prompt)
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - prev_token_time)

    def record_n(self, n: int) -> None:
        """An API request's ``n`` (per prompt: vLLM's requests are a prompt's)."""
        self.request_n.observe(n)

    def record_finish(self, reason: str, arrival: float, now: float, first_token_time: float | None,
                      num_output: int, phases: dict | None = None, num_prompt: int = 0,
                      max_tokens: int | None = None) -> None:
        """A request that ended, for whatever reason (stop, length, abort, error); ``phases``: the engine's
        ``Request.phases`` of one it finished."""
        self.request_success.inc(1, tags={"finished_reason": reason})
        self.e2e.observe(now - arrival)
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_output)
        if max_tokens is not None:
            self.request_max_tokens.observe(max_tokens)
        if first_token_time is not None and num_output > 1:
            self.tpot.observe((now - first_token_time) / (num_output - 1))
        if phases:
            for name, histogram in self.phases.items():
                histogram.observe(phases[name])
