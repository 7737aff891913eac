"""Structured output over HTTP (the shared app speculates): response_format and vLLM's guided_* fields, on chat and
completions, streamed or not."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.serve.conftest import API_KEY

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 50},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_structured_output_over_http(client):
    msgs = [{"role": "user", "content": "a person as JSON"}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0,
                                          response_format=rf)
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=60, temperature=0, response_format=rf, stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content
    obj = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0.8, seed=1,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].message.content), dict)
    done = client.completions.create(model="tiny", prompt="JSON:", max_tokens=60, temperature=1.0, seed=4,
                                     extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    regex = client.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=1.0,
                                      extra_body={"guided_regex": "[a-c]{2}-[0-9]"})
    assert re.fullmatch("[a-c]{2}-[0-9]", regex.choices[0].text), regex.choices[0].text
    choice = client.completions.create(model="tiny", prompt="y", max_tokens=10, temperature=1.0, n=2,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") for c in choice.choices)
    so = client.completions.create(model="tiny", prompt="z", max_tokens=10, temperature=1.0,
                                   extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert so.choices[0].text in ("up", "down")
