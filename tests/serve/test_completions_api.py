"""What evaluation clients send to /v1/completions: echo with logprobs (the prompt's logprobs from the prefill, equal
to transformers' log_softmax of the same checkpoint), max_tokens 0 with echo, batched prompts (strings or token-id
lists) with n choices each, streamed and not; and GET /v1/models/{id}."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from deployments.engine.tokenizer import load_tokenizer
from tests.serve.conftest import API_KEY, second_app


@pytest.fixture(scope="module")
def batch_client(server):
    """An app that takes a batch at once (the shared one queues two requests), speculating with the target as its
    draft, prefilling in chunks of 16 tokens; its outputs come over the long poll (the shared app's are pushed)."""
    args = {"output_channel": "poll",
            "engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 256, "max_num_seqs": 4,
                              "max_prefill_tokens": 16,
                              "speculative_config": {"method": "draft", "model": server["target"], "num_steps": 2}}}
    with second_app(server, "batch", args) as client:
        client.timeout = 120
        yield client


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_gives_the_prompts_logprobs(server, batch_client, hf_models):
    tok = load_tokenizer(server["target"])
    ids = torch.randint(4, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()  # 3 chunks of 16
    lsm = hf_prompt_logprobs(hf_models["llama"], ids)
    kw = dict(model="batch", prompt=ids, echo=True, logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    r = batch_client.completions.create(max_tokens=1, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - lsm[pos - 1, ids[pos]].item()) < 1e-4
        top = lp.top_logprobs[pos]
        want = lsm[pos - 1].topk(3).values.tolist()
        # (keyed by text: tokens that decode alike, as byte pieces do, keep the likelier one)
        allowed = want + [lsm[pos - 1, ids[pos]].item()]
        assert all(min(abs(v - a) for a in allowed) < 1e-4 for v in top.values())
        assert max(top.values()) == pytest.approx(want[0], abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert r.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=True))
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1

    # streamed: the prompt's chunk carries its logprobs, then the token's
    chunks = [c for c in batch_client.completions.create(max_tokens=1, stream=True, **kw) if c.choices]
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs) if None not in streamed[1:] else False
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text

    # max_tokens 0 with echo (as vLLM): the prompt alone, with its logprobs
    r0 = batch_client.completions.create(max_tokens=0, **kw)
    assert r0.choices[0].text == tok.decode(ids, skip_special_tokens=True)
    assert r0.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1])
    assert r0.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:  # without echo nothing would be answered
        batch_client.completions.create(model="batch", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_batched_prompts_equal_single_requests(batch_client, stream):
    prompts = ["def main():", "import os\n", "x = 1"]
    kw = dict(model="batch", max_tokens=6, temperature=0.8, seed=11, n=2, extra_body={"ignore_eos": True})
    single = [[c.text for c in sorted(batch_client.completions.create(prompt=p, **kw).choices,
                                      key=lambda c: c.index)] for p in prompts]
    want = [t for texts in single for t in texts]  # prompt i's choices at i*n .. i*n+n-1
    assert len(set(want)) > 1
    if stream:
        texts = [""] * len(want)
        usage = None
        for c in batch_client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                                 **kw):
            for ch in c.choices:
                texts[ch.index] += ch.text
            usage = c.usage or usage
    else:
        r = batch_client.completions.create(prompt=prompts, **kw)
        assert [c.index for c in r.choices] == list(range(len(want)))
        texts, usage = [c.text for c in r.choices], r.usage
    assert texts == want
    tok_counts = [batch_client.completions.create(prompt=p, **kw).usage.prompt_tokens for p in prompts]
    assert usage.prompt_tokens == sum(tok_counts) and usage.completion_tokens == 6 * len(want)


def test_batched_token_id_prompts_with_echo_and_logprobs(batch_client):
    """As lm-eval's loglikelihood requests with --batch_size: token-id lists, echo, logprobs 1, max_tokens 1."""
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    kw = dict(model="batch", echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    r = batch_client.completions.create(prompt=prompts, **kw)
    for i, p in enumerate(prompts):
        one = batch_client.completions.create(prompt=p, **kw).choices[0]
        c = r.choices[i]
        assert c.index == i and c.text == one.text
        assert c.logprobs.token_logprobs == pytest.approx(one.logprobs.token_logprobs)
        assert len(c.logprobs.token_logprobs) == len(p) + 1
    with pytest.raises(openai.BadRequestError) as e:  # a batch mixing strings and token ids
        httpx_post(batch_client, {"model": "batch", "prompt": ["a", [5, 6]], "max_tokens": 1})
    assert e.value.body["param"] == "prompt"  # (the union field, not the member type pydantic tried)


def httpx_post(client, body: dict):
    return client.post("/completions", body=body, cast_to=httpx.Response)


def test_the_poll_channel_streams_what_the_push_channel_does(server, batch_client):
    """The same seeded stream from the shared app (output_channel push) and from this one (poll): the same tokens,
    in as many chunks as tokens came, and both ended."""
    push = openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(prompt="def main():", max_tokens=12, temperature=0.8, seed=5, logprobs=1, stream=True,
              extra_body={"ignore_eos": True})
    got = {}
    for name, client in (("tiny", push), ("batch", batch_client)):
        chunks = [c.choices[0] for c in client.completions.create(model=name, **kw) if c.choices]
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        got[name] = [t for c in chunks for t in c.logprobs.tokens]
        assert len(chunks) > 1
    assert got["tiny"] == got["batch"] and len(got["tiny"]) == 12


def test_models_retrieve(server):
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0)
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model" and m.owned_by == "specserve"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
