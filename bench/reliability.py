"""Reliability figures (issue #37): hostile requests, a huge body under load, and many streams at once, against a
running server.

1. **Fuzzing**: >= 2,000 requests from hypothesis strategies (mostly plausible requests to /v1/completions and
   /v1/chat/completions with hostile values, raw byte mutations, odd methods, headers and content types), sent
   with concurrency. Counted: 2xx / 4xx / 5xx, bodies not in OpenAI's shape (a 2xx that is not a valid response or
   stream, a 4xx that is not exactly ``{"error": {message, type, param, code}}``), bodies that leak internals
   (tracebacks, paths, addresses, pids, Ray ids), and hangs (no answer within the client's timeout).
2. **A 50 MB body** (with Content-Length, and chunked without one): time to the 413, while other streams run:
   their inter-token gaps (p50 / max) before and during, and the RSS of the server's processes (HTTP proxy,
   ingress, controller, engine core) before and after each.
3. **500 concurrent streams**: none lost, every token once (the streamed text and token count equal the same
   prompt's non-streamed greedy answer), KV back to 0.
4. **A worker's SIGKILL**, quiet and with 32 streams running (their clients start again when refused): the time
   from the kill to the first successful completion and until every client streams again; how the cut streams
   ended; whether the engine core's process stayed (no replica replacement). Last: it restarts the workers, at
   most 3 times in 5 minutes before the engine gives up on its replica (so at most 3 kills a run).

    serve run configs/local.yaml &   # then:
    python3 -m bench.reliability --server-config configs/local.yaml --out bench/results/reliability/cpu_local
    python3 -m bench.reliability --config configs/local.yaml --out ...   # starts the application in this process

The request strategies and the response checks are shared with tests/serve/test_reliability.py.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from bench.common import ROOT, command, commit, out_path, write_json, write_markdown

# -- requests ---------------------------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SURROGATE = b"\xed\xa0\x80"  # a lone surrogate (U+D800) as raw bytes: not UTF-8


@dataclass(frozen=True)
class Probe:
    """One HTTP request as sent: method, path, headers, body (None: no body); ``chunked`` sends the body without a
    Content-Length."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None
    chunked: bool = False

    def __repr__(self) -> str:
        body = self.body if self.body is None or len(self.body) <= 600 else (
            self.body[:600] + f"... ({len(self.body)} bytes)".encode())
        return f"Probe({self.method} {self.path} headers={list(self.headers)} chunked={self.chunked} body={body!r})"

    @property
    def wants_stream(self) -> bool:
        """The body asks for a stream (as the server's JSON parser would read it)."""
        from pydantic import TypeAdapter

        try:  # (pydantic's lax bool, as the server reads it: 1, "true", "yes" ... are true)
            return TypeAdapter(bool).validate_python(json.loads(self.body).get("stream")) is True
        except Exception:  # noqa: BLE001 - not JSON, not an object, not a bool
            return False


HUGE_INTS = [2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1.5, 0.5]
leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(HUGE_INTS),
                 st.sampled_from(ODD_FLOATS), st.floats(), st.text(max_size=12))
junk = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)


def either(*options) -> st.SearchStrategy:
    """One of ``options``: strategies as they are, plain values as they are (a strategy inside a plain value is
    refused: it would be sent as the object, not drawn, and only on the run that draws it)."""
    values = [v for v in options if not isinstance(v, st.SearchStrategy)]
    strategies = [v for v in options if isinstance(v, st.SearchStrategy)]
    for v in values:
        _plain(v)
    return st.one_of([st.sampled_from(values)] * bool(values) + strategies)


def _plain(value) -> None:
    if isinstance(value, st.SearchStrategy):
        raise TypeError(f"a strategy inside a plain value: {value!r} (build the value with st.builds)")
    for v in value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ():
        _plain(v)


def bad(*odd) -> st.SearchStrategy:
    """A hostile value: one of ``odd`` (values or strategies), or junk of any JSON type."""
    return st.one_of(either(*odd), either(*odd), junk)


CODE = ["def main():", "import os\n", "hello", "class A:", " ", "\n\n", "x = 1", "\u00e9\u4e2d\U0001f600", "<|im_end|>",
        "\x00", "\t\r\n"]
# text a tokenizer takes: any Unicode scalar (no lone surrogates), short or now and then long
good_text = st.one_of(st.sampled_from(CODE), st.sampled_from(CODE), st.text(st.characters(codec="utf-8"), min_size=1,
                                                                           max_size=30),
                      st.builds(lambda c, n: c * n, st.sampled_from(["a", "\u00e9", "\U0001f600", " ", "<s>"]),
                                st.sampled_from([100, 1_000, 20_000])))
lone = st.builds(lambda a, s, b: a + s + b, st.sampled_from(["", "x", "\u00e9"]),
                 st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2),
                 st.sampled_from(["", " lone"]))


@functools.lru_cache
def fields(chat: bool, vocab: int) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """Each optional field's (valid values, hostile values)."""
    token = st.integers(0, vocab - 1)
    return {
        "max_tokens": (st.integers(1 - (not chat), 4), bad(0, -1, 5000, 2**31, 2**63, 10**30, 2.5, "3", math.nan, [4])),
        "temperature": (st.one_of(st.floats(0, 2), st.sampled_from([0, 0.0, 2, 1e-30, 5e-324, 1e-6])),
                        bad(-1, 2.01, "0.5", *ODD_FLOATS[:5], [1.0])),
        "top_p": (st.one_of(st.floats(1e-6, 1), st.just(1)), bad(0, -0.5, 1.01, *ODD_FLOATS[:4])),
        "top_k": (st.one_of(st.integers(-1, 50), st.sampled_from([vocab, vocab + 1, 2**63 - 1])),
                  bad(-2, -(2**63), 2**64, 10**30, 1.5, "5")),
        "min_p": (st.floats(0, 1), bad(-0.1, 1.1, *ODD_FLOATS[:4])),
        "n": (st.integers(1, 3), bad(0, -1, 129, 2**31, 2**63, 10**30, 1.5, "two")),
        "stop": (st.one_of(good_text, st.lists(good_text, max_size=4), st.none()),
                 bad("", [""], [1, 2], [["a"]], [None], lone, st.lists(lone, min_size=1, max_size=2),
                     ["a"] * 1000, "s" * 100_000)),
        "stream": (st.booleans(), bad(1, 0, "true", "yes", [True])),
        "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                               "continuous_usage_stats": st.booleans()}),
                           bad({"include_usage": "sure"}, {"include_usage": [1]}, [], "usage", 5)),
        "seed": (st.integers(-(2**63), 2**63 - 1), bad(2**63, -(2**63) - 1, 10**30, 1.5, "7", math.inf)),
        "user": (st.text(max_size=10), bad(lone, 5, ["u"])),
        "frequency_penalty": (st.sampled_from([0, 0.0, None]), bad(0.5, -2, *ODD_FLOATS[:3])),
        "presence_penalty": (st.sampled_from([0, None]), bad(1.0, *ODD_FLOATS[:3])),
        "repetition_penalty": (st.sampled_from([1, 1.0, None]), bad(1.2, 0, *ODD_FLOATS[:3])),
        "logit_bias": (st.sampled_from([{}, None]), bad({"5": 1.0}, {"x": math.nan}, {"5": "a"}, [1], {"5": 1e308})),
        "response_format": (st.sampled_from([{"type": "text"}, None]),
                            bad({"type": "json_object"}, {"type": 5}, {"type": []}, {"type": {"a": 1}}, "json", {})),
        "tools": (st.sampled_from([None, []]), bad([{"type": "function", "function": {"name": "f"}}], [1], {})),
        "tool_choice": (st.sampled_from(["none", "auto", None]), bad("required", {"type": "function"}, 5, [])),
        "ignore_eos": (st.booleans(), bad(1, "no", [False])),
        "stop_token_ids": (st.lists(token, max_size=3), bad([-1], [vocab], [2**63], [10**30], ["1"], [[1]], [1.5])),
        "model": (st.none(), bad("other-model", "", "\ud800", "m" * 5000, 5, ["m"])),
        **({"logprobs": (st.booleans(), bad(5, "yes", [True])),
            "top_logprobs": (st.integers(0, 5), bad(20, 21, -1, 2**63, 1.5)),
            "max_completion_tokens": (st.integers(1, 4), bad(0, -1, 2**63, "2", 10**30))} if chat else
           {"logprobs": (st.integers(0, 5), bad(20, 21, -1, True, 2**63, 10**30, 1.5, "1")),
            "echo": (st.booleans(), bad(1, "true", [True])),  # with logprobs: the prompt's logprobs too
            "best_of": (st.sampled_from([None, 1]), bad(2, 0, -1, 2**63, "1")),
            "suffix": (st.sampled_from([None, ""]), bad("x", 5, [""]))}),
    }


@functools.lru_cache
def prompts(vocab: int) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(valid prompts, hostile prompts) of the completions API."""
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)
    # batches: several strings or several token-id lists, each answered with its own n choices
    good = st.one_of(good_text, good_text, ids, st.builds(lambda t: [t], good_text), st.builds(lambda t: [t], ids),
                     st.lists(good_text, min_size=2, max_size=4), st.lists(ids, min_size=2, max_size=4))
    return good, bad("", [], [[]], [""], [-1], [vocab], [2**63], [10**30], [1.5], [True], [["a"]], [None],
                     {"text": "hi"}, lone, st.builds(lambda t: [t], lone), [vocab - 1] * 300, "a " * 2000,
                     st.lists(st.integers(), min_size=1, max_size=4),
                     # batches with a bad member, mixed kinds, too many prompts
                     ["a", [1, 2]], [[1, 2], "a"], [[1], []], ["a", ""], [[1], [vocab]], [[1], [-1]],
                     st.builds(lambda t: ["a", t], lone), [[1, 2], [[3]]], ["a", None], ["a"] * 1025)


@functools.lru_cache
def messages() -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(valid message lists, hostile ones) of the chat API."""
    text_part = st.fixed_dictionaries({"type": st.just("text"), "text": good_text})
    good_content = st.one_of(good_text, good_text, st.lists(text_part, min_size=1, max_size=3), st.just(""))
    role = st.sampled_from(["user", "user", "system", "assistant", "developer"])
    good_message = st.fixed_dictionaries({"role": role, "content": good_content},
                                         optional={"name": st.text(max_size=6)})
    good = st.lists(good_message, min_size=1, max_size=4).map(lambda ms: [*ms[:-1], {**ms[-1], "role": "user"}])
    odd_part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": bad(5, None, ["a"], {}, lone)}),
        st.sampled_from([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                         {"type": "input_audio"}, {"type": "text"}, {"text": "no type"}, {"type": None},
                         {"type": ["text"]}, 5, "text", None, []]))
    odd_message = st.fixed_dictionaries(
        {"role": bad("tool", "function", "robot", "", None, 5, "USER", role),
         "content": st.one_of(good_content, bad(None, 5, {"text": "a"}, [[]], lone, st.lists(odd_part, min_size=1,
                                                                                              max_size=3)))},
        optional={"name": junk, "tool_calls": junk, "extra": junk})
    hostile = st.one_of(st.lists(st.one_of(good_message, odd_message), min_size=1, max_size=4),
                        bad([], {}, "hello", [None], [5], [["user", "hi"]], [{"content": "no role"}],
                            [{"role": "user"}]))
    return good, hostile


@st.composite
def request_bodies(draw, chat: bool, model_id: str, vocab: int) -> dict | list | str | int | None:
    """A request body as a JSON value. Mostly an object: valid throughout, or with one hostile value, or with
    several and unknown fields; now and then another JSON document or an object without the required field."""
    mode = draw(st.sampled_from(["valid"] * 10 + ["one_bad"] * 6 + ["chaos"] * 3 + ["shape"]))
    if mode == "shape":
        return draw(st.one_of(st.lists(junk, max_size=3), leaf, st.just({}), st.dictionaries(st.text(max_size=8), junk,
                                                                                              max_size=3)))
    table = fields(chat, vocab)
    required = "messages" if chat else "prompt"
    good_required, bad_required = messages() if chat else prompts(vocab)
    names = sorted(table)
    chosen = draw(st.lists(st.sampled_from(names), max_size=6, unique=True))
    body = {required: draw(good_required)}
    for name in chosen:
        body[name] = draw(table[name][0])
    if mode == "one_bad":
        name = draw(st.sampled_from([required] * 4 + names))
        body[name] = draw(bad_required if name == required else table[name][1])
    elif mode == "chaos":
        for name in draw(st.lists(st.sampled_from([required, *names]), min_size=2, max_size=6, unique=True)):
            body[name] = draw(bad_required if name == required else table[name][1])
        body.update(draw(st.dictionaries(st.text(max_size=8), junk, max_size=3)))  # unknown fields
    if "model" not in chosen and draw(st.booleans()):
        body["model"] = model_id
    if "max_tokens" not in body and "max_completion_tokens" not in body and (chat or draw(st.integers(0, 9))):
        body["max_tokens"] = draw(st.integers(1, 4))  # short generations (unset, chat runs to the context's end)
    if "stream" not in body and mode != "chaos" and draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    if body.get("stream") is True and "stream_options" not in body and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return body


def _dump(value, ascii_only: bool, sort: bool) -> bytes:
    """JSON bytes as a client might send them: NaN/Infinity as Python writes them, non-ASCII either escaped or raw
    UTF-8 (a lone surrogate then becomes the raw bytes ED A0 80, which is not UTF-8)."""
    return json.dumps(value, ensure_ascii=ascii_only, sort_keys=sort).encode("utf-8", "surrogatepass")


@st.composite
def raw_mutation(draw, body: bytes) -> bytes:
    """A byte-level change to a JSON body: truncation, invalid UTF-8 or a raw surrogate inside it, a duplicate key,
    deep nesting, binary or empty bodies, other top-level documents."""
    kind = draw(st.sampled_from(["truncate", "inject", "duplicate", "deep", "deep_field", "binary", "empty", "utf16",
                                 "bom", "null", "trailing"]))
    if kind == "truncate":
        return body[: draw(st.integers(0, max(0, len(body) - 1)))]
    if kind == "inject":  # into the middle of the first string value, or anywhere
        junk_bytes = draw(st.sampled_from([SURROGATE, b"\xed\xbf\xbf", b"\xff\xfe", b"\xc0\x80", b"\x80", b"\x00",
                                           b"\xf4\x90\x80\x80", b"\\ud800", b"\\u", b'\\"', b"\x1b[31m"]))
        at = body.find(b'": "')
        pos = at + 4 if at >= 0 and draw(st.booleans()) else draw(st.integers(0, len(body)))
        return body[:pos] + junk_bytes + body[pos:]
    if kind == "duplicate":  # the same key twice, with a different (possibly wrong-typed) value
        if body.startswith(b"{") and len(body) > 2:
            key = draw(st.sampled_from([b"prompt", b"messages", b"max_tokens", b"stream", b"n", b"model"]))
            value = draw(st.sampled_from([b"5", b"null", b'"x"', b"[]", b"true", b"1e999"]))
            first = draw(st.booleans())
            dup = b'"' + key + b'": ' + value
            return b"{" + dup + b", " + body[1:] if first else body[:-1] + b", " + dup + b"}"
        return body
    if kind == "deep":
        depth = draw(st.sampled_from([100, 1_000, 10_000, 100_000]))
        return b"[" * depth + b"]" * depth
    if kind == "deep_field":
        depth = draw(st.sampled_from([50, 500, 5_000]))
        name = draw(st.sampled_from([b"prompt", b"messages", b"stop", b"stream_options", b"unknown"]))
        return b'{"' + name + b'": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b', "max_tokens": 2}'
    if kind == "binary":
        return draw(st.binary(min_size=1, max_size=64))
    if kind == "empty":
        return b""
    if kind == "utf16":
        return body.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
    if kind == "bom":
        return b"\xef\xbb\xbf" + body
    if kind == "null":
        return draw(st.sampled_from([b"null", b"[]", b"5", b'"x"', b"{}", b"{", b"}", b"NaN", b"Infinity"]))
    return body + draw(st.sampled_from([b" garbage", b"{}", b"\x00", b"\n\n"]))


CONTENT_TYPES = ["application/json"] * 60 + [None, "text/plain", "application/x-www-form-urlencoded",
                                             "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                             "application/json; charset=utf-16", "application/jsonx", "*/*", ""]


@st.composite
def probes(draw, model_id: str, vocab: int, api_key: str | None) -> Probe:
    """One hostile request to /v1/completions or /v1/chat/completions (now and then another path or method)."""
    chat = draw(st.booleans())
    path = CHAT if chat else COMPLETIONS
    method = "POST"
    if draw(st.integers(0, 24)) == 0:
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    if draw(st.integers(0, 24)) == 0:
        path = draw(st.sampled_from([path + "/", path + "?stream=true", "/v1//completions", "/v1/completions/x",
                                     "/v1/%ff", "/v1/chat", "/v1/models", "/v1/stats", "/V1/completions",
                                     f"/v1/models/{model_id}", "/v1/models/other", "/v1/models/",
                                     "/v1/models/a/b"]))
    value = draw(request_bodies(chat, model_id, vocab))
    body = _dump(value, draw(st.booleans()), draw(st.booleans()))
    if draw(st.integers(0, 7)) == 0:
        body = draw(raw_mutation(body))
    headers = []
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    if api_key is not None:
        auth = draw(st.sampled_from([f"Bearer {api_key}"] * 30 + [None, "Bearer", f"bearer {api_key}", api_key,
                                                                   f"Bearer {api_key}x", "Basic Zm9vOmJhcg=="]))
        if auth is not None:
            headers.append(("Authorization", auth))
    if draw(st.integers(0, 15)) == 0:
        headers.append(draw(st.sampled_from([("Accept", "text/event-stream"), ("Accept-Encoding", "gzip"),
                                             ("Content-Encoding", "gzip"), ("Expect", "100-continue"),
                                             ("X-Request-Id", "\u00c3\u00a9"), ("Connection", "close")])))
        # (é as UTF-8 bytes: Ray Serve's proxy answers a request id that is not UTF-8 with its own plain 500, before
        # the application runs; tests/serve/test_reliability.py pins that)
    no_body = method in ("GET", "HEAD", "OPTIONS") and draw(st.booleans())
    return Probe(method, path, tuple(headers), None if no_body else body, chunked=draw(st.integers(0, 15)) == 0)


# -- checks -----------------------------------------------------------------------------------------------------

# What no answer may show: a traceback, a source location, a pid, an IP address, paths of the install, Ray's ids
LEAKS = [
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("source location", re.compile(r'File "')),
    ("pid", re.compile(r"\bpid[=: ]+\d+", re.I)),
    ("IP address", re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")),
    ("install path", re.compile("|".join(re.escape(p) for p in {str(ROOT), "site-packages", "/tmp/ray", "/usr/lib/"}))),
    ("Ray internals", re.compile(r"ActorID|actor_id|ray::|RayTaskError|ServeReplica|node_id|NodeID|ObjectRef")),
]


def leaks(text: str) -> list[str]:
    return [name for name, pattern in LEAKS if pattern.search(text)]


FINISH = {"stop", "length"}


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(data: bytes | str):
    """JSON as RFC 8259 has it: NaN and Infinity (which Python writes and reads) are refused."""
    return json.loads(data, parse_constant=_no_constant)


def openai_error_problem(body: bytes) -> str | None:
    """None when ``body`` is exactly OpenAI's error object."""
    try:
        doc = strict_json(body)
    except ValueError:
        return f"error body is not JSON: {body[:200]!r}"
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(doc["error"], dict):
        return f"error body is not {{'error': {{...}}}}: {body[:200]!r}"
    err = doc["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error object has keys {sorted(err)}"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return "error message/type not strings"
    if err["param"] is not None and not isinstance(err["param"], str):
        return "error param neither a string nor null"
    if err["code"] is not None and not isinstance(err["code"], (str, int)):
        return "error code neither a string, an int nor null"
    return None


def _usage_problem(usage) -> str | None:
    if not isinstance(usage, dict) or not all(isinstance(usage.get(k), int) and usage[k] >= 0 for k in
                                              ("prompt_tokens", "completion_tokens", "total_tokens")):
        return f"bad usage {usage!r}"
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return f"usage does not add up: {usage}"
    return None


def _first_echoed_as_number(doc: dict) -> dict:
    """An echoed prompt's first token has no logprob: null in ``token_logprobs`` and ``top_logprobs`` (as OpenAI's
    legacy API and vLLM answer), which the client's types (floats) do not declare; only that first entry may be."""
    doc = json.loads(json.dumps(doc))
    for c in doc.get("choices") or []:
        lp = c.get("logprobs") if isinstance(c, dict) else None
        if isinstance(lp, dict) and lp.get("token_logprobs") and lp["token_logprobs"][0] is None:
            lp["token_logprobs"][0] = 0.0
            if lp.get("top_logprobs") and lp["top_logprobs"][0] is None:
                lp["top_logprobs"][0] = {}
    return doc


def response_problem(body: bytes, chat: bool) -> str | None:
    """None when ``body`` is a valid (non-streamed) completion or chat completion."""
    try:
        doc = strict_json(body)
    except ValueError:
        return f"2xx body is not JSON: {body[:200]!r}"
    if not isinstance(doc, dict) or "error" in doc:
        return f"2xx body is not a response: {body[:200]!r}"
    want = "chat.completion" if chat else "text_completion"
    if doc.get("object") != want or not isinstance(doc.get("id"), str) or not isinstance(doc.get("created"), int):
        return f"2xx body's object/id/created: {body[:200]!r}"
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices:
        return "no choices"
    if sorted(c.get("index") for c in choices) != list(range(len(choices))):
        return "choice indices are not 0..n-1"
    for c in choices:
        if c.get("finish_reason") not in FINISH:
            return f"finish_reason {c.get('finish_reason')!r}"
        if chat:
            m = c.get("message")
            if not isinstance(m, dict) or m.get("role") != "assistant" or not isinstance(m.get("content"), str):
                return f"bad message {m!r}"
        elif not isinstance(c.get("text"), str):
            return "choice text is not a string"
    try:  # the official client's types accept it
        from openai.types import Completion
        from openai.types.chat import ChatCompletion

        (ChatCompletion if chat else Completion).model_validate(doc if chat else _first_echoed_as_number(doc))
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError
        return f"openai's types refuse it: {str(e)[:300]}"
    return _usage_problem(doc.get("usage"))


def stream_problem(body: bytes, chat: bool) -> str | None:
    """None when ``body`` is a valid SSE stream of completion (or chat) chunks ending with ``data: [DONE]``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "stream is not UTF-8"
    events = [e for e in text.split("\n\n") if e.strip()]
    if not events or events[-1] != "data: [DONE]" or not text.endswith("\n\n"):
        return f"stream does not end with data: [DONE]: {text[-200:]!r}"
    want = "chat.completion.chunk" if chat else "text_completion"
    finished: set[int] = set()
    for event in events[:-1]:
        if not event.startswith("data: ") or "\n" in event:
            return f"not one SSE data line: {event[:200]!r}"
        try:
            chunk = strict_json(event[6:])
        except ValueError:
            return f"SSE data is not JSON: {event[:200]!r}"
        if "error" in chunk:
            return f"error event in a 2xx stream: {event[:300]!r}"
        if chunk.get("object") != want or not isinstance(chunk.get("choices"), list):
            return f"bad chunk: {event[:200]!r}"
        if not chunk["choices"]:
            problem = _usage_problem(chunk.get("usage"))
            if problem:
                return problem
        for c in chunk["choices"]:
            if c.get("finish_reason") not in FINISH | {None}:
                return f"finish_reason {c.get('finish_reason')!r}"
            if c.get("index") in finished:
                return f"choice {c.get('index')} continued after it finished"
            if c.get("finish_reason"):
                finished.add(c["index"])
            if chat:
                if not isinstance(c.get("delta"), dict):
                    return "chat chunk without a delta"
                try:
                    from openai.types.chat import ChatCompletionChunk

                    ChatCompletionChunk.model_validate(chunk)
                except Exception as e:  # noqa: BLE001
                    return f"openai's types refuse a chunk: {str(e)[:300]}"
            elif not isinstance(c.get("text"), str):
                return "chunk text is not a string"
    if not finished:
        return "no choice finished"
    if sorted(finished) != list(range(len(finished))):
        return f"finished choices {sorted(finished)}"
    return None


@dataclass
class Outcome:
    probe: Probe
    status: int | None = None  # None: no answer (hang or transport error)
    content_type: str = ""
    body: bytes = b""
    seconds: float = 0.0
    error: str | None = None  # the client's exception, when there was no answer

    @property
    def problem(self) -> str | None:
        """Why this answer breaks the property (None: it holds)."""
        if self.status is None:
            return f"no answer: {self.error}"
        if self.status >= 500:
            return f"HTTP {self.status}: {self.body[:300]!r}"
        text = self.body.decode("utf-8", "replace")
        if self.status >= 300:
            if self.probe.method == "HEAD":
                return None  # (no body)
            problem = openai_error_problem(self.body) or self._unnamed_param()
            found = leaks(text)
            return problem or (f"leaks {found}: {text[:300]!r}" if found else None)
        chat = self.probe.path.startswith(CHAT)
        if self.content_type.startswith("text/event-stream"):
            problem = stream_problem(self.body, chat)
            if problem is None and not self.probe.wants_stream:
                problem = "a stream that was not asked for"
        else:
            problem = response_problem(self.body, chat)
            if problem is None and self.probe.wants_stream:
                problem = "no stream although asked for"
        return problem

    def _unnamed_param(self) -> str | None:
        """A 400 to a well-formed JSON object (sent as JSON) names the parameter at fault."""
        if self.status != 400 or self.probe.method != "POST" or self.probe.body is None:
            return None
        if dict(self.probe.headers).get("Content-Type") != "application/json" or self.probe.body[:3] == b"\xef\xbb\xbf":
            return None
        try:
            doc = strict_json(self.probe.body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        if isinstance(doc, dict) and strict_json(self.body)["error"]["param"] is None:
            return f"a 400 that names no param: {self.body[:300]!r}"
        return None

    @property
    def kind(self) -> str:
        """The bucket this answer counts in: 2xx, 4xx, 5xx or hang."""
        if self.status is None:
            return "hang"
        return f"{self.status // 100}xx"


async def _read(http, base: str, probe: Probe, content, out: Outcome) -> None:
    async with http.stream(probe.method, base + probe.path, content=content, headers=[
            (k, v.encode("latin-1")) for k, v in probe.headers]) as resp:  # (bytes: httpx would refuse non-ASCII)
        out.status = resp.status_code
        out.content_type = resp.headers.get("content-type", "")
        out.body = b"".join([part async for part in resp.aiter_raw()])


async def send(http, base: str, probe: Probe, timeout_s: float) -> Outcome:
    """One probe (``http``: an httpx.AsyncClient); the whole body is read."""
    import httpx

    out = Outcome(probe)
    t0 = time.perf_counter()
    content = probe.body
    if probe.chunked and content is not None:
        data = content

        async def chunks():
            for i in range(0, max(1, len(data)), 4096):
                yield data[i:i + 4096]
        content = chunks()
    try:
        await asyncio.wait_for(_read(http, base, probe, content, out), timeout_s)
    except (asyncio.TimeoutError, httpx.HTTPError) as e:
        out.status, out.error = None, f"{type(e).__name__}: {e}"
    out.seconds = time.perf_counter() - t0
    return out


def fuzz(base: str, model_id: str, vocab: int, api_key: str | None, num_requests: int, concurrency: int = 32,
         timeout_s: float = 60.0) -> list[Outcome]:
    """``num_requests`` distinct probes from ``probes`` (derandomized: the same requests every run), each sent as
    soon as it is drawn, up to ``concurrency`` in flight (hypothesis draws in this thread; an event loop in another
    sends). Returns every outcome in the order drawn."""
    import threading

    from hypothesis import HealthCheck, Phase, assume, given, settings

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-sender", daemon=True)
    thread.start()
    http = asyncio.run_coroutine_threadsafe(_client(concurrency), loop).result()
    window = threading.BoundedSemaphore(concurrency)
    sent: set[Probe] = set()
    futures = []

    # hypothesis repeats and splices earlier examples; a repeat is rejected (not counted) rather than sent again
    @settings(max_examples=num_requests, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(probes(model_id, vocab, api_key))
    def run(probe: Probe) -> None:
        assume(probe not in sent)
        sent.add(probe)
        window.acquire()
        future = asyncio.run_coroutine_threadsafe(send(http, base, probe, timeout_s), loop)
        future.add_done_callback(lambda _: window.release())
        futures.append(future)

    try:
        run()
        return [f.result() for f in futures]
    finally:
        asyncio.run_coroutine_threadsafe(http.aclose(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _client(concurrency: int):
    import httpx

    return httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency,
                                                               max_keepalive_connections=concurrency))


# -- the benchmark --------------------------------------------------------------------------------------------------

def _listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (from /proc: no psutil); HAProxy if it is one of several (its reloads
    and the proxy actor may share the port)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # LISTEN on that port
                inodes.add(f"socket:[{f[9]}]")
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    found.append(int(proc.name))
            except OSError:
                continue
    return next((p for p in found if _comm(p) == "haproxy"), found[0] if found else None)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _server_node(port: int) -> tuple[int, int] | None:
    """(the process listening on ``port``, the raylet whose children are the server's Ray processes). Serve's proxy
    actor is the raylet's child; Serve's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1) is the proxy actor's."""
    listener = _listener_pid(port)
    if listener is None:
        return None
    pid = listener
    try:
        while pid > 1:
            parent = _ppid(pid)
            if b"raylet" in Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")[0]:
                return listener, parent
            pid = parent
    except OSError:
        pass
    return listener, _ppid(listener)


def rss_mib(port: int, app: str) -> dict[str, float]:
    """Resident memory (MiB) of the server's processes: the HTTP proxy listening on ``port`` and, among its node's
    other Ray worker processes (the raylet's children, named by the titles Ray gives actors' processes), the
    application's ingress replicas and controller and the engine core. Another Ray instance on the machine (its
    processes have another raylet) is left out."""
    node = _server_node(port)
    if node is None:
        return {}
    listener, raylet = node
    found: dict[str, float] = {}
    if _comm(listener) == "haproxy":  # Serve's HAProxy ingress: HAProxy itself, beside the proxy actor
        kib = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{listener}/status").read_text()).group(1))
        found["haproxy"] = round(kib / 1024, 1)
    wanted = {"proxy": "ray::ProxyActor", "ingress": f"ray::ServeReplica:{app}:OpenAIIngress",
              "controller": f"ray::ServeReplica:{app}:LLMController", "engine_core": "ray::EngineCore"}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if _ppid(int(proc.name)) != raylet:
                continue
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            status = (proc / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        for name, prefix in wanted.items():
            if title.startswith(prefix):
                kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
                found[name if name not in found else f"{name}_{proc.name}"] = round(kib / 1024, 1)
    return found


async def timed_413(host: str, port: int, path: str, api_key: str | None, size: int, chunked: bool) -> dict:
    """A body of ``size`` bytes (a JSON prompt), with a Content-Length or chunked, over a raw socket: the time from
    the first byte sent to the answer's status line, the status, the error code, and the bytes written by then."""
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    prefix, suffix = b'{"prompt": "', b'", "max_tokens": 1}'
    piece = b"a" * (1 << 20)
    reader, writer = await asyncio.open_connection(host, port)
    written = 0

    async def body() -> None:
        nonlocal written
        left = size - len(prefix) - len(suffix)
        parts = [prefix]
        while left > 0:
            parts.append(piece[:min(left, len(piece))])
            left -= len(parts[-1])
        parts.append(suffix)
        for part in parts:
            writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n" if chunked else part)
            await writer.drain()
            written += len(part)
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    t0 = time.perf_counter()
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    sending = asyncio.ensure_future(body())
    try:
        status_line = await asyncio.wait_for(reader.readline(), 120)
        took = time.perf_counter() - t0
        sent_by_status = written
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        answer = await reader.readexactly(int(headers.get("content-length", 0)))
        # the rest of the body, as a client sends it (unless the server closes the connection)
        await asyncio.wait([sending], timeout=10)
    finally:
        sending.cancel()
        writer.close()
    try:
        code = json.loads(answer)["error"]["code"]
    except Exception:  # noqa: BLE001
        code = None
    return {"chunked": chunked, "ms": round(took * 1e3, 2), "status": int(status_line.split()[1]), "code": code,
            "sent_mib": round(sent_by_status / 2**20, 1), "sent_total_mib": round(written / 2**20, 1)}


async def _stream_stamps(http, url: str, headers: dict, body: dict, stamps: list[float]) -> None:
    """A streamed request: appends each text chunk's arrival time (perf_counter) to ``stamps`` as it comes."""
    async with http.stream("POST", url, json=body, headers=headers) as resp:
        assert resp.status_code == 200, resp.status_code
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                stamps.append(time.perf_counter())


def _gaps(streams: list[list[float]], start: float, end: float) -> dict:
    """Inter-token gaps (ms) that end within [start, end), over every stream: count, p50, p99, max."""
    gaps = sorted((b - a) * 1e3 for s in streams for a, b in zip(s, s[1:]) if start <= b < end)
    if not gaps:
        return {"count": 0}
    return {"count": len(gaps), "p50_ms": round(statistics.median(gaps), 2),
            "p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2), "max_ms": round(gaps[-1], 2)}


async def huge_body(base: str, model: str, api_key: str | None, size: int, rounds: int, num_streams: int,
                    app: str) -> dict:
    """``num_streams`` streams run; after a baseline window, ``rounds`` bodies of ``size`` bytes with a
    Content-Length and ``rounds`` chunked ones go one after the other; the streams' gaps before and during, the
    413s' times, and the RSS of the server's processes before and after."""
    import httpx

    host, port = base.removeprefix("http://").split("/")[0].rsplit(":", 1)
    path = base.split("//", 1)[1].partition("/")[2]
    path = ("/" + path if path else "") + COMPLETIONS
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rss_before = rss_mib(int(port), app)
    body = {"model": model, "prompt": "def main():", "max_tokens": 100_000, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=num_streams + 4)) as http:
        info = (await http.get(base + "/v1/models", headers=headers)).json()["data"][0]
        body["max_tokens"] = min(info.get("max_model_len", 2048) - 16, 1500)
        stamps: list[list[float]] = [[] for _ in range(num_streams)]
        streams = [asyncio.ensure_future(_stream_stamps(http, base + COMPLETIONS, headers, body, st_))
                   for st_ in stamps]
        await asyncio.sleep(4.0)  # the streams' prefill, then a baseline
        t_big = time.perf_counter()
        sends = []
        for chunked in (False, True):
            for _ in range(rounds):
                sends.append(await timed_413(host, int(port), path, api_key, size, chunked))
                sends[-1]["rss_mib_after"] = rss_mib(int(port), app)
        t_end = time.perf_counter()
        await asyncio.sleep(1.0)
        broken = [str(s.exception()) for s in streams if s.done() and s.exception() is not None]
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    await asyncio.sleep(2.0)  # (what the server frees after the streams ended)
    first = min((s[0] for s in stamps if s), default=t_big)
    return {
        "body_bytes": size, "rounds": rounds, "sends": sends, "streams": num_streams, "streams_broken": broken,
        "gaps_before": _gaps(stamps, first + 1.0, t_big), "gaps_during": _gaps(stamps, t_big, t_end),
        "window_s": {"before": round(t_big - first - 1.0, 2), "during": round(t_end - t_big, 2)},
        "rss_mib_before": rss_before, "rss_mib_after": rss_mib(int(port), app),
    }


async def many_streams(base: str, model: str, api_key: str | None, num: int, max_tokens: int,
                       num_prompts: int = 10) -> dict:
    """``num`` greedy streams at once over ``num_prompts`` prompts: lost ones (no 200, or no [DONE]), ones whose
    text differs from the prompt's non-streamed answer, ones whose token count (logprobs' tokens, and usage) is not
    ``max_tokens``; then the time until nothing runs and the KV cache is empty."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = [f"import mod{i}\n" for i in range(num_prompts)]
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}

    async def one(http, i: int) -> dict:
        body = {**common, "prompt": prompts[i % num_prompts], "stream": True,
                "stream_options": {"include_usage": True}}
        text, tokens, usage, done = [], 0, None, False
        try:
            async with http.stream("POST", base + COMPLETIONS, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    return {"lost": f"HTTP {resp.status_code}"}
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        for c in chunk["choices"]:
                            text.append(c["text"])
                            tokens += len(c["logprobs"]["tokens"]) if c["logprobs"] else 0
                        usage = chunk.get("usage") or usage
        except httpx.HTTPError as e:
            return {"lost": f"{type(e).__name__}: {e}"}
        if not done:
            return {"lost": "no [DONE]"}
        return {"i": i, "text": "".join(text), "tokens": tokens, "usage": (usage or {}).get("completion_tokens")}

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=num + 8)) as http:
        refs = []
        for p in prompts:  # one at a time: the reference answers
            r = (await http.post(base + COMPLETIONS, json={**common, "prompt": p}, headers=headers)).json()
            refs.append(r["choices"][0]["text"])
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(http, i) for i in range(num)))
        took = time.perf_counter() - t0
        t1 = time.perf_counter()
        while True:
            s = (await http.get(base + "/v1/stats", headers=headers)).json()
            if (s["running"], s["waiting"], s["kv_usage"]) == (0, 0, 0.0) or time.perf_counter() - t1 > 60:
                break
            await asyncio.sleep(0.05)
        idle_s = time.perf_counter() - t1
    lost = [r["lost"] for r in results if "lost" in r]
    ok = [r for r in results if "lost" not in r]
    return {"streams": num, "max_tokens": max_tokens, "seconds": round(took, 2), "lost": len(lost),
            "lost_examples": lost[:5], "text_differs": sum(r["text"] != refs[r["i"] % num_prompts] for r in ok),
            "token_count_wrong": sum(r["tokens"] != max_tokens or r["usage"] != max_tokens for r in ok),
            "tokens_streamed": sum(r["tokens"] for r in ok), "idle_after_s": round(idle_s, 3),
            "stats_after": {k: s[k] for k in ("running", "waiting", "kv_usage")}}


def actor_pids(port: int, title: str) -> list[int]:
    """Pids of the Ray worker processes on the node of the HTTP proxy listening on ``port`` whose process title starts
    with ``title`` (e.g. ``ray::WorkerActor``)."""
    node = _server_node(port)
    if node is None:
        return []
    raylet = node[1]
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if _ppid(int(proc.name)) == raylet and (proc / "cmdline").read_bytes().split(b"\0")[0].decode(
                    errors="replace").startswith(title):
                pids.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(pids)


async def _kill_stream(http, url: str, headers: dict, body: dict, state: dict) -> None:
    """One client's stream, started again whenever it ends (a 503 or a stream that ended with an error: after
    ``RETRY_S``), as a client retrying would, until ``state["stop"]``: each stream's ending (error event then
    [DONE], or not) and the time its first token came are recorded in ``state``."""
    import httpx

    while not state["stop"]:
        started = time.perf_counter()
        try:
            async with http.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    state["statuses"][resp.status_code] += 1
                    await resp.aread()
                else:
                    last, first = [], None
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            if first is None and line.startswith("data: {") and '"error"' not in line:
                                first = time.perf_counter()
                                state["first_tokens"].append((started, first))
                            last = (last + [line[6:]])[-2:]
                    state["statuses"][200] += 1
                    if state["killed"] is not None and started < state["killed"]:  # a stream the kill cut short
                        ended = (len(last) == 2 and last[1] == "[DONE]" and last[0].startswith("{")
                                 and "error" in json.loads(last[0]))
                        state["cut"].append({"error_then_done": ended, "s": time.perf_counter() - state["killed"],
                                             "error": json.loads(last[0]).get("error", {}).get("type")
                                             if ended else None})
        except httpx.HTTPError as e:
            state["statuses"][type(e).__name__] += 1
        if time.perf_counter() - started < 1.0:
            await asyncio.sleep(WorkerKill.RETRY_S)


class WorkerKill:
    RETRY_S = 0.2  # a refused client tries again after this long
    PROBE_S = 0.1  # the prober's pause between requests


async def worker_kill(base: str, model: str, api_key: str | None, port: int, loaded_streams: int,
                      timeout_s: float = 120.0) -> dict:
    """SIGKILL of a TP worker process (``ray::WorkerActor``), with ``loaded_streams`` streams running (0: quiet);
    those clients keep streaming, starting again when refused. A prober sends a small non-streamed completion
    every ``PROBE_S`` from the kill on: the time from the kill to its first 200, the statuses it saw; how the cut
    streams ended; when every client streamed again; whether the engine core's process stayed (the replica was not
    replaced), and whether the KV cache is empty afterwards."""
    import signal

    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    workers, core = actor_pids(port, "ray::WorkerActor"), actor_pids(port, "ray::EngineCore")
    if not workers:
        raise RuntimeError("no ray::WorkerActor process found on the proxy's node")
    state = {"stop": False, "killed": None, "statuses": collections.Counter(), "first_tokens": [], "cut": []}
    body = {"model": model, "prompt": "def main():", "max_tokens": 100_000, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    probe = {"model": model, "prompt": "def f(", "max_tokens": 4, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=loaded_streams + 8)) as http:
        info = (await http.get(base + "/v1/models", headers=headers)).json()["data"][0]
        body["max_tokens"] = min(info.get("max_model_len", 2048) - 16, 1500)
        clients = [asyncio.ensure_future(_kill_stream(http, base + COMPLETIONS, headers, body, state))
                   for _ in range(loaded_streams)]
        deadline = time.perf_counter() + 60
        while len(state["first_tokens"]) < loaded_streams and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0 if loaded_streams else 0.0)
        running_before = (await http.get(base + "/v1/stats", headers=headers)).json()["running"]
        killed = state["killed"] = time.perf_counter()
        os.kill(workers[0], signal.SIGKILL)
        seen, recovered = collections.Counter(), None
        while time.perf_counter() - killed < timeout_s:
            try:
                r = await http.post(base + COMPLETIONS, json=probe, headers=headers, timeout=30)
                seen[r.status_code] += 1
                if r.status_code == 200:
                    recovered = time.perf_counter() - killed
                    break
            except httpx.HTTPError as e:
                seen[type(e).__name__] += 1
            await asyncio.sleep(WorkerKill.PROBE_S)
        # every client streaming again: a first token of a stream started after the kill, per client
        all_back = None
        while loaded_streams and time.perf_counter() - killed < timeout_s:
            after = [f for s, f in state["first_tokens"] if s > killed]
            if len(after) >= loaded_streams:
                all_back = sorted(after)[loaded_streams - 1] - killed
                break
            await asyncio.sleep(0.1)
        state["stop"] = True
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        t1 = time.perf_counter()
        while True:
            stats = (await http.get(base + "/v1/stats", headers=headers)).json()
            if (stats["running"], stats["waiting"], stats["kv_usage"]) == (0, 0, 0.0) or time.perf_counter() - t1 > 30:
                break
            await asyncio.sleep(0.05)
    cut = state["cut"]
    return {"loaded_streams": loaded_streams, "running_at_kill": running_before,
            "recovered_s": None if recovered is None else round(recovered, 2),
            "all_streaming_again_s": None if all_back is None else round(all_back, 2),
            "probe_statuses": {str(k): v for k, v in seen.items()},
            "client_statuses": {str(k): v for k, v in state["statuses"].items()},
            "streams_cut": len(cut), "cut_error_then_done": sum(c["error_then_done"] for c in cut),
            "cut_error_types": sorted({str(c["error"]) for c in cut}),
            "cut_ended_within_s": round(max((c["s"] for c in cut), default=0.0), 2),
            "core_kept": actor_pids(port, "ray::EngineCore") == core, "worker_replaced": workers[0] not in
            actor_pids(port, "ray::WorkerActor"), "kv_usage_after": stats["kv_usage"],
            "stats_after": {k: stats[k] for k in ("running", "waiting", "kv_usage")},
            "idle_after_s": round(time.perf_counter() - t1, 2),
            "worker_restarts": stats.get("loop", {}).get("worker_restarts")}


def summarize_fuzz(outcomes: list[Outcome], seconds: float) -> dict:
    kinds = collections.Counter(o.kind for o in outcomes)
    problems = [o for o in outcomes if o.problem]
    leaked = [o for o in problems if o.problem.startswith("leaks")]
    non_openai = [o for o in problems if o.kind in ("2xx", "3xx", "4xx") and not o.problem.startswith("leaks")]
    streams = sum(o.status == 200 and o.content_type.startswith("text/event-stream") for o in outcomes)
    latencies = sorted(o.seconds for o in outcomes)
    return {"requests": len(outcomes), "seconds": round(seconds, 1), "by_class": dict(sorted(kinds.items())),
            "streams_2xx": streams, "5xx": kinds.get("5xx", 0), "non_openai_bodies": len(non_openai),
            "leaking_bodies": len(leaked), "hangs": kinds.get("hang", 0),
            "latency_s": {"p50": round(statistics.median(latencies), 3),
                          "p99": round(latencies[int(0.99 * (len(latencies) - 1))], 3),
                          "max": round(latencies[-1], 3)},
            "problems": [{"problem": o.problem[:300], "request": repr(o.probe)[:600]} for o in problems[:10]]}


def goals(meta: dict) -> list[str]:
    """One line per goal of issue #37 that this run measures: met or not, with the figure."""
    lines = []
    f, h, m = meta.get("fuzz"), meta.get("huge_body"), meta.get("many_streams")
    for k in meta.get("worker_kill", []):
        ok = k["recovered_s"] is not None and k["recovered_s"] < 15
        lines.append(f"- {'met' if ok else 'NOT met'}: service answering again < 15 s after a worker SIGKILL, "
                     f"{k['loaded_streams'] or 'no'} streams running ({k['recovered_s']} s; engine core kept: "
                     f"{k['core_kept']})")
    if f:
        ok = f["5xx"] == f["non_openai_bodies"] == f["hangs"] == f["leaking_bodies"] == 0 and f["requests"] >= 2000
        lines.append(f"- {'met' if ok else 'NOT met'}: >= 2,000 fuzzed requests, 0 5xx, 0 non-OpenAI bodies, 0 hangs "
                     f"({f['requests']} requests: {f['5xx']} / {f['non_openai_bodies']} / {f['hangs']}; "
                     f"{f['leaking_bodies']} leaking)")
    if h:
        for chunked in (False, True):
            times = [s["ms"] for s in h["sends"] if s["chunked"] == chunked]
            ok = all(s["status"] == 413 for s in h["sends"] if s["chunked"] == chunked) and max(times) < 100
            lines.append(f"- {'met' if ok else 'NOT met'}: a {h['body_bytes'] / 1e6:.0f} MB body "
                         f"({'chunked' if chunked else 'with Content-Length'}) is a 413 in < 100 ms "
                         f"(max {max(times)} ms)")
        b, d = h["gaps_before"], h["gaps_during"]
        if b.get("count") and d.get("count"):
            rise = max(d["p50_ms"] - b["p50_ms"], d["max_ms"] - b["max_ms"])
            lines.append(f"- {'met' if rise <= 100 else 'NOT met'}: the other streams' inter-token gap not raised by "
                         f"more than 100 ms (p50 {b['p50_ms']} -> {d['p50_ms']} ms, max {b['max_ms']} -> "
                         f"{d['max_ms']} ms)")
        grown = {k: round(h["rss_mib_after"].get(k, 0) - v, 1) for k, v in h["rss_mib_before"].items()}
        ok = all(g < 16 for g in grown.values())
        lines.append(f"- {'met' if ok else 'NOT met'}: RSS unchanged (growth, MiB: "
                     + ", ".join(f"{k} {g:+}" for k, g in sorted(grown.items())) + ")")
    if m:
        ok = m["lost"] == m["text_differs"] == m["token_count_wrong"] == 0 and m["stats_after"]["kv_usage"] == 0
        lines.append(f"- {'met' if ok else 'NOT met'}: {m['streams']} concurrent streams, 0 lost, every token once, "
                     f"KV back to 0 ({m['lost']} lost, {m['text_differs']} texts differ, {m['token_count_wrong']} "
                     f"token counts wrong, KV {m['stats_after']['kv_usage']} after {m['idle_after_s']} s)")
    return lines


def write_report(meta: dict, out: Path) -> None:
    write_json(out, meta)
    md = [f"# Reliability ({meta['device']})", "", f"commit `{meta['commit']}` · command `{meta['command']}`", "",
          f"server: {meta.get('config') or meta['url']} (answering on its port: {meta.get('listener')}) · model "
          f"`{meta['model_id']}` · the machine's 1-minute load "
          f"average at the start: {meta['load_avg_1m_at_start']} (a shared machine: timings are noisy)", ""]
    md += ["## Against the issue's goals", "", *goals(meta), ""]
    f = meta.get("fuzz")
    if f:
        md += ["## Fuzzed requests", "",
               f"{f['requests']} distinct hypothesis-generated requests to /v1/completions and /v1/chat/completions "
               f"(hostile values, raw byte mutations, odd methods, paths, headers and content types), "
               f"{meta['concurrency']} in flight, in {f['seconds']} s.", "",
               "| 2xx | of which streams | 4xx | 5xx | non-OpenAI bodies | bodies leaking internals | hangs (no answer "
               f"in {meta['timeout_s']:.0f} s) | latency p50 / p99 / max s |", "|---|---|---|---|---|---|---|---|",
               f"| {f['by_class'].get('2xx', 0)} | {f['streams_2xx']} | {f['by_class'].get('4xx', 0)} | {f['5xx']} | "
               f"{f['non_openai_bodies']} | {f['leaking_bodies']} | {f['hangs']} | {f['latency_s']['p50']} / "
               f"{f['latency_s']['p99']} / {f['latency_s']['max']} |", ""]
        if f["problems"]:
            md += ["Problems (first ones):", ""] + [f"- {p['problem']} — `{p['request'][:300]}`"
                                                   for p in f["problems"]] + [""]
    h = meta.get("huge_body")
    if h:
        md += [f"## A {h['body_bytes'] / 1e6:.0f} MB body while {h['streams']} streams run", "",
               "| body | status (code) | time to the status line ms | MiB sent by then | MiB sent in all | "
               "RSS after, ingress / proxy (HAProxy) / engine core MiB |", "|---|---|---|---|---|---|"]
        md += [f"| {'chunked' if s['chunked'] else 'Content-Length'} | {s['status']} ({s['code']}) | {s['ms']} | "
               f"{s['sent_mib']} | {s['sent_total_mib']} | {s['rss_mib_after'].get('ingress')} / "
               f"{s['rss_mib_after'].get('proxy')} ({s['rss_mib_after'].get('haproxy', '-')}) / "
               f"{s['rss_mib_after'].get('engine_core')} |" for s in h["sends"]]
        md += ["", "(The client sends its whole body, as clients do: the server answers first and reads the rest on "
               "the kept-alive connection rather than closing it, which would reset the connection under the unread "
               "body and could lose the answer.)"]
        b, d = h["gaps_before"], h["gaps_during"]
        md += ["", f"The streams' inter-token gaps (ms), {h['window_s']['before']} s before and "
               f"{h['window_s']['during']} s during the big bodies:", "",
               "| window | gaps | p50 | p99 | max |", "|---|---|---|---|---|",
               f"| before | {b.get('count')} | {b.get('p50_ms')} | {b.get('p99_ms')} | {b.get('max_ms')} |",
               f"| during | {d.get('count')} | {d.get('p50_ms')} | {d.get('p99_ms')} | {d.get('max_ms')} |", "",
               "RSS (MiB) of the server's processes:", "", "| process | before | after |", "|---|---|---|"]
        md += [f"| {k} | {v} | {h['rss_mib_after'].get(k)} |" for k, v in sorted(h["rss_mib_before"].items())]
        if h["streams_broken"]:
            md += ["", f"Streams that broke: {h['streams_broken']}"]
        md += [""]
    m = meta.get("many_streams")
    if m:
        md += [f"## {m['streams']} concurrent streams", "",
               f"{m['streams']} greedy streams of {m['max_tokens']} tokens at once (ignore_eos, logprobs to count "
               f"tokens), against each prompt's non-streamed answer, in {m['seconds']} s.", "",
               "| lost | text differs | token count wrong | tokens streamed | nothing running, KV empty after s | "
               "KV usage after |", "|---|---|---|---|---|---|",
               f"| {m['lost']} | {m['text_differs']} | {m['token_count_wrong']} | {m['tokens_streamed']} | "
               f"{m['idle_after_s']} | {m['stats_after']['kv_usage']} |", ""]
    kills = meta.get("worker_kill")
    if kills:
        md += ["## A worker's SIGKILL", "",
               "SIGKILL of the TP worker's process; a prober sends a 4-token completion every "
               f"{WorkerKill.PROBE_S} s from the kill on. Under load, each of the streams' clients starts a new stream "
               f"when its stream ends or is refused (after {WorkerKill.RETRY_S} s). The engine core restarts its "
               "workers itself: the controller replica and the core actor stay.", "",
               "| streams running | first 200 after the kill s | every client streaming again s | cut streams: "
               "error event + [DONE] | cut streams ended within s | prober's statuses | engine core kept | "
               "worker replaced | KV usage after |", "|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {k['loaded_streams']} | {k['recovered_s']} | {k['all_streaming_again_s']} | "
               f"{k['cut_error_then_done']} / {k['streams_cut']} {k['cut_error_types'] if k['streams_cut'] else ''} | "
               f"{k['cut_ended_within_s']} | {k['probe_statuses']} | {k['core_kept']} | {k['worker_replaced']} | "
               f"{k['kv_usage_after']} |" for k in kills]
        md += [""]
    write_markdown(out, md)


def main() -> None:
    import platform

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a serve config whose first application is started here")
    ap.add_argument("--server-config", default=None, help="or the serve config of a server already running")
    ap.add_argument("--wait-s", type=float, default=0, help="with --server-config: wait this long for /health")
    ap.add_argument("--client-url", default=None, help="send the requests here instead (e.g. an ingress replica's own "
                    "port under Ray Serve's direct ingress, RAY_SERVE_THROUGHPUT_OPTIMIZED=1)")
    ap.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                    help="the server's API key (default: $SPECSERVE_API_KEY)")
    ap.add_argument("--fuzz-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="a fuzzed request unanswered this long hangs")
    ap.add_argument("--body-mb", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=3, help="big bodies of each kind (Content-Length, chunked)")
    ap.add_argument("--gap-streams", type=int, default=8, help="streams running while the big bodies go")
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--stream-tokens", type=int, default=16)
    ap.add_argument("--kills", default="quiet,loaded,loaded",
                    help="worker kills, in order: quiet (no streams) or loaded (--kill-streams streams running)")
    ap.add_argument("--kill-streams", type=int, default=32)
    ap.add_argument("--parts", default="fuzz,huge_body,many_streams,worker_kill")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from bench.serving import server_config, start_app, vocab_size, wait_healthy

    if args.config:
        base, model, vocab, _ = start_app(Path(args.config))
        base = base.removesuffix("/v1")
        config = args.config
    elif args.server_config:
        base, model, app_args = server_config(Path(args.server_config))
        if args.wait_s:
            wait_healthy(base, args.wait_s)
        vocab, config = vocab_size(app_args), args.server_config
    else:
        ap.error("one of --config, --server-config")
    if args.client_url:
        base = args.client_url.rstrip("/")
    import yaml

    app = yaml.safe_load(Path(config).read_text())["applications"][0].get("name", "default")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    meta = {"device": f"CPU {cpu}, {os.cpu_count()} cores", "commit": commit(), "command": command(),
            "config": config, "url": base, "model_id": model, "concurrency": args.concurrency,
            "timeout_s": args.timeout_s, "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    port = int(base.removeprefix("http://").split("/")[0].rsplit(":", 1)[1])
    listener = _listener_pid(port)  # what answers on the URL's port: haproxy, or a Ray process (Serve's proxy, replica)
    meta["listener"] = None if listener is None else _comm(listener)
    out = out_path(args.out)
    parts = args.parts.split(",")
    if "fuzz" in parts:
        t0 = time.perf_counter()
        outcomes = fuzz(base, model, vocab, args.api_key, args.fuzz_requests, args.concurrency, args.timeout_s)
        meta["fuzz"] = summarize_fuzz(outcomes, time.perf_counter() - t0)
        print(json.dumps(meta["fuzz"], indent=1)[:2000], flush=True)
        write_report(meta, out)
    if "huge_body" in parts:
        meta["huge_body"] = asyncio.run(huge_body(base, model, args.api_key, int(args.body_mb * 1e6), args.rounds,
                                                  args.gap_streams, app))
        print(json.dumps(meta["huge_body"], indent=1), flush=True)
        write_report(meta, out)
    if "many_streams" in parts:
        meta["many_streams"] = asyncio.run(many_streams(base, model, args.api_key, args.streams, args.stream_tokens))
        print(json.dumps(meta["many_streams"], indent=1), flush=True)
        write_report(meta, out)
    if "worker_kill" in parts:
        meta["worker_kill"] = []
        for kind in args.kills.split(","):
            loaded = {"quiet": 0, "loaded": args.kill_streams}[kind]
            meta["worker_kill"].append(asyncio.run(worker_kill(base, model, args.api_key, port, loaded)))
            print(json.dumps(meta["worker_kill"][-1], indent=1), flush=True)
            write_report(meta, out)
            time.sleep(2.0)


if __name__ == "__main__":
    main()
