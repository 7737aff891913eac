"""The engine core's metrics: a step's figures are summed on the host and sent to Ray at most every
FLUSH_INTERVAL_S (and when the loop goes idle), with the totals and newest values a per-step send would give."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.util.metrics")


def test_engine_metrics_send_the_sum_of_the_steps_at_a_flush():
    from deployments.engine.metrics import EngineMetrics

    m = EngineMetrics("flush-test")
    sent = []

    def watch(metric, name):
        inner = metric.inc if hasattr(metric, "inc") else metric.set

        def call(value, tags=None):
            key = next((tags[k] for k in ("depth", "position") if tags and k in tags), None)
            sent.append((name, key, value))
            return inner(value, tags=tags)

        setattr(metric, "inc" if hasattr(metric, "inc") else "set", call)

    for name in ("generation_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos",
                 "steps_by_depth", "prefix_cache_queries", "num_preemptions", "num_running", "mean_accept_length"):
        watch(getattr(m, name), name)
    observed = []
    m.iteration_tokens.observe = lambda value, tags=None: observed.append(value)
    m.FLUSH_INTERVAL_S = 3600.0
    m.flush_pending()  # (the next flush is an hour away)
    for i, (depth, accepted, per_pos) in enumerate([(2, 3, [2, 1]), (0, 0, []), (1, 1, [1])]):
        spec = {"drafts": 2, "draft_tokens": 2 * depth, "accepted": accepted, "per_pos": per_pos} if depth else None
        m.record_generated(2 + accepted, 100 if i == 0 else 0)  # (the first step also computed 100 prompt tokens)
        m.record_step({"running": 2 + i, "waiting": 0, "kv_usage": 0.5, "prefix_cache_queries": 10 * (i + 1),
                       "preemptions": i, "spec_depth": depth, **({"spec": spec} if spec else {})})
    assert sent == [] and observed == []  # three steps, no Ray call
    m.flush_pending()
    assert observed == [105, 2, 3]  # each step's tokens (vLLM's iteration_tokens_total), one sample a step
    assert sorted(sent, key=str) == sorted([
        ("generation_tokens", None, 10), ("num_drafts", None, 4), ("num_draft_tokens", None, 6),
        ("num_accepted_tokens", None, 4), ("accepted_per_pos", "0", 3), ("accepted_per_pos", "1", 1),
        ("steps_by_depth", "2", 1), ("steps_by_depth", "0", 1), ("steps_by_depth", "1", 1),
        ("prefix_cache_queries", None, 30), ("num_preemptions", None, 2), ("num_running", None, 4),
        ("mean_accept_length", None, 1.5)], key=str)
    sent.clear()
    m.flush_pending()  # nothing new: nothing sent
    assert sent == [] and observed == [105, 2, 3]
