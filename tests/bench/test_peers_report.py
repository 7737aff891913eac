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
