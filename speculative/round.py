"""One speculative round, top-down: propose -> verify -> accept -> compact KV -> catch up.

Everything stays on the device with fixed shapes (no host sync), so a whole round can be captured in one CUDA graph,
or as three (``propose``, ``verify``, ``catch_up``) replayed back to back.
"""

from __future__ import annotations

import torch

from speculative.proposers import DraftContext, Proposer, RoundInputs
from speculative.tree import DraftTree
from speculative.verify import Verdict, simulated_acceptance, verify_tree
from workers.kernels.argmax import argmax_logsumexp
from workers.kernels.verdict import record_round
from workers.logits_processing import record_tokens
from workers.messages import ForwardMode
from workers.token_mask import apply_token_mask
from workers.sampling import TOP_LOGPROBS, top_logprobs


class SpecRound:
    """The round a speculative DECODE step runs: the proposer's draft tree, verified by the ``target`` runner.

    ``last_token`` / ``advance`` (per request slot, owned by the worker) get each request's bonus token (the next
    round's root) and how many tokens the round appended."""

    def __init__(self, proposer: Proposer, target, ctx: DraftContext, last_token: torch.Tensor,
                 advance: torch.Tensor, simulated_accept_length: float | None = None):
        self.proposer = proposer
        self.target = target
        self.ctx = ctx  # its page table
        self.last_token = last_token
        self.advance = advance
        # BENCHMARK ONLY (``simulated_acceptance``): a device scalar, so that a benchmark can change it between
        # captured rounds (``set_simulated_accept_length``)
        self.simulated_accept_length = None if simulated_accept_length is None else torch.full(
            (), float(simulated_accept_length), dtype=torch.float32, device=ctx.device)

    def set_simulated_accept_length(self, value: float) -> None:
        """BENCHMARK ONLY: the mean accept length of the rounds launched from now on (captured ones too)."""
        self.simulated_accept_length.fill_(value)

    def run(self, inp: RoundInputs, top: bool = False, tree: DraftTree | None = None,
            token_mask=None) -> tuple[torch.Tensor, ...]:
        """Returns (accept_len [B], out_tokens [B, S+1], out_logprobs [B, S+1]), and with ``top`` the TOP_LOGPROBS
        most likely tokens at each emitted position (ids [B, S+1, K], logprobs [B, S+1, K])."""
        tree = self.propose(inp) if tree is None else tree  # (a tree proposed earlier, verified under token_mask)
        verdict, features, alternatives = self.verify(inp, tree, top, token_mask)
        return self.catch_up(inp, tree, verdict, features, alternatives)

    def propose(self, inp: RoundInputs) -> DraftTree:
        return self.proposer.propose(inp)

    def verify(self, inp: RoundInputs, tree: DraftTree, top: bool = False, token_mask=None):
        """The target scores every node (TARGET_VERIFY), the verdict accepts a path, and the accepted nodes' K/V move
        to the positions they are kept at. Returns (verdict, the draft's target features, the alternatives or None)."""
        return self.verify_accept(inp, tree, self.verify_forward(inp, tree), top, token_mask)

    def verify_forward(self, inp: RoundInputs, tree: DraftTree) -> tuple:
        """The target's forward over the tree: (its batch, hidden states, logits [B, D, V]). Structured output splits
        the round here: the nodes' masks are computed on the host while this runs."""
        b, d, m = inp.batch_size, tree.num_nodes, inp.root_pos
        # the nodes at m .. m+D-1, RoPE at the root's position + depth (a chain's: its storage positions)
        fb = self.target.new_batch(
            ForwardMode.TARGET_VERIFY, tree.tokens.reshape(-1), inp.req_slots, inp.seq_lens, [d] * b,
            page_table=self.ctx.page_table, seq_offset=d - 1, all_logits=True, tree_mask=tree.mask,
            positions=None if tree.is_chain else (m.unsqueeze(1) + tree.depths).reshape(-1),
        )
        hidden = self.target.forward(fb)
        return fb, hidden, self.target.logits(hidden).view(b, d, -1)

    def verify_accept(self, inp: RoundInputs, tree: DraftTree, forward: tuple, top: bool = False, token_mask=None):
        """``verify`` after ``verify_forward``: the verdict under the masks, the KV compaction, the alternatives."""
        fb, hidden, logits = forward
        # structured output: each node's allowed tokens (the host's matcher along the node's path), so a draft
        # the grammar refuses has target probability 0 and the target's own choice is a masked draw
        verdict = self.accept(inp, tree, apply_token_mask(logits, token_mask))
        if token_mask is not None:  # each emitted token's logprob under the raw distribution of the node that chose it
            b, d, v = logits.shape
            # (past accept + 1 the emitted tokens are padding, clamped to stay in range)
            chosen = logits.reshape(b, d * v).gather(1, verdict.path * v + verdict.out_tokens.clamp(0, v - 1)).float()
            verdict.out_logprobs = chosen - argmax_logsumexp(logits.reshape(b * d, v))[1].view(b, d).gather(
                1, verdict.path)
        self.compact_kv(inp, verdict)
        alternatives = None
        if top:  # at each emitted token's position: the node whose logits chose it (verdict.path)
            ids, lps = top_logprobs(logits, TOP_LOGPROBS)  # [B, D, K]
            at = verdict.path.unsqueeze(2).expand(-1, -1, ids.shape[2])
            alternatives = (ids.gather(1, at), lps.gather(1, at))
        return verdict, self.proposer.target_features(fb, hidden), alternatives

    def accept(self, inp: RoundInputs, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        if self.simulated_accept_length is None:
            return verify_tree(tree, logits, inp.sampling, self.proposer.max_depth)
        return simulated_acceptance(tree, logits, inp.sampling, self.proposer.max_depth, self.simulated_accept_length)

    def compact_kv(self, inp: RoundInputs, verdict: Verdict) -> None:
        """A tree's accepted nodes move to positions m, m+1, ... (a chain's already are there)."""
        if self.proposer.topk == 1:
            return
        m = inp.root_pos
        depth = torch.arange(verdict.path.shape[1], device=self.ctx.device)
        slots = inp.req_slots.unsqueeze(1).expand_as(verdict.path)
        src = self.ctx.page_table.slots(slots, m.unsqueeze(1) + verdict.path)
        dst = self.ctx.page_table.slots(slots, m.unsqueeze(1) + depth)
        keep = depth.unsqueeze(0) <= verdict.accept_len.unsqueeze(1)
        self.target.kv_cache.move(torch.where(keep, src, dst).reshape(-1), dst.reshape(-1))

    def catch_up(self, inp: RoundInputs, tree: DraftTree, verdict: Verdict, features: torch.Tensor,
                 alternatives=None) -> tuple[torch.Tensor, ...]:
        """The draft consumes the accepted tokens; the last token the round emits (the bonus token after the
        accepted drafts) becomes the next round's root. Returns the round's outputs (``run``)."""
        self.proposer.after_verify(inp, tree, verdict, features)
        record_round(inp.req_slots, verdict.accept_len, verdict.out_tokens, self.last_token, self.advance)
        emitted = torch.arange(verdict.out_tokens.shape[1], device=verdict.out_tokens.device)
        record_tokens(inp.sampling, verdict.out_tokens, emitted.unsqueeze(0) <= verdict.accept_len.unsqueeze(1))
        outputs = (verdict.accept_len, verdict.out_tokens, verdict.out_logprobs)
        return outputs + alternatives if alternatives is not None else outputs
