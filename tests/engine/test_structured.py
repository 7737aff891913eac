"""Structured output in the engine: outputs under random JSON schemas parse and validate, with and without
speculation; speculation changes no token under a grammar (greedy, and seeded sampling: verification draws from the
masked target distribution with the same noise); bad schemas are refused naming the field."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from deployments.engine.engine import Engine
from deployments.engine.grammar import GuidedSpec, tree_masks
from deployments.engine.request import InvalidRequest, SamplingParams
from deployments.make_heads import make_head
from workers.config import EngineConfig, SpeculativeConfig

N_SCHEMAS = 200


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A small object schema whose every instance is short: bounded strings, integers, arrays; enums; booleans."""
    props = {}
    for i in range(rng.randint(1, 2)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"] + (["object"] if depth == 0 else []))
        if kind == "string":
            props[f"s{i}"] = {"type": "string", "maxLength": rng.randint(0, 3)}
        elif kind == "integer":
            lo = rng.randint(-20, 50)
            props[f"i{i}"] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
        elif kind == "boolean":
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == "enum":
            props[f"e{i}"] = {"enum": rng.sample(["red", "green", "blue", "x", "long value"], rng.randint(1, 3))}
        elif kind == "array":
            item = rng.choice([{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9},
                               {"enum": ["a", "b"]}])
            props[f"a{i}"] = {"type": "array", "items": item, "maxItems": rng.randint(0, 2)}
        else:
            props[f"o{i}"] = random_schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = [random_schema(random.Random(i)) for i in range(N_SCHEMAS)]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("structured")
    target = tiny_models["llama"]
    # the target as its own draft: it drafts its unmasked choices, which verification accepts where the grammar
    # allows them, so masks at every depth decide (a random draft is rejected at the first draft most of the time)
    return {"target": target, "draft": target,
            "eagle3": make_head("eagle3", target, base / "eagle3", seed=2, draft_vocab=200)}


SPECS = {  # name: (method, num_steps, topk, num_draft_tokens)
    "none": None, "draft": ("draft", 3, 1, None), "eagle3": ("eagle3", 3, 1, None),
    "eagle3-tree": ("eagle3", 2, 3, 5), "ngram": ("ngram", 3, 1, None),
}


def engine(models, name: str, **kw) -> Engine:
    s = SPECS[name]
    spec = None if s is None else SpeculativeConfig(
        method=s[0], model=None if s[0] == "ngram" else str(models[s[0]]), num_steps=s[1], topk=s[2],
        num_draft_tokens=s[3])
    return Engine(EngineConfig(model=str(models["target"]), device="cpu", max_model_len=128, max_num_seqs=128,
                               max_prefill_tokens=1024, speculative_config=spec, **kw))


def run(eng: Engine, schemas: list[dict], temperature: float = 0.0):
    prompts = [[1 + (7 * i) % 400, 2 + i % 300, 3] for i in range(len(schemas))]
    params = [SamplingParams(max_tokens=96, temperature=temperature, seed=i,
                             guided=GuidedSpec("json_schema", json.dumps(s))) for i, s in enumerate(schemas)]
    return eng.generate(prompts, params)


def check_valid(outs, schemas) -> None:
    for o, s in zip(outs, schemas):
        assert o.finish_reason == "stop", (o.text, s)
        # (strict=False: xgrammar's JSON strings, like vLLM's outputs, may hold raw control characters other than
        # line breaks, which Python's strict parser refuses)
        jsonschema.validate(json.loads(o.text, strict=False), s)


@pytest.fixture(scope="module")
def greedy_reference(models):
    """Without speculation: every schema's greedy output, and (seeded, T = 1) a sampled one for a quarter of them."""
    eng = engine(models, "none")
    greedy = run(eng, SCHEMAS)
    check_valid(greedy, SCHEMAS)
    sampled = run(eng, SCHEMAS[::4], temperature=1.0)
    check_valid(sampled, SCHEMAS[::4])
    return [o.token_ids for o in greedy], [o.token_ids for o in sampled]


# (name, schemas greedy, schemas sampled): all 200 on the chain whose drafts are mostly accepted, fewer elsewhere
CASES = [("draft", SCHEMAS, SCHEMAS[::4]), ("eagle3", SCHEMAS[:32], SCHEMAS[:48:4]),
         ("eagle3-tree", SCHEMAS[:16], []), ("ngram", SCHEMAS[:16], [])]


@pytest.mark.parametrize("name,greedy_schemas,sampled_schemas", CASES, ids=[c[0] for c in CASES])
def test_speculation_under_a_schema_changes_no_token(models, greedy_reference, name, greedy_schemas,
                                                     sampled_schemas):
    greedy, sampled = greedy_reference
    eng = engine(models, name)
    out = run(eng, greedy_schemas)
    check_valid(out, greedy_schemas)
    assert [o.token_ids for o in out] == greedy[:len(greedy_schemas)]
    assert sum(o.spec["num_drafts"] for o in out) > 0  # drafts were verified under the masks
    if name == "draft":  # the target as its own draft: accepted drafts too (a random head's may all be rejected)
        assert sum(o.spec["num_accepted_tokens"] for o in out) > 0
    if sampled_schemas:
        out = run(eng, sampled_schemas, temperature=1.0)
        check_valid(out, sampled_schemas)
        assert [o.token_ids for o in out] == sampled[:len(sampled_schemas)]
    assert eng.step_time["grammar_s"] > 0


def test_json_object_regex_and_choice(models):
    eng = engine(models, "none")  # (with speculation over HTTP: tests/serve/test_structured.py)
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, guided=g) for i, g in enumerate([
        GuidedSpec("json_object"), GuidedSpec("regex", "[a-f]{3}-[0-9]{1,2}"),
        GuidedSpec("choice", ("alpha", "beta", "gamma delta"))])]
    obj, rx, choice = eng.generate([[5, 6, 7]] * 3, params)
    assert obj.finish_reason != "stop" or isinstance(json.loads(obj.text), dict)
    import re
    assert re.fullmatch("[a-f]{3}-[0-9]{1,2}", rx.text) and choice.text in ("alpha", "beta", "gamma delta")


@pytest.mark.parametrize("spec,fragment", [
    (GuidedSpec("json_schema", '{"type": 5}', "response_format"), "response_format"),
    (GuidedSpec("json_schema", "{not json", "guided_json"), "guided_json"),
    (GuidedSpec("regex", "a[", "guided_regex"), "guided_regex"),
    (GuidedSpec("choice", (), "guided_choice"), "guided_choice"),
])
def test_bad_grammars_are_refused_naming_the_field(models, spec, fragment):
    eng = engine(models, "none")
    with pytest.raises(InvalidRequest) as e:
        eng.add_request([1, 2, 3], SamplingParams(guided=spec))
    assert e.value.param == fragment and fragment in str(e.value)
    assert ".cc:" not in str(e.value), f"xgrammar's source location reached the client: {e.value}"
    assert not eng.has_work()


def test_tree_masks_follow_each_node_path(models):
    """Each node's mask is the matcher's after the drafts on its path; the matcher is left where it was."""
    eng = engine(models, "none")
    g = eng.grammar_engine()
    m = g.matcher(GuidedSpec("choice", ("ab", "ac", "b")))
    enc = eng.tokenizer.encode
    a, b_, c = enc("a", add_special_tokens=False)[0], enc("b", add_special_tokens=False)[0], \
        enc("c", add_special_tokens=False)[0]
    words = (g.vocab_size + 31) // 32
    # root, then children "a" and "b" of the root, and "c" under "a"
    tokens = np.array([[0, a, b_, c]])
    parents = np.array([[-1, 0, 0, 1]])
    masks = tree_masks([m], tokens, parents, words)

    def allowed(row):
        return {t for t in range(g.vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1}

    assert {a, b_} <= allowed(masks[0, 0]) and c not in allowed(masks[0, 0])
    assert {b_, c} <= allowed(masks[0, 1]) and a not in allowed(masks[0, 1])  # after "a"
    assert masks[0, 0].tolist() == tree_masks([m], tokens[:, :1], None, words)[0, 0].tolist()  # rolled back
    chain = tree_masks([m], np.array([[0, a, c]]), None, words)
    assert allowed(chain[0, 1]) == allowed(masks[0, 1])


def test_device_unpacking_matches_xgrammar():
    """The worker's unpacking of the packed mask (no xgrammar on the device side) equals xgrammar's own."""
    import torch
    import xgrammar as xgr

    from workers.token_mask import apply_token_mask

    g = torch.Generator().manual_seed(0)
    for v in (37, 512, 1000):
        logits = torch.randn(3, 2, v, generator=g)
        mask = torch.randint(-2**31, 2**31 - 1, (6, (v + 31) // 32), dtype=torch.int32, generator=g)
        ref = logits.reshape(6, v).clone()
        xgr.apply_token_bitmask_inplace(ref, mask)
        got = apply_token_mask(logits, mask.numpy().reshape(3, 2, -1))
        assert torch.equal(got.reshape(6, v), ref)
        assert apply_token_mask(logits, None) is logits


def test_batched_mask_fill_equals_one_by_one(models):
    """The masks filled on xgrammar's batch matcher (one call per step, or per chain depth) equal those filled one
    matcher at a time, for matchers mid-way through their schemas, terminated ones and rows without a grammar; the
    matchers are left where they were."""
    from deployments.engine.grammar import step_masks

    eng = engine(models, "none")
    g = eng.grammar_engine()
    words = (g.vocab_size + 31) // 32
    schemas = SCHEMAS[:6]
    outs = run(eng, schemas)
    matchers = []
    for k, (o, s) in enumerate(zip(outs, schemas)):
        m = g.matcher(GuidedSpec("json_schema", json.dumps(s)))
        cut = len(o.token_ids) if k == 0 else k * len(o.token_ids) // 6  # (the first: to its end, terminated)
        for t in o.token_ids[:cut]:
            assert m.accept_token(t)
        matchers.append((m, o.token_ids[cut:cut + 3]))
    ms = [m for m, _ in matchers] + [None]
    assert ms[0].is_terminated()
    one, batched = step_masks(ms, words), step_masks(ms, words, g.batch)
    assert np.array_equal(one, batched) and (one[-1] == -1).all()
    # chains: each request's own next tokens (taken), with one refused draft in the middle of a chain
    tokens = np.zeros((len(ms), 4), np.int64)
    for i, (_, nxt) in enumerate(matchers):
        tokens[i, 1:1 + len(nxt)] = nxt
    tokens[2, 2] = 0  # (token 0 is a special: no grammar takes it)
    ref = np.stack([tree_masks([m], tokens[i:i + 1], None, words)[0] if m is not None
                    else np.full((4, words), -1, np.int32) for i, m in enumerate(ms)])
    got = tree_masks(ms, tokens, None, words, g.batch)
    assert np.array_equal(ref, got)
    assert (got[2, 3] == -1).all() and not (got[1, 1] == -1).all()
    assert np.array_equal(step_masks(ms, words), one)  # rolled back


def _finish(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_work():
        eng.step()
    return reqs


@pytest.mark.parametrize("name", ["none", "draft", "eagle3"])
def test_guided_logprobs_are_the_raw_distributions(models, name):
    """A guided request's logprobs are the model's raw distribution's, as an unguided request's (and vLLM's by
    default), not the masked one renormalised (whose forbidden tokens would be -inf): each generated token's logprob
    equals its prompt logprob when prompt and output are sent back as a prompt; at some position the grammar forced a
    token other than the raw model's choice, and its logprob is still finite and below 0."""
    eng = engine(models, name)
    prompts = [[5, 6, 7], [40, 41], [300, 2, 9, 11]]
    guided = _finish(eng, prompts, SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, guided=GuidedSpec(
        "regex", "[a-f]{3}-[0-9]{1,2}")))
    free = _finish(eng, prompts, SamplingParams(max_tokens=1, temperature=0.0))
    forced = 0
    for p, g, f in zip(prompts, guided, free):
        assert len(g.output_logprobs) == len(g.output_ids) > 0
        back = _finish(eng, [p + g.output_ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
        raw = [e[0] for e in back.prompt_logprobs[len(p):]]
        assert np.allclose(g.output_logprobs, raw, atol=1e-4), (name, g.output_logprobs, raw)
        assert all(np.isfinite(g.output_logprobs)) and max(g.output_logprobs) <= 0
        forced += g.output_ids[0] != f.output_ids[0]
    assert forced  # (the grammar chose against the raw argmax: the case a masked logprob would get wrong)


@pytest.mark.parametrize("name", ["none", "draft"])
def test_output_ends_with_the_grammar_even_with_ignore_eos(models, name):
    """ignore_eos does not carry a guided request past its grammar's end (the masks allow every token there): it
    stops with the grammar, its text one of the choices; min_tokens, which would hold back the stop token a complete
    grammar needs, is refused naming it."""
    eng = engine(models, name)
    choices = ("alpha", "beta gamma")
    outs = eng.generate([[5, 6, 7]] * 4, [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True,
                                                         guided=GuidedSpec("choice", choices)) for i in range(4)])
    for o in outs:
        assert o.text in choices and o.finish_reason == "stop", (o.text, o.finish_reason)
        assert len(o.token_ids) < 40
    with pytest.raises(InvalidRequest, match="min_tokens") as e:
        eng.add_request([5, 6, 7], SamplingParams(max_tokens=40, min_tokens=5, guided=GuidedSpec("choice", choices)))
    assert e.value.param == "min_tokens"
