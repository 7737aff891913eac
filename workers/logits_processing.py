"""Per-request logits processing before a token is chosen: logit_bias, min_tokens, and the repetition, frequency and
presence penalties. One entry point, ``process_logits``, over the logits of the rows (or draft-tree nodes) about to be
sampled or verified; the raw logits stay what logprobs are reported under (as vLLM's default ``raw_logprobs``).

State lives on the device per request slot (``LogitsState``), allocated on first use: a generated-token count row
(int32) and a prompt-token mask row (bool) per slot, and each slot's parameters. A request's slot is set up in the
step that starts its prefill (``messages.LogitsSetup``), and every step adds the tokens it emits on the device
(``record_tokens``), so the decode loop never waits for the host.

Order (vLLM's): logit_bias is added, min_tokens masks the stop ids, then the repetition penalty (divide a positive
logit, multiply a negative one, for tokens in the prompt or the output), then frequency (× count) and presence
(× seen) are subtracted, over the generated tokens.

Speculative verification applies the same function at every node of a draft tree with the counts a plain decode
would have had there: the slot's counts plus the drafted tokens on the node's path from the root (its ancestors and
itself, not the root, which the counts already hold). Only the columns of those tokens differ from the slot-level
result, so they are recomputed by gathering (at most tree-size columns per node), not with a count tensor per node.
"""

from __future__ import annotations

import torch

from workers.messages import MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS, LogitsSetup


class LogitsState:
    """Per request slot, on the device: generated-token counts, prompt-token mask and the processing parameters.
    Allocated when the first request that uses processing is set up ([slots, vocab]: 5 bytes a token)."""

    def __init__(self, num_slots: int, vocab_size: int, device):
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        self.allocated = False

    def _allocate(self) -> None:
        s, v, dev = self.num_slots, self.vocab_size, self.device
        self.counts = torch.zeros(s, v, dtype=torch.int32, device=dev)  # int32: a 128k-token output can repeat a token
        self.prompt = torch.zeros(s, v, dtype=torch.bool, device=dev)
        self.params = torch.zeros(3, s, dtype=torch.float32, device=dev)  # frequency, presence, repetition
        self.params[2] = 1.0
        self.min_tokens = torch.zeros(s, dtype=torch.int64, device=dev)
        self.stop_ids = torch.zeros(s, MAX_MIN_TOKENS_STOP_IDS, dtype=torch.int64, device=dev)
        self.bias_ids = torch.zeros(s, MAX_LOGIT_BIAS, dtype=torch.int64, device=dev)
        self.bias_vals = torch.zeros(s, MAX_LOGIT_BIAS, dtype=torch.float32, device=dev)
        self.allocated = True

    def setup(self, s: LogitsSetup) -> None:
        """Set up the slots of the requests a step starts (host→device copies and scatters only, no sync)."""
        from workers.forward_batch import to_device

        if not self.allocated:
            if not len(s.slots):
                return  # nothing uses processing yet: the neutral slots need no state
            self._allocate()
        dev = self.device
        if len(s.reset_slots):  # a slot a request without processing takes: neutral parameters
            reset = to_device(s.reset_slots, torch.int64, dev)
            self.params[:2].index_fill_(1, reset, 0.0)
            self.params[2].index_fill_(0, reset, 1.0)
            self.min_tokens.index_fill_(0, reset, 0)
            self.bias_vals.index_fill_(0, reset, 0.0)
        if not len(s.slots):
            return
        slots = to_device(s.slots, torch.int64, dev)
        self.params.index_copy_(1, slots, to_device(s.floats, torch.float32, dev))
        self.min_tokens.index_copy_(0, slots, to_device(s.min_tokens, torch.int64, dev))
        self.stop_ids.index_copy_(0, slots, to_device(s.stop_ids, torch.int64, dev))
        self.bias_ids.index_copy_(0, slots, to_device(s.bias_ids, torch.int64, dev))
        self.bias_vals.index_copy_(0, slots, to_device(s.bias_vals, torch.float32, dev))
        self.counts.index_fill_(0, slots, 0)
        self.prompt.index_fill_(0, slots, False)
        if len(s.output_ids):  # a recomputed request's outputs so far
            rows = to_device(s.output_rows, torch.int64, dev)
            ids = to_device(s.output_ids, torch.int64, dev)
            self.counts.index_put_((slots[rows], ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        if len(s.prompt_ids):
            rows = to_device(s.prompt_rows, torch.int64, dev)
            ids = to_device(s.prompt_ids, torch.int64, dev)
            self.prompt.index_put_((slots[rows], ids), torch.ones_like(ids, dtype=torch.bool))


def record_tokens(p, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
    """Count the tokens a step emitted ([B, T], where ``valid``) into the rows' slots (``p``: the step's
    ``SamplingTensors``; nothing without processing)."""
    st = p.logits_state
    if st is None:
        return
    slots = p.req_slots.unsqueeze(1).expand_as(tokens)
    ones = torch.ones_like(tokens, dtype=torch.int32) if valid is None else valid.to(torch.int32)
    st.counts.index_put_((slots, tokens), ones, accumulate=True)


def _penalize(x, counts, prompt, freq, pres, rep):
    """Repetition (tokens seen in the prompt or output), then frequency and presence (output) penalties;
    elementwise, so a gathered column gets the very values its full row would."""
    seen = counts > 0
    x = torch.where(seen | prompt, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts.to(torch.float32) - pres * seen.to(torch.float32)


def process_logits(logits: torch.Tensor, p, tree=None) -> torch.Tensor:
    """THE logits-processing entry point: the logits a request chooses its token from (fp32, a new tensor), for
    ``logits`` [B, V] (one row per request, ``p.req_slots``; its token at output position ``p.counters``) or
    [B, D, V] (the nodes of a draft ``tree``: node i's token is at output position counters + depth(i), after the
    drafted tokens on its path). ``p``: ``SamplingTensors`` with ``logits_state`` set."""
    st = p.logits_state
    flat = logits.dim() == 2
    x = logits.to(torch.float32, copy=True)
    if flat:
        x = x.unsqueeze(1)
    b, d, v = x.shape
    slots = p.req_slots
    depth = torch.zeros(b, 1, dtype=torch.int64, device=x.device)
    if tree is not None:  # (a chain's depths are 0 .. D-1)
        depth = tree.depths if tree.depths is not None else torch.arange(d, device=x.device).expand(b, d)
    # logit_bias (padding entries add 0 to token 0)
    bias_ids = st.bias_ids[slots].unsqueeze(1).expand(b, d, -1)
    x.scatter_add_(2, bias_ids, st.bias_vals[slots].unsqueeze(1).expand(b, d, -1))
    # min_tokens: the stop ids are -inf before the request's min_tokens-th token (padding repeats a real id)
    block = (p.counters.unsqueeze(1) + depth < st.min_tokens[slots].unsqueeze(1)).unsqueeze(2)
    stop = st.stop_ids[slots].unsqueeze(1).expand(b, d, -1)
    x.scatter_(2, stop, torch.where(block, float("-inf"), x.gather(2, stop)))
    freq, pres, rep = (st.params[i][slots].view(b, 1, 1) for i in range(3))
    counts, prompt = st.counts[slots].unsqueeze(1), st.prompt[slots].unsqueeze(1)
    out = _penalize(x, counts, prompt, freq, pres, rep)
    if tree is not None and d > 1:
        tokens = tree.tokens  # [B, D]
        if tree.mask is not None:
            path = tree.mask.clone()
        else:  # a chain: node i's path is nodes 1..i
            path = torch.ones(d, d, dtype=torch.bool, device=x.device).tril().expand(b, d, d).clone()
        path[:, :, 0] = False  # the root's token is in the counts already
        same = (tokens.unsqueeze(2) == tokens.unsqueeze(1)).to(torch.float32)  # [B, j, k]
        extra = torch.bmm(path.to(torch.float32), same).to(torch.int32)  # [B, i, k]: node k's token on i's path
        cols = tokens.unsqueeze(1).expand(b, d, d)
        fixed = _penalize(x.gather(2, cols), counts.expand(b, d, v).gather(2, cols) + extra,
                          prompt.expand(b, d, v).gather(2, cols), freq, pres, rep)
        out.scatter_(2, cols, fixed)  # (a token twice among the columns gets the same value twice)
    return out.squeeze(1) if flat else out
