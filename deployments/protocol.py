"""The OpenAI wire format: request models and their validation into the engine's sampling parameters, the logprobs
object of a response, and the error body."""

import json
import types
import typing
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from deployments.engine.grammar import GuidedSpec


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


def quoted(value, limit: int = 40) -> str:
    """``value`` as an error message shows it: its repr, cut to ``limit`` characters (a client's value may be
    megabytes, which the error body would otherwise carry back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def error_message(model: type[BaseModel] | None, loc, msg: str) -> tuple[str | None, str]:
    """A validation error's (param, message), from pydantic's ``loc`` (the body's part) and ``msg`` for ``model``.
    The param is the path of fields and list indices, up to a union-typed field or a dict-typed one. Past a union,
    pydantic's location names the member type it tried (``guided_json.str`` for a number given as ``guided_json``),
    which is no parameter, and its message is that member's failure alone (``Input should be a valid string`` for
    ``prompt: [[1, "a"]]``): which member the client meant is unknown, so the union field is named and the message
    says what it accepts, from its type. Past a dict come its keys, the client's data (``logit_bias.1``), so the
    dict field is named, as OpenAI and vLLM name it."""
    param, union = _located(model, loc)
    if union is not None:
        msg = f"Input should be {accepted(union)}"
    return param, msg


def _located(model: type[BaseModel] | None, loc) -> tuple[str | None, Any]:
    """``error_message``'s param, and the union type it stopped at (else None)."""
    path, tp = [], model
    for part in loc:
        if tp is not None:
            if typing.get_origin(tp) in (typing.Union, types.UnionType):
                members = [a for a in typing.get_args(tp) if a is not type(None)]
                if len(members) > 1:
                    return ".".join(path) or None, tp
                tp = members[0]
            origin, args = typing.get_origin(tp), typing.get_args(tp)
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                field = tp.model_fields.get(part) if isinstance(part, str) else None
                tp = field.annotation if field is not None else None
            elif origin is dict or tp is dict:
                break
            elif origin in (list, tuple) and args:
                tp = args[0]
            else:
                tp = None  # (below a type it does not walk: the rest as pydantic gives it)
        path.append(str(part))
    return ".".join(path) or None, None


_ACCEPTED = {str: ("a string", "strings"), int: ("an integer", "integers"), float: ("a number", "numbers"),
             bool: ("a boolean", "booleans")}


def accepted(tp, plural: bool = False) -> str:
    """What type ``tp`` accepts, in words (``str | list[str]``: "a string or a list of strings"); null left out."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        words = [accepted(a, plural) for a in args if a is not type(None)]
        return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    if origin is typing.Annotated:
        return accepted(args[0], plural)
    if origin is Literal:
        return "one of " + ", ".join(quoted(a) for a in args)
    if origin in (list, tuple):
        inner = accepted(args[0], True) if args else "values"
        return f"lists of {inner}" if plural else f"a list of {inner}"
    if origin is dict or tp is dict or (isinstance(tp, type) and issubclass(tp, BaseModel)):
        return "objects" if plural else "an object"
    if tp in _ACCEPTED:
        return _ACCEPTED[tp][plural]
    return "values" if plural else "a value"


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: usage in every chunk; not implemented, refused when true)


# fields of OpenAI's or vLLM's request that this server does not implement, with the values that ask for nothing
# (their defaults): any other value is a 400 naming the field. Fields no API defines are ignored, as vLLM does.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,), "length_penalty": (1.0,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "guided_grammar": (None,), "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,), "logits_processors": (None,),
    "return_tokens_as_token_ids": (False,), "priority": (0,), "continue_final_message": (False,),
    "add_generation_prompt": (True,), "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "documents": (None,), "echo": (None, False), "functions": (None, []), "function_call": (None, "none", "auto"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


class SamplingFields(BaseModel):
    """Fields both endpoints share. Optional fields accept null (OpenAI marks them nullable); unset ones take the
    model's generation_config.json defaults where it has them, else OpenAI's."""

    # a NaN or infinity is refused as not finite (rather than as out of range)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    _not_implemented: dict = PrivateAttr(default_factory=dict)  # the request's NOT_IMPLEMENTED fields, as sent
    model: str | None = None  # as vLLM: omitted means the served model
    max_tokens: int | None = Field(None)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # (the engine takes any int64, as vLLM)
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI parameters this server does not implement: refused when set to anything but their no-op value
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # extensions (vLLM / SGLang names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # structured output, vLLM's extra fields besides OpenAI's response_format
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _keep_not_implemented(cls, data, handler):
        """Other fields outside the model stay ignored (as vLLM ignores them), unread: their names may not even be
        valid text."""
        request = handler(data)
        if isinstance(data, dict):
            request._not_implemented = {k: v for k, v in data.items()  # (in the request's order)
                                        if k in NOT_IMPLEMENTED and k not in cls.model_fields}
        return request

    def guided_spec(self) -> GuidedSpec | None:
        """What the output must match (one of response_format / guided_* / structured_outputs), or None. A
        malformed one is a 400 naming its field; a schema or regex the grammar engine refuses is one from the
        engine (also naming the field)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            kind = rf.get("type")
            if kind == "json_object":
                found.append(GuidedSpec("json_object", None, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
                if not isinstance(schema, (dict, bool)):
                    raise APIError(400, "response_format json_schema needs a json_schema object with a 'schema'",
                                   param="response_format")
                found.append(GuidedSpec("json_schema", json.dumps(schema), "response_format"))
            else:
                raise APIError(400, f"response_format type {quoted(kind)} is not supported (text, json_object, "
                               "json_schema)", param="response_format")
        if self.guided_json is not None:
            gj = self.guided_json
            found.append(GuidedSpec("json_schema", gj if isinstance(gj, str) else json.dumps(gj), "guided_json"))
        if self.guided_regex is not None:
            found.append(GuidedSpec("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(GuidedSpec("choice", tuple(self.guided_choice), "guided_choice"))
        so = self.structured_outputs
        if so:
            keys = [k for k in ("json", "regex", "choice", "json_object") if so.get(k) not in (None, False)]
            if len(keys) != 1 or set(so) - {"json", "regex", "choice", "json_object"}:
                raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, json_object",
                               param="structured_outputs")
            v = so[keys[0]]
            found.append({"json": lambda: GuidedSpec("json_schema", v if isinstance(v, str) else json.dumps(v),
                                                     "structured_outputs"),
                          "regex": lambda: GuidedSpec("regex", v, "structured_outputs"),
                          "choice": lambda: GuidedSpec("choice", tuple(v), "structured_outputs"),
                          "json_object": lambda: GuidedSpec("json_object", None, "structured_outputs")}[keys[0]]())
        if len(found) > 1:
            raise APIError(400, "only one of response_format, guided_json, guided_regex, guided_choice and "
                           "structured_outputs may be set", param=found[1].param)
        return found[0] if found else None

    def refuse_unsupported(self) -> None:
        """A request for something this server does not do gets 400 naming the parameter, not a silent no-op."""
        unsupported = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
        }
        for name, value in self._not_implemented.items():
            unsupported[name] = value not in NOT_IMPLEMENTED[name]
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            unsupported["stream_options.continuous_usage_stats"] = True
        for name, refused in unsupported.items():
            if refused:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")

    def sampling_params(self, default_max: int | None, defaults: dict, logprobs: bool, top: int = 0) -> dict:
        """The keyword arguments of the engine's ``SamplingParams``: unset fields take ``defaults`` (the model's),
        else OpenAI's."""
        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": self.max_tokens if self.max_tokens is not None else default_max,
                "temperature": pick("temperature", 1.0), "top_p": pick("top_p", 1.0), "top_k": pick("top_k", 0),
                "min_p": pick("min_p", 0.0), "seed": self.seed, "stop": stop,
                "stop_token_ids": list(self.stop_token_ids or []), "ignore_eos": bool(self.ignore_eos),
                "logprobs": logprobs, "top_logprobs": top,
                "frequency_penalty": pick("frequency_penalty", 0.0), "presence_penalty": pick("presence_penalty", 0.0),
                "repetition_penalty": pick("repetition_penalty", 1.0), "min_tokens": self.min_tokens or 0,
                "logit_bias": self._logit_bias()}

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids (the engine checks the ranges)."""
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None


def prompt_logprobs_body(prompt_ids: list[int], entries: list, token_text, k: int) -> tuple[list, list]:
    """An echoed prompt's (token text, logprob) pairs and each token's ``k`` alternatives, for ``logprobs_body``:
    ``entries`` per prompt token None (the first) or (logprob, [(id, logprob), ...])."""
    pairs, tops = [], []
    for t, e in zip(prompt_ids, entries):
        pairs.append((token_text(t), None if e is None else e[0]))
        tops.append(None if e is None else [(token_text(a), lp) for a, lp in e[1][:k]])
    return pairs, tops


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)  # most likely alternatives per token besides the sampled one
    best_of: int | None = None
    suffix: str | None = None

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts (a string or token ids each): one, or a batch (a list of strings or of token-id lists), each
        answered with its own ``n`` choices."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if any(not isinstance(p, type(prompt[0])) for p in prompt):
                raise APIError(400, "a batch of prompts is all strings or all token-id lists", param="prompt")
            return list(prompt)
        return [prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def message_dicts(self) -> list[dict]:
        """The messages as the chat template takes them: {role, content} with the content as text."""
        return [{"role": m.role, "content": message_text(m.content)} for m in self.messages]


def message_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise APIError(400, "a message's content parts must be objects", param="messages")
        if part.get("type") != "text":
            raise APIError(400, f"unsupported content part type {quoted(part.get('type'))}: only text",
                           param="messages")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise APIError(400, "a text content part's text must be a string", param="messages")
        parts.append(text)
    return "".join(parts)


LOGPROB_FLOOR = -9999.0  # (vLLM's): JSON has no -Infinity or NaN, which a token of probability 0 would give


def _finite(lp: float | None) -> float | None:
    return lp if lp is None or lp >= LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN compares false: floored too)


def logprobs_body(pairs: list, chat: bool, text_offset: int = 0, tops: list | None = None) -> dict | None:
    """OpenAI's logprobs object for [(token text, logprob), ...] and, when asked for, each token's alternatives
    [[(token text, logprob), ...], ...]: chat's ``content`` list, or the completions API's parallel lists
    (``text_offset``: where the first token starts in the choice's text). Logprobs below LOGPROB_FLOOR (or NaN) are
    sent as LOGPROB_FLOOR."""
    pairs = [(t, _finite(lp)) for t, lp in pairs]
    tops = ([None if top is None else [(a, _finite(alp)) for a, alp in top] for top in tops] if tops
            else [[] for _ in pairs])
    if chat:
        entry = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}  # noqa: E731
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
                            for (t, lp), top in zip(pairs, tops)]}
    offsets = []
    for t, _ in pairs:
        offsets.append(text_offset)
        text_offset += len(t)
    # a dict per token, text → logprob: its alternatives, likeliest first, then the sampled token itself (OpenAI's
    # up to logprobs + 1 entries); tokens that decode to the same text keep the likelier one's logprob
    top_dicts = []
    for (token, token_lp), top in zip(pairs, tops):
        if token_lp is None:  # an echoed prompt's first token: no logprob (as vLLM)
            top_dicts.append(None)
            continue
        top_dicts.append({})
        for t, lp in (*top, (token, token_lp)):
            top_dicts[-1].setdefault(t, lp)
    return {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
            "top_logprobs": top_dicts, "text_offset": offsets}


class ChunkFormat:
    """The SSE text of a streamed response's chunks, as ``json.dumps`` writes the chunk object
    ({**head, "choices": [choice], "usage": null when asked}) but with the fields that never change within a
    response formatted once: a response streams a chunk per step and choice, so this is per-token work."""

    def __init__(self, head: dict, chat: bool, include_usage: bool):
        self.chat = chat
        fields = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items())
        self._prefix = 'data: {' + fields + ', "choices": [{"index": '
        self._suffix = '}]' + (', "usage": null' if include_usage else '') + '}\n\n'

    def sse(self, index: int, text: str | None, finish: str | None, logprobs: dict | None = None,
            first: bool = False, stop_reason: str | int | None = None) -> str:
        """One choice's chunk: its new text (chat: the delta; ``first``: the assistant role), its finish reason
        (with vLLM's stop_reason: the stop string or token id that ended it) and logprobs object."""
        if self.chat:
            body = ('"delta": {"role": "assistant", "content": ""}' if first else
                    '"delta": {"content": ' + _json_str(text) + '}' if text else '"delta": {}')
        else:
            body = '"text": ' + _json_str(text or "")
        stop = "null" if stop_reason is None else json.dumps(stop_reason)
        return (f'{self._prefix}{index}, {body}, "finish_reason": {"null" if finish is None else _json_str(finish)}, '
                f'"stop_reason": {stop}, "logprobs": {"null" if logprobs is None else json.dumps(logprobs)}'
                f'{self._suffix}')


# a string as json.dumps writes it (ensure_ascii): its C encoder alone, without dumps' per-call set-up
_json_str = json.encoder.encode_basestring_ascii

