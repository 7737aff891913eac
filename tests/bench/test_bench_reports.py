"""The bench reports' own arithmetic (no GPU): how a profiled replay's wall time is attributed to its kernels, and
the speculation summary's ratios."""

from types import SimpleNamespace

from bench.gpu_perf import Suite
from bench.host_step import runtime_call_summary
from bench.profile_decode import exposed_by_kernel, verify_layers


def test_exposed_time_attribution_with_overlap_and_idle():
    # a 0-10; b 8-16 (starts 2 before a ends: PDL overlap); idle 16-20; c 20-23; b again 18-20 (5 before c's end),
    # wholly inside the span already covered: it adds nothing to the wall
    kernels = [{"kernel": "a", "us": 10.0, "gap_before_us": 0.0},
               {"kernel": "b", "us": 8.0, "gap_before_us": -2.0},
               {"kernel": "c", "us": 3.0, "gap_before_us": 4.0},
               {"kernel": "b", "us": 2.0, "gap_before_us": -5.0}]
    got = exposed_by_kernel(kernels)
    assert got["a"] == {"launches": 1, "us": 10.0, "exposed_us": 10.0}
    assert got["b"] == {"launches": 2, "us": 10.0, "exposed_us": 6.0}  # 10 -> 16; the second (18-20) nothing
    assert got["c"] == {"launches": 1, "us": 3.0, "exposed_us": 7.0}  # idle 16-20 and 20-23
    assert sum(v["exposed_us"] for v in got.values()) == 23.0  # the replay's wall time


def test_verify_layers_roles_and_span():
    def layer():  # input norm, q/k/v, RoPE, attention, merge, o, gate/up, down
        return [("_add_rms_norm", 2.0), ("_weight_left_dot", 20.0), ("_rope_qk", 2.0), ("_split_kv_attention", 5.0),
                ("_merge_splits", 3.0), ("_weight_left_dot", 13.0), ("_weight_left_dot", 80.0),
                ("_weight_left_dot", 43.0)]
    # a draft step first (its own RoPE, outside the span), then two verify layers and the lm_head
    seq = ([("_gemv", 40.0), ("_rope_qk", 2.0), ("_gemv", 9.0)] + layer() + layer()
           + [("_weight_left_dot", 340.0)])
    kernels = [{"kernel": n, "us": us, "gap_before_us": 0.0} for n, us in seq]  # back to back: exposed = duration
    got = verify_layers(kernels, 2)
    assert got == {"per_layer_us": 168.0, "_add_rms_norm": 2.0, "q/k/v": 20.0, "_rope_qk": 2.0,
                   "_split_kv_attention": 5.0, "_merge_splits": 3.0, "o": 13.0, "gate/up": 80.0, "down": 43.0}


def test_runtime_call_summary_keeps_cuda_calls_per_step():
    """The host-side profile's CUDA runtime and driver calls per step, longest first (host waits show as long
    synchronizes or copies); aten ops and Python frames are left out."""
    events = [("cudaGraphLaunch", 12.0), ("aten::copy_", 30.0), ("cudaMemcpyAsync", 4.0), ("cudaGraphLaunch", 10.0),
              ("cudaEventSynchronize", 900.0), ("cuLaunchKernelEx", 6.0), ("cudaMemcpyAsync", 300.0),
              ("custom_op", 50.0), ("worker.py(217): step", 80.0)]
    got = runtime_call_summary(events, steps=2)
    assert got == [{"call": "cudaEventSynchronize", "per_step": 0.5, "us_per_step": 450.0, "longest_us": 900.0},
                   {"call": "cudaMemcpyAsync", "per_step": 1.0, "us_per_step": 152.0, "longest_us": 300.0},
                   {"call": "cudaGraphLaunch", "per_step": 1.0, "us_per_step": 11.0, "longest_us": 12.0},
                   {"call": "cuLaunchKernelEx", "per_step": 0.5, "us_per_step": 3.0, "longest_us": 6.0}]


def test_speculation_summary_ratios():
    def row(bs, tok_s, ms):
        return {"batch_size": bs, "decode_tok_s": tok_s, "ms_per_step": ms}

    throughput = {"no_spec": [row(1, 200.0, 5.0), row(64, 8000.0, 8.0)],
                  "eagle3_chain3": [row(1, 480.0, 6.0), row(64, 16000.0, 12.0)],
                  "naive_fused": [row(1, 300.0, 5.4), row(64, 11000.0, 8.4)],
                  "naive_separate": [row(1, 290.0, 5.5), row(64, 10800.0, 8.5)]}
    suite = SimpleNamespace(args=SimpleNamespace(accept_length=3.0), results={"throughput": throughput})
    Suite.summarize(suite)
    got = suite.results["summary"]
    assert got["eagle3_chain3_vs_no_spec_bs1"] == 2.4
    assert got["eagle3_chain3_round_in_decode_steps_bs1"] == 1.2
    assert got["eagle3_chain3_vs_no_spec_bs1_at_simulated_accept_length"] == 2.5  # 3 tokens per 1.2 steps
    assert got["naive_fused_over_separate_round_ms_bs1"] == round(5.4 / 5.5, 3)
    assert got["naive_fused_over_separate_bound_bs1"] == round(5.0 / 5.5, 3)  # a fused round of one decode step
    assert got["naive_fused_vs_no_spec_bs64"] == 1.375
    assert got["spec_vs_no_spec_by_bs"] == {1: 2.4, 64: 2.0}


def test_speculation_row_is_the_fastest_run():
    """A speculation row keeps the run with the fewest ms per step (a stall only adds time) and every run's."""
    stalled = {"batch_size": 64, "decode_tok_s": 35410.7, "ms_per_step": 2.869}
    clean = {"batch_size": 64, "decode_tok_s": 50183.3, "ms_per_step": 2.0}
    for runs in ([stalled, clean], [clean, stalled]):
        got = Suite.fastest_run(runs)
        assert (got["decode_tok_s"], got["ms_per_step"]) == (50183.3, 2.0)
        assert got["ms_per_step_runs"] == [r["ms_per_step"] for r in runs]


def test_a_result_names_the_checkpoint_it_ran(tmp_path):
    """tp_decode labels its JSON from the checkpoint's config (it once said "Llama-3.1-8B shape" of a 1B run)."""
    import json

    from bench.common import describe_checkpoint, write_checkpoint

    write_checkpoint(tmp_path / "smoke", "llama-smoke")
    assert describe_checkpoint(tmp_path / "smoke") == "llama-smoke shape, 2 layers, random bfloat16 weights"
    write_checkpoint(tmp_path / "short", "llama-smoke", layers=1)
    assert describe_checkpoint(tmp_path / "short").startswith("llama-smoke shape, 1 layers")
    cfg = json.loads((tmp_path / "smoke" / "config.json").read_text())
    cfg["hidden_size"] = 96  # no known shape
    (tmp_path / "smoke" / "config.json").write_text(json.dumps(cfg))
    assert describe_checkpoint(tmp_path / "smoke").startswith("hidden 96, 2 layers")


def test_adaptive_summary_ratios():
    """bench.adaptive: adaptive vs no-spec and vs the best fixed depth at each point, and the worst of each."""
    from bench.adaptive import Bench

    def rows(**by_bs):
        return {bs.removeprefix("b"): {"decode_tok_s": v} for bs, v in by_bs.items()}

    res = {"no_spec": rows(b1=100.0, b64=1000.0),
           "spec": {"2": {"adaptive": rows(b1=150.0, b64=990.0), "depth0": rows(b1=95.0, b64=990.0),
                          "depth1": rows(b1=160.0, b64=800.0)}}}
    got = Bench.summary(None, res)
    assert got["points"]["2"]["1"] == {"vs_no_spec": 1.5, "vs_best_fixed": 0.938, "best_fixed": "depth1"}
    assert got["points"]["2"]["64"] == {"vs_no_spec": 0.99, "vs_best_fixed": 1.0, "best_fixed": "depth0"}
    assert got["min_vs_no_spec"] == 0.99 and got["min_vs_best_fixed"] == 0.938


def test_serving_per_step_counts_prefill_steps_and_requests_per_submit():
    """bench.serving's per-level figures from two /v1/stats answers: host time per step, and how the arrivals reached
    the engine (prefill steps, requests per submit call)."""
    from bench.serving import per_step

    def stats(steps, extends, submits, requests, busy):
        return {"step_time": {"steps": steps, "schedule_s": steps * 1e-4, "execute_s": steps * 1e-3,
                              "worker_s": steps * 5e-4, "outputs_s": steps * 1e-4, "extend_steps": extends},
                "loop": {"busy_s": busy, "submits": submits}, "requests": requests}

    row = per_step(stats(100, 4, 3, 10, 1.0), stats(300, 10, 7, 42, 1.5))
    assert row["steps"] == 200 and row["extend_steps"] == 6 and row["submits"] == 4
    assert row["requests_per_submit"] == 8.0 and row["loop_wall_ms"] == 2.5
    old = {"step_time": {k: v for k, v in stats(300, 0, 0, 0, 0)["step_time"].items() if k != "extend_steps"}}
    assert "extend_steps" not in per_step(old, old | {"step_time": {**old["step_time"], "steps": 301}})
    # what was built inside the level's steps: Triton compiles, and graphs captured on first use
    before = stats(100, 4, 3, 10, 1.0) | {"compiles": {"compiles": 1, "s": 0.5, "graph_captures": 2,
                                                       "graph_capture_s": 0.25}}
    after = stats(300, 10, 7, 42, 1.5) | {"compiles": {"compiles": 1, "s": 0.5, "graph_captures": 5,
                                                      "graph_capture_s": 1.0}}
    row = per_step(before, after)
    assert (row["compiles"], row["graph_captures"], row["graph_captures_ms"]) == (0, 3, 750.0)


def test_serving_sampling_fields():
    """bench.serving's --temperature / --top-p become the requests' fields; none given: greedy (no field)."""
    import argparse

    from bench.serving import sampling

    assert sampling(argparse.Namespace(temperature=None, top_p=None)) == {}
    assert sampling(argparse.Namespace(temperature=0.6, top_p=0.9)) == {"temperature": 0.6, "top_p": 0.9}


def test_adaptive_ab_summary_from_a_trace():
    """bench.adaptive_ab: medians over repeats against no speculation's, and a trace's launches by depth (the
    interval to the next launch, its wait, host = the difference; none across a non-contiguous launch)."""
    from bench.adaptive_ab import summary

    res = {"rows": {"no_spec": [{"decode_tok_s": 100.0, "median_step_ms": 2.0},
                                {"decode_tok_s": 90.0, "median_step_ms": 2.2},
                                {"decode_tok_s": 110.0, "median_step_ms": 1.8}],
                    "adaptive": [{"decode_tok_s": 95.0, "median_step_ms": 2.1}]},
           "trace": {"adaptive": [["choose", 0.0, 8, 0, 0], ["launch", 1.000, 0.0, True],
                                  ["choose", 0.0, 8, 0, 1], ["launch", 1.003, 0.0005, True],
                                  ["choose", 0.0, 8, 1, 2], ["launch", 1.006, 0.001, True],
                                  ["choose", 0.0, 8, 0, 0], ["launch", 1.011, 0.002, True],
                                  ["choose", 0.0, 8, 0, 1], ["launch", 1.050, 0.0, False]]}}
    got = summary(res)
    assert got["no_spec"] == {"tok_s": 100.0, "vs_no_spec": 1.0, "median_step_ms": 2.0}
    assert got["adaptive"]["vs_no_spec"] == 0.95
    by = got["adaptive"]["launches_by_depth"]
    assert by["0"] == {"n": 2, "interval_ms": 3.0, "waited_ms": 0.75, "host_ms": 2.25}
    assert by["1"] == {"n": 1, "interval_ms": 5.0, "waited_ms": 2.0, "host_ms": 3.0}


def test_adaptive_ab_summary_sums_each_calls_own_time():
    """A trace's entries as ``_traced`` writes them (each call's own time at a fixed place, a choice's context and
    full choices and a round's verdicts after it): the policy's µs a chosen step per call; traces from before the
    own times (shorter entries) count none."""
    from bench.adaptive_ab import summary

    trace = [["choose", 1.0, 8, 3, 0, 2e-6, 100, 1], ["launch", 1.0, 0.0, True, 1e-6],
             ["choose", 1.001, 8, 3, 0, 4e-6, 108, 1], ["launch", 1.001, 0.0, True, 1e-6],
             ["observe", 3e-6, 3, [1, 2, 3, 0, 1, 2, 3, 3]]]
    res = {"rows": {"no_spec": [{"decode_tok_s": 100.0, "median_step_ms": 2.0}],
                    "adaptive": [{"decode_tok_s": 95.0, "median_step_ms": 2.1}]},
           "trace": {"adaptive": trace}}
    assert summary(res)["adaptive"]["policy_us_per_step"] == {"choose": 3.0, "launch": 1.0, "observe": 1.5,
                                                              "total": 5.5}


def test_indexer_sweep_choice_keeps_the_default_unless_beaten():
    """The table's indexer knobs: the fastest setting whose scores match, and the launch's default ({}) where none
    is faster than the default's own timing, a tie included (the sweep also times the default's own setting)."""
    from bench.sparse_attention import indexer_choice

    def row(bs, ms, bn=64, err=None, diff=0.0):
        return {"batch_size": bs, "mode": "decode", "rows": bs, "block_n": bn, "num_warps": 4, "l2_ahead": 2,
                "programs_per_sm": 8, "ms": ms, "max_rel_diff": None if err else diff, "error": err}

    records = [row(1, 0.0106), row(1, 0.0110, bn=128), {"batch_size": 1, "mode": "decode", "rows": 1,
                                                          "default": True, "ms": 0.0106},
               row(32, 0.1035, bn=128), row(32, 0.09, bn=256, diff=0.5), row(32, 0.08, bn=32, err="OutOfResources"),
               row(32, 0.1090), {"batch_size": 32, "mode": "decode", "rows": 32, "default": True, "ms": 0.1089}]
    got = indexer_choice(records)
    assert got[(1, "decode")] == {}
    assert got[(32, "decode")] == {"block_n": 128, "num_warps": 4, "l2_ahead": 2, "programs_per_sm": 8}


def test_draft_metadata_table_renders_old_and_new_files(tmp_path):
    """The draft rows' table: host time with the time to completion in brackets where a file has it (``done_us``);
    files from before that column (no ``done_us``, the oldest without the engine's round) render their one figure."""
    from bench.sparse_attention import report

    new = {"batch_size": 1, "steps": 4, "tokens_per_step": 1, "once_per_round_us": 21.7, "per_step_us": 720.5,
           "speedup": 33.18, "backend_round_us": 30.9,
           "done_us": {"once_per_round": 31.5, "per_step": 737.8, "backend_round": 41.0}, "graph_replay_equal": True}
    old = {k: v for k, v in new.items() if k != "done_us"}
    oldest = {k: v for k, v in old.items() if k != "backend_round_us"}
    meta = {"device": "x", "commit": "c", "command": "cmd", "rows": [], "draft_metadata": [new, old, oldest]}
    report(meta, tmp_path / "dm")
    lines = [ln for ln in (tmp_path / "dm.md").read_text().splitlines() if ln.startswith("| 1 | 4 |")]
    assert lines == ["| 1 | 4 | 21.7 (31.5) | 720.5 (737.8) | **33.18x** | 30.9 (41.0) | True |",
                     "| 1 | 4 | 21.7 | 720.5 | **33.18x** | 30.9 | True |",
                     "| 1 | 4 | 21.7 | 720.5 | **33.18x** | - | True |"]
