"""Requests as the scheduler sees them, their sampling parameters and their outputs."""

from __future__ import annotations

import enum
import math
import random
import time
from dataclasses import dataclass, field

from workers.messages import MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS


class InvalidRequest(ValueError):
    """A request that can never be served as given (maps to HTTP 400). ``param`` names the parameter at fault where
    one is (the HTTP error's ``param``), ``code`` is OpenAI's code for the refusal where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the end of the context window
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # most likely alternatives returned per token (0..TOP_LOGPROBS), with their logprobs
    # the prompt's logprobs (vLLM's name): None off, else that many alternatives per prompt token (0..20) besides
    # each token's own logprob under the model's raw distribution; computed in the prefill, sent with the first output
    prompt_logprobs: int | None = None
    guided: object | None = None  # structured output: a ``deployments.engine.grammar.GuidedSpec``
    # logits processing (``workers.logits_processing``): OpenAI's penalties over the generated tokens, vLLM's
    # repetition penalty over prompt and output, OpenAI's logit_bias {token id: bias}, vLLM's min_tokens
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0

    @property
    def logits_processing(self) -> bool:
        """Whether any of the logits-processing parameters is set (a row of a step that applies them)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    def validate(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens",
                                 "integer_below_min_value")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings", "stop")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequest(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}", "prompt_logprobs")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest(f"seed must fit in 64 bits, got {self.seed}", "seed")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value!r}", name)
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 100):
            raise InvalidRequest(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}",
                                 "repetition_penalty")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got "
                                     f"{len(self.logit_bias)}", "logit_bias")
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or token < 0:
                    raise InvalidRequest(f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
                if not (isinstance(bias, (int, float)) and -100 <= bias <= 100):
                    raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}",
                                         "logit_bias")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                                 "min_tokens")
        if self.min_tokens and self.guided is not None:  # (it would hold back the stop token a complete grammar needs)
            raise InvalidRequest("min_tokens cannot be combined with structured output: the grammar decides where "
                                 "the output ends", "min_tokens")
        if self.min_tokens and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS - 8:
            raise InvalidRequest(f"with min_tokens, at most {MAX_MIN_TOKENS_STOP_IDS - 8} stop_token_ids",
                                 "stop_token_ids")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @classmethod
    def summed(cls, dicts: list[dict]) -> dict:
        """Several requests' ``as_dict`` (a response's choices) as one: counts summed per field and position."""
        total = cls()
        for d in dicts:
            total.num_drafts += d["num_drafts"]
            total.num_draft_tokens += d["num_draft_tokens"]
            total.num_accepted_tokens += d["num_accepted_tokens"]
            per = total.accepted_per_position
            per.extend([0] * (len(d["accepted_per_position"]) - len(per)))
            for i, n in enumerate(d["accepted_per_position"]):
                per[i] += n
        return total.as_dict()

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "accept_length": round(self.accept_length, 4),
        }


_MASK64 = (1 << 64) - 1


def sampler_seed(seed: int) -> int:
    """The 32 bits of a request's seed that the sampler hashes: splitmix64's finaliser over the seed's 64-bit two's
    complement (seeds are any int64, negative ones included, as vLLM's), low half. Nearby seeds no longer share them:
    folding the halves together made -1 and 0, or 2**32 and 1, give the same tokens."""
    z = seed & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


NEVER = 1 << 62  # Request.cache_at of a request that keys no page as it fills (cache off, not admitted, or deferred)


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    queued_at: float = 0.0  # when the scheduler queued it (its clock: monotonic), for the prefill delay
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when params.top_logprobs
    # params.prompt_logprobs: per prompt token None (the first, and until computed) or (logprob, [(id, logprob)...])
    prompt_logprobs: list | None = None
    prompt_logprobs_done: bool = False  # the chunk that ends the prompt has landed (recomputes ask for none)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    req_slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_inflight: int = 0  # DECODE steps launched for it whose tokens the host has not read yet (overlap: 0 or 1)
    # the DECODE plan of its newest step in flight (its ``max_advance``: the most tokens that step appends), None
    # after a prefill step
    inflight_plan: object = None
    num_preemptions: int = 0
    # prefix caching: prompt tokens served from the cache (set when its prefill is first planned; usage reports it)
    num_cached_tokens: int = 0
    prefix_start: int = 0  # tokens matched in the cache at its current admission: where its prefill starts
    cache_nodes: list[int] = field(default_factory=list)  # the cache's node id of each leading page indexed so far
    # ``num_computed`` from which its next page can be keyed (a check per step, not a call); NEVER: none to key
    cache_at: int = NEVER
    # adaptive speculation: its last positions whose draft KV only a later catch-up writes (plain steps since its
    # last round, bounded as the worker's stash); never indexed, so no cached page holds draft KV a catch-up will
    # still write (the positions of paused steps, which nothing writes, are indexed: design.md, "The draft's pause")
    draft_lag: int = 0
    # adaptive speculation: it ran while the draft was paused, so its draft KV has holes (positions never written):
    # its rounds' verdicts say little of the draft's acceptance and are kept from the chooser's estimates
    draft_holes: bool = False
    seed: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    text: str = ""
    # when (wall clock, as ``arrival_time``) the engine core received it, the loop queued it, and its prefill was
    # first planned: with the token times, its phases (vLLM's queue / prefill / decode times)
    received_time: float | None = None
    queued_time: float | None = None
    scheduled_time: float | None = None
    phase_times: dict | None = None  # ``phases()`` once it finished normally (counted in the engine's totals)
    first_token_time: float | None = None
    last_token_time: float | None = None
    matcher: object | None = None  # structured output: the grammar matcher, advanced along the output

    def __post_init__(self):
        self.seed = sampler_seed(self.params.seed if self.params.seed is not None else random.getrandbits(64))

    def phases(self) -> dict | None:
        """A finished request's time in each phase, in seconds, as vLLM's request metrics: ``queue`` (queued until
        its prefill was first planned), ``prefill`` (until its first token), ``decode`` (first token to last),
        ``inference`` (prefill + decode); served, also ``receive`` (the ingress's arrival until the engine core had
        it) and ``inbox`` (until the loop queued it). None for one that never got a token."""
        first, queued, planned = self.first_token_time, self.queued_time, self.scheduled_time
        if first is None or queued is None or planned is None:
            return None
        out = {"queue": planned - queued, "prefill": first - planned, "decode": self.last_token_time - first,
               "inference": self.last_token_time - planned}
        if self.received_time is not None:
            out["receive"] = self.received_time - self.arrival_time
            out["inbox"] = queued - self.received_time
        return out

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens, and the final state when finished."""

    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    request: Request
    new_logprobs: list[float] = field(default_factory=list)  # of new_token_ids, when the request asked for them
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # their alternatives (asked for)
    prompt_logprobs: list | None = None  # on the request's first output, when it asked (Request.prompt_logprobs)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (Request.num_cached_tokens)


@dataclass
class Completion:
    """A request run to completion by the offline API (``Engine.generate``)."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float]
    spec: dict | None = None
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: per prompt token (Request.prompt_logprobs)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def as_dict(self) -> dict:
        d = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
             "num_prompt_tokens": len(self.prompt_token_ids)}
        if self.spec is not None:
            d["spec"] = self.spec
        if self.error:
            d["error"] = self.error
        return d
