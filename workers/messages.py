"""What crosses between the engine and the workers: a step's plan (``WorkerStep``) and its outcome (``StepResult``).

Plain lists and enums, no torch: the host-side scheduler builds and reads these without importing the device code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a chunk of it) of new tokens after a cached prefix
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # num_draft_tokens per request, tree mask over the draft block
    DRAFT_EXTEND = "draft_extend"  # draft model catches up over accepted tokens (causal, like EXTEND)


@dataclass
class WorkerStep:
    mode: ForwardMode
    req_slots: list[int]
    input_ids: list[int]  # EXTEND: the chunks' tokens. DECODE reads each request's last token on the device
    seq_lens: list[int]
    extend_lens: list[int]
    page_updates: tuple[list[int], list[int], list[int]]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]
    counters: list[int]
    # DECODE under the overlap schedule: 1 where the request's previous step is still in flight. seq_lens and
    # counters then leave out the tokens that step emits, which only the device knows (``Worker.advance``)
    pending: list[int] | None = None
    # speculative decoding
    next_ids: list[int] | None = None  # EXTEND: the token after each chunk (-1: the one sampled now)
    draft_tokens: list[list[int]] | None = None  # DECODE with host-side drafts (n-gram): [B, num_steps]
    step_id: int = 0  # the engine's number for this step, echoed in its StepResult
    top_logprobs: bool = False  # some request wants the most likely alternatives of each token (TOP_LOGPROBS)


@dataclass
class StepResult:
    tokens: list[list[int]]  # per request: the tokens this step appends (1, or accepted + bonus when speculating)
    logprobs: list[list[float]]
    spec: list[tuple[int, list[int]]] | None = None  # per request: (draft tokens proposed, accepted positions)
    timings: dict = field(default_factory=dict)
    error: str | None = None  # the step failed (its requests fail; the worker goes on)
    step_id: int = 0  # WorkerStep.step_id of the step this is the result of
    # per request, per token: the TOP_LOGPROBS most likely (token, logprob) at its position (WorkerStep.top_logprobs)
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
