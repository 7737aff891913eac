"""What crosses between the engine and the workers: a step's plan (``WorkerStep``) and its outcome (``StepResult``).

No torch: the host-side scheduler builds and reads these without importing the device code. A step's per-request
values travel packed in a few numpy arrays and a result's tokens as flat lists, so that a message costs what its
bytes cost to pickle, not a Python object per request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import accumulate, chain

import numpy as np


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a chunk of it) of new tokens after a cached prefix
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # num_draft_tokens per request, tree mask over the draft block
    DRAFT_EXTEND = "draft_extend"  # draft model catches up over accepted tokens (causal, like EXTEND)


# the rows of ``WorkerStep.ints`` and ``.floats``; the ints' first six are the rows a CUDA graph reads, in the
# order of its static inputs (``workers.graphs.StaticInputs``)
INT_FIELDS = ("req_slots", "seq_lens", "top_k", "seeds", "counters", "pending", "extend_lens", "next_ids")
FLOAT_FIELDS = ("temperature", "top_p", "min_p")
# per request: the most logit_bias entries (OpenAI's limit), and the most stop ids min_tokens holds back
MAX_LOGIT_BIAS = 300
MAX_MIN_TOKENS_STOP_IDS = 64
_ARRAYS = {"ints": np.int64, "floats": np.float32, "input_ids": np.int64, "page_updates": np.int64,
           "draft_tokens": np.int64, "token_mask": np.int32}


def _row(table: str, name: str, fields: tuple[str, ...]) -> property:
    i = fields.index(name)
    return property(lambda self: getattr(self, table)[i], doc=f"[B] {name} (a row of ``{table}``)")


@dataclass(eq=False)
class LogitsSetup:
    """The logits-processing state of the request slots a step starts (``workers.logits_processing``): ``slots``
    [E] of requests that use it, with frequency / presence / repetition penalties ``floats`` [3, E], ``min_tokens``
    [E], the ids min_tokens holds back ``stop_ids`` [E, MAX_MIN_TOKENS_STOP_IDS] (padded with a repeat of a real id),
    ``bias_ids`` / ``bias_vals`` [E, MAX_LOGIT_BIAS] (padded with token 0, bias 0), the prompt's distinct tokens
    (``prompt_rows`` indexing ``slots``, ``prompt_ids``) and the outputs so far of a recomputed request
    (``output_rows``, ``output_ids``); ``reset_slots``: requests that use none (neutral parameters)."""

    slots: np.ndarray
    floats: np.ndarray
    min_tokens: np.ndarray
    stop_ids: np.ndarray
    bias_ids: np.ndarray
    bias_vals: np.ndarray
    prompt_rows: np.ndarray
    prompt_ids: np.ndarray
    output_rows: np.ndarray
    output_ids: np.ndarray
    reset_slots: np.ndarray

    @classmethod
    def build(cls, entries: list[tuple], reset_slots: list[int]) -> "LogitsSetup":
        """``entries``: per request using processing, (slot, frequency, presence, repetition, min_tokens, stop ids,
        logit_bias {id: bias}, prompt ids, output ids)."""
        e = len(entries)
        floats = np.zeros((3, e), np.float32)
        min_tokens = np.zeros(e, np.int64)
        stop_ids = np.zeros((e, MAX_MIN_TOKENS_STOP_IDS), np.int64)
        bias_ids = np.zeros((e, MAX_LOGIT_BIAS), np.int64)
        bias_vals = np.zeros((e, MAX_LOGIT_BIAS), np.float32)
        prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
        for i, (_, freq, pres, rep, min_tok, stops, bias, prompt, outputs) in enumerate(entries):
            floats[:, i] = freq, pres, rep
            stops = list(dict.fromkeys(stops))[:MAX_MIN_TOKENS_STOP_IDS]
            min_tokens[i] = min_tok if stops else 0
            stop_ids[i] = (stops + stops[:1] * MAX_MIN_TOKENS_STOP_IDS)[:MAX_MIN_TOKENS_STOP_IDS] if stops else 0
            bias_ids[i, :len(bias)] = list(bias)
            bias_vals[i, :len(bias)] = list(bias.values())
            if rep != 1:
                distinct = set(prompt)
                prompt_rows.extend([i] * len(distinct))
                prompt_ids.extend(distinct)
            if freq or pres or rep != 1:
                output_rows.extend([i] * len(outputs))
                output_ids.extend(outputs)
        i64 = lambda x: np.asarray(x, np.int64)  # noqa: E731
        return cls(i64([en[0] for en in entries]), floats, min_tokens, stop_ids, bias_ids, bias_vals,
                   i64(prompt_rows), i64(prompt_ids), i64(output_rows), i64(output_ids), i64(reset_slots))


@dataclass(eq=False)
class WorkerStep:
    """One step for every worker. Per request, field-major: ``ints`` [len(INT_FIELDS), B] int64 and ``floats``
    [len(FLOAT_FIELDS), B] float32, each row also readable by its name (``step.seq_lens``). Build one with ``pack``.

    DECODE under the overlap schedule: ``pending`` is 1 where the request's previous step is still in flight;
    seq_lens and counters then leave out the tokens that step emits, which only the device knows (``Worker.advance``).
    ``next_ids`` (speculative EXTEND): the token after each chunk, -1 where it is the one sampled now."""

    mode: ForwardMode
    ints: np.ndarray
    floats: np.ndarray
    input_ids: np.ndarray  # [T] EXTEND: the chunks' tokens. DECODE reads each request's last token on the device
    page_updates: np.ndarray  # [3, P]: request slot, page position, page id of each page granted
    draft_tokens: np.ndarray | None = None  # [B, num_steps] DECODE with host-side drafts (n-gram)
    step_id: int = 0  # the engine's number for this step, echoed in its StepResult
    top_logprobs: bool = False  # some request wants the most likely alternatives of each token (TOP_LOGPROBS)
    # EXTEND: per request, -1, or the alternatives (0..20) of the prompt logprobs its chunk's positions give (the
    # logprob of each next prompt token under the raw distribution); None: no request asked
    prompt_logprobs: list[int] | None = None
    # structured output: [B, R, ceil(V / 32)] packed allowed-token bits (bit t % 32 of word t // 32), -1 = all; R is
    # 1, or a speculative round's tree nodes. Applied to the logits before sampling / verification
    token_mask: np.ndarray | None = None
    # structured output under overlap: the step runs up to its logits now and waits for its masks, which come in a
    # later message (``mask_message``) once the host has them; a speculative round also returns its drafts now (this
    # step's result), whose masks the host computes while the target's verify forward runs
    mask_follows: bool = False
    mask_for: int = 0  # a mask message: the id of the step waiting for ``token_mask`` (it has no rows of its own)
    logits_processing: bool = False  # some request uses penalties / logit_bias / min_tokens (workers.logits_processing)
    logits_setup: LogitsSetup | None = None  # EXTEND: the slots of the requests whose prefill starts now
    # speculative DECODE: the round's draft depth, 0 = a plain step (adaptive speculation); -1: num_steps. A
    # structured-output round drafts num_steps
    spec_depth: int = -1
    # speculative DECODE at depth 0 with the draft paused: the step without speculation (no stash, no catch-up); the
    # first after a round or a kept plain step drops every request's pending draft inputs
    draft_paused: bool = False

    req_slots = _row("ints", "req_slots", INT_FIELDS)
    seq_lens = _row("ints", "seq_lens", INT_FIELDS)
    top_k = _row("ints", "top_k", INT_FIELDS)
    seeds = _row("ints", "seeds", INT_FIELDS)
    counters = _row("ints", "counters", INT_FIELDS)
    pending = _row("ints", "pending", INT_FIELDS)
    extend_lens = _row("ints", "extend_lens", INT_FIELDS)
    next_ids = _row("ints", "next_ids", INT_FIELDS)
    temperature = _row("floats", "temperature", FLOAT_FIELDS)
    top_p = _row("floats", "top_p", FLOAT_FIELDS)
    min_p = _row("floats", "min_p", FLOAT_FIELDS)

    @classmethod
    def pack(cls, mode: ForwardMode, *, req_slots, input_ids, seq_lens, extend_lens, page_updates, temperature,
             top_k, top_p, min_p, seeds, counters, pending=None, next_ids=None, draft_tokens=None,
             step_id: int = 0, top_logprobs: bool = False, prompt_logprobs: list[int] | None = None,
             logits_processing: bool = False, logits_setup: LogitsSetup | None = None) -> "WorkerStep":
        """A step from per-request sequences (``pending`` None: none in flight; ``next_ids`` None: all -1)."""
        b = len(req_slots)
        ints = (req_slots, seq_lens, top_k, seeds, counters, [0] * b if pending is None else pending, extend_lens,
                [-1] * b if next_ids is None else next_ids)
        floats = (temperature, top_p, min_p)
        if any(len(row) != b for row in ints + floats):
            raise ValueError("every per-request sequence of a step needs one value per request")
        # (fromiter over the chained rows: about half the time of np.array on the nested lists)
        return cls(mode, np.fromiter(chain(*ints), np.int64, len(ints) * b).reshape(-1, b),
                   np.fromiter(chain(*floats), np.float32, len(floats) * b).reshape(-1, b),
                   np.asarray(input_ids, dtype=np.int64), np.array(page_updates, dtype=np.int64).reshape(3, -1),
                   None if draft_tokens is None else np.array(draft_tokens, dtype=np.int64).reshape(b, -1),
                   step_id, top_logprobs, prompt_logprobs, logits_processing=logits_processing,
                   logits_setup=logits_setup)

    @classmethod
    def mask_message(cls, step_id: int, token_mask: np.ndarray) -> "WorkerStep":
        """The masks of a ``mask_follows`` step (``step_id``: the result's id), which the worker then finishes."""
        return cls(ForwardMode.DECODE, np.zeros((len(INT_FIELDS), 0), np.int64),
                   np.zeros((len(FLOAT_FIELDS), 0), np.float32), np.zeros(0, np.int64), np.zeros((3, 0), np.int64),
                   token_mask=np.ascontiguousarray(token_mask, dtype=np.int32), mask_for=step_id)

    @property
    def batch_size(self) -> int:
        return self.ints.shape[1]

    # each array pickles as (bytes, shape): numpy's own pickling costs microseconds per array (its dtype object)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in _ARRAYS:
            if state[name] is not None:
                state[name] = (state[name].tobytes(), state[name].shape)
        return state

    def __setstate__(self, state: dict) -> None:
        for name, dtype in _ARRAYS.items():
            if state[name] is not None:  # (read-only views of the pickled bytes)
                data, shape = state[name]
                state[name] = np.frombuffer(data, dtype).reshape(shape)
        self.__dict__.update(state)


@dataclass
class StepResult:
    """A step's tokens: every request's, one request after another, in the step's batch order (flat lists pickle
    as one run of values, nested ones as a list per request)."""

    tokens: list[int]  # per request the tokens this step appends: 1, or accepted drafts + 1 when speculating
    logprobs: list[float]
    counts: list[int] | None = None  # tokens per request (None: one each)
    num_drafts: int = 0  # a speculative round: draft tokens proposed per request
    # adaptive depth 0: the step caught the draft up first (some row's stash was full), every row behind, not only
    # the full ones (``lag_after_plain_step``: the scheduler's per-request count follows the worker's by it)
    caught_up: bool = False
    timings: dict = field(default_factory=dict)
    error: str | None = None  # the step failed (its requests fail; the worker goes on)
    step_id: int = 0  # WorkerStep.step_id of the step this is the result of
    # per request, per token: the TOP_LOGPROBS most likely (token, logprob) at its position (WorkerStep.top_logprobs)
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # per request (WorkerStep.prompt_logprobs): None, or its chunk's prompt logprobs (the tokens after each of its
    # positions, the token after the chunk too where it is a prompt token) and each one's alternatives
    prompt_logprobs: list[tuple[list[float], list[list[tuple[int, float]]]] | None] | None = None
    draft_parents: list[int] | None = None  # a ``mask_follows`` round's drafts: tree parents (``tokens``: nodes)

    def offsets(self) -> list[int]:
        """[B + 1]: request i's tokens are ``tokens[offsets[i]:offsets[i + 1]]``."""
        if self.counts is None or not self.num_drafts:  # (a plain step, adaptive depth 0 too: one token each)
            return list(range(len(self.tokens) + 1))
        return [0, *accumulate(self.counts)]

    def spec(self) -> list[tuple[int, range]] | None:
        """A speculative round's per request (draft tokens proposed, accepted positions); None for a plain step
        (adaptive speculation's depth 0 too: no drafts, nothing to count)."""
        if self.counts is None or not self.num_drafts:
            return None
        return [(self.num_drafts, range(n - 1)) for n in self.counts]
