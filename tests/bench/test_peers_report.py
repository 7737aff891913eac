"""bench.peers.report: the peer table's rows and ratios from two engines' runs (ratios always read 'how many times
faster specserve is', whether the metric is a time or a rate)."""

from bench.peers.report import rows


def _run(engine, **kw):
    return {"engine": engine, "model": "/tmp/m", "spec": "none", "device": "GPU", "command": "c", **kw}


def test_ratios_read_as_specserve_speed_over_vllm_speed():
    runs = [_run("vllm", mode="decode", bs1={"decode_ms_per_token": 6.0}, throughput={"64": {"output_tok_s": 100.0}}),
            _run("specserve", mode="decode", bs1={"decode_ms_per_token": 5.0},
                 throughput={"64": {"output_tok_s": 80.0}})]
    by_metric = {r["metric"]: r for r in rows(runs)}
    assert by_metric["bs=1 decode ms/token"]["ours_faster_x"] == 1.2  # less time is faster
    assert by_metric["64 requests x (128 in, 256 out), output tok/s"]["ours_faster_x"] == 0.8  # fewer tok/s is slower


def test_tiny_rows_count_equal_greedy_outputs_and_keep_accept_lengths():
    tiny_v = {"1": {"tok_s": 10.0, "token_ids": [[1, 2], [3, 4], [5]], "accept_length": 3.0}}
    tiny_s = {"1": {"tok_s": 30.0, "requests": 3, "token_ids": [[1, 2], [3, 9], [5]], "accept_length": 2.5}}
    runs = [_run("vllm", mode="tiny", spec="eagle3", tiny=tiny_v), _run("specserve", mode="tiny", spec="eagle3",
                                                                        tiny=tiny_s)]
    by_metric = {r["metric"]: r for r in rows(runs)}
    assert by_metric["3 held-out prompts at bs 1, tok/s"]["ours_faster_x"] == 3.0
    assert by_metric["greedy outputs equal at bs 1 (of 3)"]["specserve"] == 2
    assert (by_metric["accept length (bs 1)"]["vllm"], by_metric["accept length (bs 1)"]["specserve"]) == (3.0, 2.5)


def test_a_setting_run_by_one_engine_only_gives_no_row():
    assert rows([_run("vllm", mode="decode", bs1={"decode_ms_per_token": 6.0})]) == []


# -- the served table ----------------------------------------------------------------------------------------------

def _level(c, tok_s, ttft=10.0, itl=5.0, tpot=6.0):
    return {"concurrency": c, "num_requests": 2 * c, "output_tok_s": tok_s, "ttft": {"median_ms": ttft},
            "itl": {"median_ms": itl}, "tpot": {"median_ms": tpot}}


def _sweep(engine, levels):
    return {"engine": engine, "model_id": "llama-3.1-8b-random", "rows": levels, "concurrencies": [1, 16],
            "input_len": 256, "output_len": 256, "device": "GPU", "commit": "abc", "command": "c"}


def test_served_rows_pair_levels_and_read_ratios_as_our_speed():
    from bench.peers.report import served_markdown, served_rows

    served = [_sweep("vllm", [_level(1, 100.0, ttft=20.0), _level(16, 1000.0)]),
              _sweep("specserve", [_level(1, 150.0, ttft=12.0), _level(16, 800.0), _level(64, 3000.0)])]
    table = {r["concurrency"]: r for r in served_rows(served)}
    assert table[1]["ours_faster_x"] == 1.5 and table[16]["ours_faster_x"] == 0.8
    assert (table[1]["vllm_ttft_p50_ms"], table[1]["specserve_ttft_p50_ms"]) == (20.0, 12.0)
    assert table[64]["vllm_tok_s"] is None and table[64]["ours_faster_x"] is None  # one engine ran it: no ratio
    assert table[64]["requests"] == 128
    md = "\n".join(served_markdown(list(table.values()), served))
    assert "| llama-3.1-8b-random | 1 (2) | 100.0 | 150.0 | 1.50x | 20.00 / 12.00 |" in md


def test_report_reads_a_runs_folder_into_offline_served_and_profile_tables(tmp_path):
    import json

    from bench.peers.report import load_runs

    (tmp_path / "vllm_decode8b.json").write_text(json.dumps(_run("vllm", mode="decode")))
    (tmp_path / "served_specserve_8b.json").write_text(json.dumps({k: v for k, v in _sweep("specserve", []).items()
                                                                    if k != "engine"}))
    (tmp_path / "floor_decode8b.json").write_text(json.dumps({"matmul_tflops": 700.0}))
    (tmp_path / "tiny_prompts.json").write_text(json.dumps({"source": "s", "prompts": [[1]]}))
    runs, served, floor = load_runs(tmp_path)
    assert [r["engine"] for r in runs] == ["vllm"]
    assert [s["engine"] for s in served] == ["specserve"]  # from the file name when the sweep does not say
    assert floor == {"matmul_tflops": 700.0}


def test_our_served_config_is_a_valid_application_with_the_offline_engine_settings():
    from bench.peers.served import specserve_config
    from bench.peers.workload import SPECSERVE_GPU_KWARGS
    from deployments.config import LLMConfig

    app = specserve_config("/tmp/llama-3.1-8b-random", "llama-3.1-8b-random", 8000)["applications"][0]
    cfg = LLMConfig(**app["args"])
    eng = cfg.engine_config()
    assert {k: getattr(eng, k) for k in SPECSERVE_GPU_KWARGS} == SPECSERVE_GPU_KWARGS
    assert eng.speculative_config is None and cfg.stream_batching_interval_ms == 0 and cfg.stream_interval == 1


# -- the profile: kernel classes and per-step differences ----------------------------------------------------------

def test_kernel_names_of_both_engines_fall_in_their_classes():
    from bench.peers.profile import kernel_class

    assert kernel_class("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
                        "flash::CollectiveMainloopFwdSm90<2, cute::tuple<>>>>>(...)") == "attention"
    assert kernel_class("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_class("_small_m_linear") == "gemm"
    assert kernel_class("_split_kv_attention") == "attention"
    assert kernel_class("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>") == "attention"
    assert kernel_class("_add_rms_norm") == "norm_rope_elementwise"
    assert kernel_class("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm_rope_elementwise"
    assert kernel_class("void vllm::rotary_embedding_kernel<c10::BFloat16, true>") == "norm_rope_elementwise"
    assert kernel_class("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
                        "at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>>") == "sampling"
    assert kernel_class("_argmax_lse_partial") == "sampling"
    assert kernel_class("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == "other"
    assert kernel_class("_uniform_tokens") == "other"


def test_summary_counts_overlapping_kernels_once_in_busy_time():
    from bench.peers.profile import summarize

    ks = [("gemm_a", "kernel", 0.0, 10.0), ("_rope_qk", "kernel", 8.0, 12.0), ("flash_fwd", "kernel", 20.0, 25.0)]
    s = summarize(ks)
    assert s["busy_us"] == 17.0 and s["wall_us"] == 25.0 and s["kernels"] == 3
    assert s["by_class_us"]["gemm"] == 10.0 and s["by_class_us"]["norm_rope_elementwise"] == 4.0
    assert s["by_class_us"]["attention"] == 5.0


def _fake_trace(path, calls):
    """A Chrome trace of calls (steps, step_us of gemm + 1 us of attention per step, a 10 us prefill), 0.5 s
    apart, gzipped as vLLM writes it."""
    import gzip
    import json

    events, t = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1e6}], 0.0
    for steps, gemm_us in calls:
        events.append({"ph": "X", "cat": "kernel", "name": "prefill_gemm", "ts": t, "dur": 10.0})
        t += 12.0
        for _ in range(steps):
            events.append({"ph": "X", "cat": "kernel", "name": "nvjet_tst", "ts": t, "dur": gemm_us})
            events.append({"ph": "X", "cat": "kernel", "name": "flash_fwd", "ts": t + gemm_us, "dur": 1.0})
            t += gemm_us + 2.0  # 1 us idle per step
        t += 5e5
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_profile_steps_takes_the_per_step_difference_of_two_profiled_calls(tmp_path):
    from bench.peers.profile import profile_markdown, profile_steps

    made = []

    def generate(prompts, n):
        made.append((len(prompts), n))

    def stop():
        # the profiled calls in order: bs 4 (n1, n2) with 3 us of GEMM per step, bs 8 with 5 us
        _fake_trace(tmp_path / "t.json.gz", [(n, 3.0 if bs == 4 else 5.0) for bs, n in made[-4:]])
        return tmp_path / "t.json.gz"

    res = profile_steps(generate, lambda: None, stop, lambda count, seed: [[seed]] * count, [4, 8], n1=2, n2=6,
                        reps=1)
    assert made[-4:] == [(4, 2), (4, 6), (8, 2), (8, 6)] and res["trace_segments"] == 4
    p4, p8 = res["batch_sizes"]["4"], res["batch_sizes"]["8"]
    assert p4["by_class_ms"]["gemm"] == 0.003 and p8["by_class_ms"]["gemm"] == 0.005  # prefill differenced away
    assert p4["by_class_ms"]["attention"] == 0.001 and p4["kernels_per_step"] == 2.0
    assert p4["busy_ms"] == 0.004 and p4["profiled_wall_ms"] == 0.005
    md = "\n".join(profile_markdown({"shape": "s", "matmul_params": 1e9, "matmul_tflops": 700.0, "matmul_method": "m",
                                     "copy_gb_s": 3000.0, "weight_read_floor_ms": 0.6,
                                     "batch_sizes": {"4": {"compute_floor_ms": 0.01, "cublas_linears_ms": 0.02}}},
                                    [{"engine": "vllm", "profile": res}]))
    assert "| 4 | vllm |" in md and "| 4 | 0.01 | 0.02 |" in md


def test_matmul_params_of_the_8b_shape():
    from bench.common import SHAPES
    from bench.peers.profile import matmul_params

    assert abs(matmul_params(SHAPES["llama-3.1-8b"]) - 7.50e9) < 0.01e9  # 8.03 B less the embedding table
