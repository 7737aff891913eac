"""Structured output on the host: grammars compiled by xgrammar, one matcher per request, and the packed token
bitmasks a step carries to the workers (``WorkerStep.token_mask``: bit t of word t // 32 set = token t allowed).

A matcher follows the tokens a request has been given (``advance``). Under speculation, a round's draft tree is
walked from the root along each node's path (advance, fill the node's mask, roll back), so every verified position
gets the mask of the prefix it extends; drafts the grammar refuses get target probability 0 and are rejected.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import numpy as np

from deployments.engine.request import InvalidRequest

logger = logging.getLogger("specserve")


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match. ``kind``: json_object | json_schema | regex | choice; ``value``: the
    schema (JSON text), regex, or the choices (a tuple); ``param``: the request field it came from (for a 400)."""

    kind: str
    value: str | tuple[str, ...] | None = None
    param: str = "response_format"


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarEngine:
    """The compiler (its cache is keyed by the grammar text) for one tokenizer and one logits width."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        # fills a batch's masks on a pool of threads (half the host's cores), outside the GIL
        self.batch = xgr.BatchGrammarMatcher()

    def compile(self, spec: GuidedSpec):
        """The compiled grammar, or InvalidRequest naming the field at fault."""
        try:
            if spec.kind == "json_object":
                # any JSON object (the builtin JSON grammar would allow arrays and scalars too)
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                json.loads(spec.value)
                return self.compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                choices = [c for c in spec.value]
                if not choices or not all(isinstance(c, str) for c in choices):
                    raise ValueError("choices must be a non-empty list of strings")
                rule = " | ".join(json.dumps(c) for c in choices)
                return self.compiler.compile_grammar(f"root ::= {rule}")
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError for a bad schema/regex
            # (less xgrammar's "[time] its/source.cc:line: " prefix: the client gets the reason, not our internals)
            reason = re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", str(e).strip().splitlines()[-1])
            raise InvalidRequest(f"invalid {spec.param}: {reason}", spec.param) from None
        raise InvalidRequest(f"unsupported {spec.param} type {spec.kind!r}", spec.param)

    def matcher(self, spec: GuidedSpec):
        return self._xgr.GrammarMatcher(self.compile(spec))


def advance(matcher, token_ids: list[int]) -> int:
    """The request was given these tokens: the matcher follows. Returns how many it took: all, or those up to the one
    that ended the grammar (the rest came after its end: with ``ignore_eos``, or a round's run past its stop token)."""
    for i, t in enumerate(token_ids):
        if matcher.is_terminated():
            return i
        if not matcher.accept_token(t):  # cannot happen under the mask; logged, not fatal
            logger.warning("grammar matcher refused token %d", t)
            return len(token_ids)
    return len(token_ids)


def fill(matcher, out: np.ndarray) -> None:
    """``out`` [W] int32: the matcher's allowed next tokens; all allowed once it has terminated (tokens past the
    end are dropped by the stop anyway)."""
    if matcher.is_terminated():
        out[:] = -1
        return
    import torch

    t = torch.from_numpy(out).view(1, -1)
    matcher.fill_next_token_bitmask(t)


def fill_rows(matchers: list, rows: list[int], out: np.ndarray, batch=None) -> None:
    """Row ``rows[k]`` of ``out`` [N, W] int32 gets ``matchers[k]``'s allowed next tokens (``fill``); with ``batch``
    (an xgrammar ``BatchGrammarMatcher``), filled in one call on its threads."""
    live = [(m, r) for m, r in zip(matchers, rows) if not m.is_terminated()]
    for m, r in zip(matchers, rows):
        if m.is_terminated():
            out[r] = -1
    if batch is None or len(live) < 2:
        for m, r in live:
            fill(m, out[r])
        return
    import torch

    batch.batch_fill_next_token_bitmask([m for m, _ in live], torch.from_numpy(out), indices=[r for _, r in live])


def step_masks(matchers: list, words: int, batch=None) -> np.ndarray | None:
    """[B, 1, W] masks for a plain step (None if no request has a grammar)."""
    if all(m is None for m in matchers):
        return None
    out = np.full((len(matchers), 1, words), -1, dtype=np.int32)
    rows = [i for i, m in enumerate(matchers) if m is not None]
    fill_rows([matchers[i] for i in rows], rows, out.reshape(len(matchers), words), batch)
    return out


def tree_masks(matchers: list, tokens: np.ndarray, parents: np.ndarray | None, words: int,
               batch=None) -> np.ndarray:
    """[B, D, W] masks for a round's draft tree (tokens [B, D], node 0 the root, already given to the matcher;
    parents [B, D] or None for a chain). Node j's mask is the matcher's after the drafts on the path to j; a node
    below a draft the grammar refuses can never be reached, so it is left all-allowed."""
    b, d = tokens.shape
    out = np.full((b, d, words), -1, dtype=np.int32)
    if parents is None:  # a chain: the batch walks down it together, each depth's masks filled in one call
        flat = out.reshape(b * d, words)
        live = [i for i, m in enumerate(matchers) if m is not None]
        taken = dict.fromkeys(live, 0)
        for j in range(d):
            if j:  # on along draft j where the grammar takes it (below a refused draft: unreachable, all-allowed)
                live = [i for i in live if not matchers[i].is_terminated()
                        and matchers[i].accept_token(int(tokens[i, j]))]
                for i in live:
                    taken[i] += 1
            fill_rows([matchers[i] for i in live], [i * d + j for i in live], flat, batch)
        for i, n in taken.items():
            if n:
                matchers[i].rollback(n)
        return out
    for i, m in enumerate(matchers):
        if m is None:
            continue
        fill(m, out[i, 0])
        for j in range(1, d):
            path, k = [], j
            while k > 0:  # the drafts from the root's child down to node j
                path.append(int(tokens[i, k]))
                k = int(parents[i, k])
            taken = 0
            for t in reversed(path):
                if m.is_terminated() or not m.accept_token(t):
                    break
                taken += 1
            if taken == len(path):
                fill(m, out[i, j])
            if taken:
                m.rollback(taken)
    return out
