"""What the HTTP API builds on, offline: chat prompts tokenized as vLLM does (the template's BOS only), chat-template
refusals as a precise error, generation_config.json (sampling defaults, extra end-of-sequence ids), a stop string
that ends on the last allowed token reports "stop", the default max_tokens fits the KV cache, and sampled-token
logprobs travel with each step's tokens."""

from __future__ import annotations

import shutil

import pytest

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.engine.tokenizer import (
    ChatTemplateError,
    chat_prompt_ids,
    load_tokenizer,
)
from tests.helpers import llama3_style
from workers.config import EngineConfig
from workers.model_config import ModelConfig


@pytest.fixture(scope="module")
def variant(tiny_models, tmp_path_factory):
    return llama3_style(tiny_models["llama"], tmp_path_factory.mktemp("variant") / "llama3-style")


def test_chat_prompt_has_one_bos(variant):
    tok = load_tokenizer(str(variant))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = chat_prompt_ids(tok, msgs)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered)[:2] == [tok.bos_token_id] * 2  # what encoding with special tokens would give
    assert tok.decode(ids) == rendered


def test_chat_template_refusal_is_a_precise_error(variant):
    tok = load_tokenizer(str(variant))
    with pytest.raises(ChatTemplateError, match="tool messages are not supported"):
        chat_prompt_ids(tok, [{"role": "tool", "content": "x"}])


def test_generation_config_defaults_and_eos(variant, tiny_models):
    cfg = ModelConfig.from_pretrained(variant)
    assert cfg.sampling_defaults == {"temperature": 0.0, "top_p": 0.9}
    assert 7 in cfg.eos_token_ids and ModelConfig.from_pretrained(tiny_models["llama"]).eos_token_ids == (1,)
    engine = Engine(EngineConfig(model=str(variant), device="cpu", max_model_len=256))
    assert engine.sampling_defaults == {"temperature": 0.0, "top_p": 0.9} and 7 in engine.scheduler.eos_token_ids
    (variant / "generation_config.json").write_text("{broken")
    try:
        with pytest.raises(Exception, match="not valid JSON"):
            ModelConfig.from_pretrained(variant)
    finally:
        shutil.copy(tiny_models["llama"] / "generation_config.json", variant / "generation_config.json")


def test_stop_string_on_the_last_allowed_token_reports_stop(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_model_len=256))
    prompt = "def main():"
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = engine.generate([prompt], greedy)[0].token_ids
    tok = engine.tokenizer
    tried = 0
    for k in range(2, len(ids)):  # a stop string that first completes with token k
        before, text = tok.decode(ids[: k - 1], skip_special_tokens=True), tok.decode(ids[:k], skip_special_tokens=True)
        if len(text) - len(before) < 1 or not text.startswith(before):
            continue
        stop = text[len(before) - 1:] if before else text  # spans the boundary: not complete before token k
        if stop in before or not stop.strip():
            continue
        out = engine.generate([prompt], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True,
                                                       stop=[stop]))[0]
        assert out.finish_reason == "stop", (k, stop, out)
        assert out.text == text[: text.index(stop)]
        tried += 1
    assert tried >= 3


def test_default_max_tokens_fits_the_kv_cache(tiny_models):
    # a cache of 64 tokens under a 256-token context: a request without max_tokens is served to the cache's end
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_model_len=256, page_size=4,
                                 kv_cache_tokens=64))
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert out.error is None and out.finish_reason == "length"
    assert len(out.token_ids) == 64 - engine.executor.lookahead - 4


def test_logprobs_travel_with_the_tokens(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_model_len=256))
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True))
    plain = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    got, none = [], []
    while engine.has_work():
        for out in engine.step():
            (got if out.rid == req.rid else none).extend(out.new_logprobs)
            if out.rid == req.rid:
                assert len(out.new_logprobs) == len(out.new_token_ids)
    assert got == req.output_logprobs and len(got) == 6 and all(lp <= 0 for lp in got)
    assert none == []  # not asked for: nothing extra per step


def test_arrival_time_is_when_the_server_received_the_request(tiny_models):
    """The controller stamps a request before it waits for the engine lock; TTFT and latency start there."""
    import time

    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_model_len=256))
    received = time.time() - 5.0
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), arrival_time=received)
    assert req.arrival_time == received
    assert engine.add_request([5, 6], SamplingParams(max_tokens=2)).arrival_time > received + 4.0


def test_a_request_in_chunked_prefill_counts_as_running(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", max_model_len=256,
                                 max_prefill_tokens=16))
    engine.add_request(list(range(5, 45)), SamplingParams(max_tokens=2))  # 40 prompt tokens: three chunks
    stats = engine.step_stats()
    assert (stats["running"], stats["waiting"]) == (0, 1)
    engine.step()  # the first chunk
    stats = engine.step_stats()
    assert (stats["running"], stats["waiting"]) == (1, 0)
