"""A streamed chunk's SSE text (``ChunkFormat``, the per-response parts formatted once) is exactly what json.dumps
writes for the chunk object, for completions and chat, with and without usage and logprobs, on text that JSON
escapes (quotes, newlines, non-ASCII, lone surrogates' escapes) and every finish reason."""

from __future__ import annotations

import pytest

from bench.ingress_chunks import json_dumps_sse
from deployments.protocol import ChunkFormat, logprobs_body

TEXTS = [None, "", "hello", 'a "quoted"\nline\t', "é漢字🙂", "\\u0000 \x00 \x1f"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_chunks_equal_json_dumps(chat, include_usage):
    head = {"id": "cmpl-7f\"x", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1764180000, "model": "org/modél"}
    fmt = ChunkFormat(head, chat, include_usage)
    for i in (0, 3):
        for text in TEXTS:
            for finish in (None, "stop", "length", "abort"):
                for lp in (None, logprobs_body([("a", -0.5), ("é", -1.25)], chat, 4, [[("b", -0.7)], []])):
                    for first in (False, True) if chat else (False,):
                        for stop in (None, "\n\"end", 7) if finish == "stop" else (None,):
                            assert fmt.sse(i, text, finish, lp, first, stop) == json_dumps_sse(
                                (head, chat, include_usage), i, text, finish, lp, first, stop)


def test_logprobs_are_finite_json():
    """A token of probability 0 (or a NaN) is sent as vLLM's floor, -9999.0: JSON has no -Infinity, and a strict
    parser (JavaScript's JSON.parse) refuses the chunk that holds one."""
    import json

    inf, nan = float("-inf"), float("nan")
    body = logprobs_body([("a", inf), ("b", -0.5)], False, 0, [[("x", nan)], [("y", -1.0)]])
    assert body["token_logprobs"] == [-9999.0, -0.5] and body["top_logprobs"][0] == {"x": -9999.0, "a": -9999.0}
    chat = logprobs_body([("a", inf)], True, 0, [[("x", inf)]])
    assert chat["content"][0]["logprob"] == chat["content"][0]["top_logprobs"][0]["logprob"] == -9999.0
    json.loads(json.dumps(body, allow_nan=False))  # (raises on a non-finite value)
    echo = logprobs_body([("p", None), ("q", -2.0)], False, 0, [None, [("r", inf)]])  # an echoed prompt's first
    assert echo["token_logprobs"] == [None, -2.0] and echo["top_logprobs"] == [None, {"r": -9999.0, "q": -2.0}]
