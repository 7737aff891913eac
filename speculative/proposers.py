"""Draft proposers. Each turns the state of a batch into a draft tree and keeps its draft model in step:

- ``after_extend``: after a target EXTEND (prefill chunk), the draft consumes the same tokens (DRAFT_EXTEND);
- ``propose``: the multi-step draft → ``DraftTree`` (root = the last verified token, stored at KV position m);
- ``after_verify``: the draft consumes the accepted tokens (fixed shape, padded: no host sync).

``propose`` and ``after_verify`` read only a ``RoundInputs`` of device tensors, so a whole round can be captured in
a CUDA graph (sequence lengths are host lists in eager rounds, device tensors in graphs; batches take them with a
``seq_offset``, which ``ForwardBatch.build`` applies on the host or in its metadata kernel).

KV layout of a round for a request whose root sits at position m (pages cover m + ``lookahead``): the target
verifies D nodes at m .. m+D-1; the draft's step s >= 2 writes its k frontier nodes to a scratch area starting at
m (EAGLE) or m+1 (standalone draft, whose step 1 consumes the root at m); DRAFT_EXTEND rewrites m .. m+S.

EAGLE's draft position p holds the pair (token p+1, target feature p); the standalone draft's holds token p.

Lazy catch-up (adaptive speculation's plain steps): a depth-0 step is the target's plain decode step. It leaves the
draft's position m (its root's) unconsumed and only ``stash``es what the draft needs there (EAGLE: the sampled
token and the target's features at m; the standalone draft: the root) in a per-slot ring of ``catch_up_window``
positions. Before the next round, ``catch_up`` runs the draft over every stashed position at once (one
DRAFT_EXTEND), which leaves its KV and state as if it had followed every step. A head of one layer writes only its
KV at each request's positions but the last (a position's K/V read its own input alone), and runs the whole layer
at the last one, whose outputs the next round starts from. When the ring is full, a plain step first consumes all
but each request's newest position (``catch_up_behind``): no round follows yet, so the whole-layer pass waits for
the one that does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from speculative.adaptive import keeps_newest
from speculative.tree import DraftTree, TreeCandidates, chain_tree
from speculative.verify import Verdict
from workers.forward_batch import ForwardBatch, to_device
from workers.kernels.argmax import argmax_logsumexp
from workers.kv_cache import PageTable
from workers.layers import TPGroup
from workers.messages import ForwardMode
from workers.sampling import SamplingTensors


@dataclass
class DraftContext:
    """What a proposer takes from its worker: where and how its draft model runs, the target model it may share
    weights with, and the page table (set when the worker allocates the KV cache)."""

    device: torch.device
    dtype: torch.dtype
    tp: TPGroup  # the draft's TP group: the target's, or this rank alone
    rope_len: int  # RoPE positions: past the context, where a round near the end drafts
    max_requests: int  # request slots, the CUDA-graph padding slot included
    target: nn.Module  # EAGLE shares its embedding (and LM head); a standalone draft must share its vocabulary
    attention: dict = field(default_factory=dict)  # ModelRunner's attention backend keywords
    page_table: PageTable | None = None

    def runner(self, path: str, config, max_positions: int | None = None, build_model=None):
        """A ModelRunner for the draft model at ``path``."""
        from workers.model_runner import ModelRunner

        return ModelRunner(path, device=self.device, dtype=self.dtype, tp=self.tp, config=config,
                           max_positions=max_positions or self.rope_len, build_model=build_model, **self.attention)


@dataclass
class RoundInputs:
    """One speculative round's inputs (views of static buffers when the round replays in a CUDA graph)."""

    root: torch.Tensor  # [B] int64, the last verified token of each request
    req_slots: torch.Tensor  # [B] int64
    seq_lens: list[int] | torch.Tensor  # [B] KV length including the root (host list in eager rounds)
    root_pos: torch.Tensor  # [B] int64 device, = seq_lens - 1
    sampling: SamplingTensors
    drafts: torch.Tensor | None = None  # [B, num_steps] host-proposed drafts (n-gram)

    @property
    def batch_size(self) -> int:
        return self.root.shape[0]


def _lookahead(num_steps: int, topk: int, num_draft_tokens: int) -> int:
    return max(num_draft_tokens, num_steps + 1, 1 + (num_steps - 1) * topk)


class Proposer:
    """Base: chain of drafts given by the host (n-gram); subclasses run a draft model on the device."""

    # target layers whose input hidden states the proposer reads (``target_features``): the worker has the target
    # capture them (``LlamaForCausalLM.capture_aux_hidden``)
    target_aux_layers: tuple[int, ...] = ()

    def __init__(self, ctx: DraftContext, spec_cfg):
        self.ctx = ctx
        self.num_steps = spec_cfg.num_steps
        self.topk = spec_cfg.topk
        self.num_draft_tokens = spec_cfg.num_draft_tokens
        self.lookahead = _lookahead(self.num_steps, self.topk, self.num_draft_tokens)
        self.full_steps = self.num_steps

    @contextlib.contextmanager
    def at_depth(self, depth: int | None):
        """Rounds inside draft a chain of ``depth`` tokens (adaptive speculation's tiers; None: the configured
        depth). Depth 0 would verify the root alone; the worker runs its plain decode step instead (``stash``,
        ``catch_up``)."""
        if depth is None or depth == self.full_steps:
            yield
            return
        if self.topk != 1 or not 0 <= depth <= self.full_steps:
            raise ValueError(f"a round of depth {depth}: chains of 0..{self.full_steps} only")
        saved = self.num_steps, self.num_draft_tokens
        self.num_steps, self.num_draft_tokens = depth, depth + 1
        try:
            yield
        finally:
            self.num_steps, self.num_draft_tokens = saved

    # ---- lazy catch-up after plain steps (adaptive speculation's depth 0) ------------------------------------------
    catch_up_window = 0  # positions a request slot's stash holds (0: no draft state to keep, or none allocated)

    @property
    def keeps_draft_state(self) -> bool:
        """Whether plain steps leave the draft behind (a draft model's KV and state): n-gram drafts from the host."""
        return False

    def allocate_stash(self, window: int) -> None:
        pass

    def stash(self, inp: "RoundInputs", fb: ForwardBatch, hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        """A plain step at root position m: keep what the draft will consume at position m (device only)."""

    def catch_up(self, slots: np.ndarray, root_pos: np.ndarray, lags: np.ndarray) -> None:
        """The draft consumes the ``lags[i]`` positions before each root (``root_pos[i]``) of request slot
        ``slots[i]`` from the stash (host arrays, every lag in 1..catch_up_window): afterwards its KV and state are
        what following every plain step would have left."""

    @property
    def keeps_newest(self) -> bool:
        """Whether a plain step on a full stash runs ``catch_up_behind`` (else ``catch_up``): ``keeps_newest``."""
        return keeps_newest(self.catch_up_window)

    def catch_up_behind(self, slots: np.ndarray, root_pos: np.ndarray, lags: np.ndarray) -> None:
        """``catch_up`` over each request's stashed positions but its newest (a plain step on a full stash frees
        a column of the ring; the newest position stays stashed for the catch-up before the next round)."""
        slots, root_pos, lags = (np.asarray(x, np.int64) for x in (slots, root_pos, lags))
        behind = lags > 1
        if behind.any():
            self.catch_up(slots[behind], root_pos[behind] - 1, lags[behind] - 1)

    def _root_only(self, inp: "RoundInputs") -> DraftTree:
        return chain_tree(inp.root, inp.root.new_empty(inp.batch_size, 0))

    @property
    def max_depth(self) -> int:
        return self.num_steps

    @property
    def tree_size(self) -> int:
        """Nodes verified per round, the root included (a host-drafted chain: root + num_steps)."""
        return self.num_steps + 1

    def kv_bytes_per_token(self) -> int:
        return 0

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        pass

    def target_features(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """What the draft reads of a target forward (its final hidden states, unless a subclass says otherwise)."""
        return hidden

    def after_extend(self, fb: ForwardBatch, features: torch.Tensor, sampled: torch.Tensor, next_ids) -> None:
        """After the target's prefill ``fb`` (``next_ids``: per request, the token after its chunk, -1 where the
        chunk ends the prompt: the token ``sampled`` then follows it)."""

    def _extend_batch(self, fb: ForwardBatch, ids: torch.Tensor) -> ForwardBatch:
        """The draft's DRAFT_EXTEND over the rows of the target's prefill ``fb``, with its lengths as the host knows
        them (in a prefill graph only the device has them: the host has their bound)."""
        if fb.seq_lens_cpu is None:
            return self.runner.new_batch(ForwardMode.DRAFT_EXTEND, ids, fb.req_slots, fb.seq_lens, fb.extend_lens,
                                         page_table=self.ctx.page_table, max_extend=max(fb.extend_lens_cpu))
        return self.runner.new_batch(ForwardMode.DRAFT_EXTEND, ids, fb.req_slots, fb.seq_lens_cpu, fb.extend_lens_cpu,
                                     page_table=self.ctx.page_table)

    def propose(self, inp: RoundInputs) -> DraftTree:
        return chain_tree(inp.root, inp.drafts[:, :self.num_steps])  # (a shallower round: the first drafts)

    def after_verify(self, inp: RoundInputs, tree: DraftTree, verdict: Verdict, features: torch.Tensor) -> None:
        pass

    # ---- shared helpers --------------------------------------------------------------------------------------
    def _batch(self, runner, mode, ids, inp: RoundInputs, ext_len: int, seq_offset: int = 0, **kwargs):
        """A draft-side ForwardBatch over the round's request slots, with ``ext_len`` tokens each and KV lengths
        ``inp.seq_lens + seq_offset`` (``ForwardBatch.build``'s keywords pass through)."""
        return runner.new_batch(mode, ids, inp.req_slots, inp.seq_lens, [ext_len] * inp.batch_size,
                                page_table=self.ctx.page_table, seq_offset=seq_offset, **kwargs)


class _ModelProposer(Proposer):
    """Shared multi-step tree drafting for EAGLE heads and standalone draft models."""

    runner = None
    scratch_offset = 0  # first scratch position relative to m

    @property
    def tree_size(self) -> int:
        return self.num_draft_tokens

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        self.runner.allocate_kv_cache(num_pages, page_size)

    stash_tokens: torch.Tensor | None = None  # [slots, window] int64: the token each stashed position consumes
    stash_features: torch.Tensor | None = None  # [slots, window, F]: its target features (EAGLE), ring by position

    @property
    def keeps_draft_state(self) -> bool:
        return True

    def stash_width(self) -> int:
        """Target features stashed per position (0: none, a standalone draft reads tokens only)."""
        return 0

    def allocate_stash(self, window: int) -> None:
        if self.catch_up_window == window:
            return
        n, dev = self.ctx.max_requests, self.ctx.device
        self.stash_tokens = torch.zeros(n, window, dtype=torch.int64, device=dev)
        width = self.stash_width()
        self.stash_features = torch.zeros(n, window, width, dtype=self.ctx.dtype, device=dev) if width else None
        self.catch_up_window = window

    def _stash_at(self, inp: RoundInputs, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Ring column root_pos % window of each row's slot (padding rows write their own slot's row)."""
        if self.stash_tokens is None:  # (no plain steps: nothing to keep)
            return
        col = inp.root_pos % self.catch_up_window
        self.stash_tokens[inp.req_slots, col] = tokens.to(self.stash_tokens.dtype)
        if features is not None:
            self.stash_features[inp.req_slots, col] = features.to(self.stash_features.dtype)

    def _stashed(self, slots: np.ndarray, root_pos: np.ndarray, lags: np.ndarray):
        """(DRAFT_EXTEND batch over the stashed positions root_pos - lag .. root_pos - 1, their features or
        None)."""
        w = self.catch_up_window
        lags = np.asarray(lags, np.int64)
        start = np.asarray(root_pos, np.int64) - lags
        offsets = np.arange(int(lags.sum())) - np.repeat(np.cumsum(lags) - lags, lags)
        rows = np.repeat(np.asarray(slots, np.int64), lags) * w + (np.repeat(start, lags) + offsets) % w
        rows = to_device(rows, torch.int64, self.ctx.device)
        ids = self.stash_tokens.view(-1).index_select(0, rows)
        feats = None
        if self.stash_features is not None:
            feats = self.stash_features.view(-1, self.stash_features.shape[-1]).index_select(0, rows)
        # KV lengths after it: each request's root position (the positions before its root)
        fb = self.runner.new_batch(ForwardMode.DRAFT_EXTEND, ids, np.asarray(slots).tolist(),
                                   np.asarray(root_pos).tolist(), lags.tolist(), page_table=self.ctx.page_table)
        return fb, feats

    def _draft_forward(self, fb: ForwardBatch, features: torch.Tensor | None):
        """Returns ((draft scores [N, V'] (``_draft_scores``), d2t or None: draft id → target id), next-step
        features)."""
        raise NotImplementedError

    @property
    def chain(self) -> bool:
        """Top-1 drafting: the tree is the chain of each step's argmax. Its drafts need no scores, so the draft
        heads skip the log-softmax (``_draft_scores``) and each step takes one split-row argmax
        (``kernels.argmax.argmax_logsumexp``: ``torch.topk`` runs a radix select of several kernels, and ``max``
        reduces a row in one block)."""
        return self.topk == 1

    def _draft_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """What drafts are chosen and ranked by: log-probs for a tree; for a chain the logits (the same argmax)."""
        return logits if self.chain else torch.log_softmax(logits.float(), -1)

    def _topk(self, logp: torch.Tensor, d2t: torch.Tensor | None,
              ids_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [N, k], scores [N, k]) of each row's best k drafts, as target ids. A chain's score is the row's
        log-normaliser (the chain never ranks by it); its ids go to ``ids_out`` [N] when given (in place)."""
        if self.chain:  # the argmax kernels map draft ids to target ids themselves
            ids, lse = argmax_logsumexp(logp, remap=d2t, ids_out=ids_out)
            return ids.unsqueeze(1), lse.unsqueeze(1)
        vals, ids = logp.topk(self.topk, dim=-1)
        if d2t is not None:
            ids = ids + d2t[ids]
        return ids, vals

    def _expand_steps(self, inp: RoundInputs, cand: TreeCandidates, frontier_feat: torch.Tensor | None,
                      first_step: int, seq_offset: int, root_visible: bool) -> None:
        """Steps first_step..S: expand the frontier (k nodes per request) one level per step; step s's KV length
        is ``seq_lens + seq_offset + (s - first_step + 1) * k``."""
        k, b, m = self.topk, inp.batch_size, inp.root_pos
        num = self.num_steps + 1 - first_step
        positions = None  # a chain's scratch nodes sit at their storage positions
        if not self.chain:
            depths = torch.arange(first_step - 1, self.num_steps, device=m.device)
            positions = (m.unsqueeze(0) + depths.unsqueeze(1) - 1 + self.scratch_offset).repeat_interleave(k, dim=1)
        # the round's metadata, built once: step s feeds the frontier of depth s-1 into k more scratch slots; the
        # tree masks (k > 1; a chain's scratch block is plain causal) start with every node seeing itself (and the
        # root when it opens the block), and each step adds only its parents' rows (``advance``)
        rnd = self.runner.build_steps(ForwardMode.DECODE, inp.req_slots, inp.seq_lens, k, steps=num,
                                      seq_offset=seq_offset, positions=positions,
                                      page_table=self.ctx.page_table, tree_prefix=int(root_visible))
        frontier_ids = cand.tokens[:1].t() if self.chain else cand.tokens.gather(1, cand.frontier)  # [B, k]
        for i, fb in enumerate(rnd):
            fb.input_ids = frontier_ids.reshape(-1)  # [B * k]
            (logp, d2t), feat = self._draft_forward(fb, frontier_feat)
            child_ids, child_logp = self._topk(logp, d2t, cand.next_chain_node() if self.chain else None)
            origin = cand.expand(child_ids.view(b, k, k), child_logp.view(b, k, k))
            if i + 1 == len(rnd):
                break
            frontier_ids = child_ids.view(b, k) if self.chain else cand.tokens.gather(1, cand.frontier)
            rnd.advance(i + 1, origin)
            if feat is not None:  # each new frontier node carries its parent's output feature
                frontier_feat = feat if self.chain else feat.view(b, k, -1).gather(
                    1, origin.unsqueeze(2).expand(b, k, feat.shape[-1])).reshape(b * k, -1)


class EagleProposer(_ModelProposer):
    """EAGLE-1/2 and EAGLE-3 heads (``naive`` is EAGLE with one step, top-1, two verified tokens)."""

    # the catch-up of a one-layer head (``EagleHead.kv_from_inputs``): the KV alone at every stashed position but
    # each request's last (K/V read only their position's input), the whole layer and the logits at the last one
    kv_only_catch_up = False

    def __init__(self, ctx: DraftContext, spec_cfg):
        super().__init__(ctx, spec_cfg)
        from workers.models.eagle import EagleHead, load_eagle_config

        cfg, raw = load_eagle_config(spec_cfg.model)
        target = ctx.target
        self.runner = ctx.runner(spec_cfg.model, cfg, build_model=lambda: EagleHead(
            cfg, raw, ctx.dtype, ctx.tp, ctx.rope_len, target.cfg.hidden_size))
        self.head: EagleHead = self.runner.model
        self.head.attach_target(target)
        self.kv_only_catch_up = self.head.kv_from_inputs
        if self.head.eagle3:
            self.target_aux_layers = self.head.aux_layer_ids
        n, k, h = ctx.max_requests, self.topk, cfg.hidden_size
        self.state_ids = torch.zeros(n, k, dtype=torch.int64, device=ctx.device)
        self.state_logp = torch.zeros(n, k, dtype=torch.float32, device=ctx.device)
        self.state_feat = torch.zeros(n, h, dtype=ctx.dtype, device=ctx.device)

    def target_features(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        return self._fuse(self._raw_features(fb, hidden))

    def _fuse(self, raw: torch.Tensor) -> torch.Tensor:
        return self.head.fuse_target_features(raw) if self.head.eagle3 else raw

    def _raw_features(self, fb: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The target's features before the head's fusion (EAGLE-3: the captured layers, fused by its fc)."""
        return fb.aux["aux_hidden"] if self.head.eagle3 else hidden

    def stash_width(self) -> int:
        return self.ctx.target.cfg.hidden_size * (len(self.target_aux_layers) if self.head.eagle3 else 1)

    def stash(self, inp, fb, hidden, sampled):
        # draft position m pairs the token after the root (sampled now) with the target's features at m; the
        # features are kept unfused, so the plain step runs no draft weights (the catch-up fuses them)
        self._stash_at(inp, sampled, self._raw_features(fb, hidden))

    def catch_up(self, slots, root_pos, lags):
        if self.kv_only_catch_up:
            slots, root_pos, lags = (np.asarray(x, np.int64) for x in (slots, root_pos, lags))
            self.catch_up_behind(slots, root_pos, lags)  # every stashed position but each request's last
            lags = np.ones_like(lags)  # the last: the whole layer, attending over the KV just stored
        fb, raw = self._stashed(slots, root_pos, lags)
        (logp, d2t), feat = self._draft_forward(fb, self._fuse(raw))
        self._save_state(fb.req_slots, logp, d2t, feat)  # from each request's last pair: the root's first draft

    def catch_up_behind(self, slots, root_pos, lags):
        if not self.kv_only_catch_up:
            return super().catch_up_behind(slots, root_pos, lags)
        slots, root_pos, lags = (np.asarray(x, np.int64) for x in (slots, root_pos, lags))
        behind = lags > 1
        if behind.any():  # a one-layer head: the KV alone (its state is the last position's, left for later)
            kfb, raw = self._stashed(slots[behind], root_pos[behind] - 1, lags[behind] - 1)
            self.runner.store_kv(kfb, features=self._fuse(raw))

    @property
    def fixed_shape_catch_up(self) -> bool:
        """Whether ``catch_up_fixed`` can run the catch-up (a one-layer head with its stash allocated)."""
        return self.kv_only_catch_up and self.stash_tokens is not None

    def catch_up_fixed(self, slots: torch.Tensor, root_pos: torch.Tensor, lags: torch.Tensor, pad_slot: int,
                       span: int | None = None, whole_last: bool = True) -> None:
        """``catch_up`` from device tensors [B] in shapes that depend on B and ``span`` alone (what a CUDA graph
        replays), for a one-layer head and lags of at most ``span`` (default ``catch_up_window``): the KV-only pass
        over ``span`` - 1 rows per request, the positions before its ``lags[b]`` - 1 rows read from the padding
        slot's stash and written to its page (page 0); then, with ``whole_last``, the whole layer at each request's
        last position (without: ``catch_up_behind``). A row of lag 0 (not behind) runs on the padding slot: it
        changes nothing. The KV and state written are ``catch_up``'s (on the rows it uses, the same computation)."""
        w = self.catch_up_window
        span = w if span is None else span
        if not 1 <= span <= w:
            raise ValueError(f"a catch-up span of {span} outside the stash's 1..{w}")
        b = slots.shape[0]
        live = (lags > 0).long()
        slots = pad_slot + (slots - pad_slot) * live
        root = w + (root_pos - w) * live  # (the padding slot's positions 0 .. w - 1)
        feats = self.stash_features
        if span > 1:
            j = torch.arange(span - 1, device=slots.device)
            valid = (j >= (span - lags).unsqueeze(1)).long()  # [B, span - 1]: positions root - lag .. root - 2
            tok_slot = (pad_slot + (slots.unsqueeze(1) - pad_slot) * valid).reshape(-1)
            tok_pos = (j + (root.unsqueeze(1) - span) * valid).reshape(-1)  # (padding rows: page 0's positions)
            rows = tok_slot * w + tok_pos % w  # (the ring's column: by the stash's window)
            ids = self.stash_tokens.view(-1).index_select(0, rows)
            raw = None if feats is None else feats.view(-1, feats.shape[-1]).index_select(0, rows)
            # one token per row: a row's K/V read only its own input, so the requests' rows need no grouping
            kfb = self.runner.new_batch(ForwardMode.DRAFT_EXTEND, ids, tok_slot, tok_pos + 1, [1] * (b * (span - 1)),
                                        page_table=self.ctx.page_table)
            self.runner.store_kv(kfb, features=self._fuse(raw))
        if not whole_last:
            return
        rows = slots * w + (root - 1) % w
        ids = self.stash_tokens.view(-1).index_select(0, rows)
        raw = None if feats is None else feats.view(-1, feats.shape[-1]).index_select(0, rows)
        fb = self.runner.new_batch(ForwardMode.DRAFT_EXTEND, ids, slots, root, [1] * b,
                                   page_table=self.ctx.page_table)
        (logp, d2t), feat = self._draft_forward(fb, self._fuse(raw))
        self._save_state(fb.req_slots, logp, d2t, feat)

    def _draft_forward(self, fb, features):
        hidden, feat = self.runner.forward(fb, features=features)  # at the logits rows
        with torch.inference_mode():
            logits, d2t = self.head.compute_logits(hidden)
        return (self._draft_scores(logits), d2t), feat

    def _save_state(self, slots: torch.Tensor, logp, d2t, feat) -> None:
        if self.chain:  # the argmax writes each request's draft into its slot; a chain never ranks its drafts
            argmax_logsumexp(logp, remap=d2t, ids_out=self.state_ids.view(-1), ids_rows=slots)
        else:
            ids, vals = self._topk(logp, d2t)
            self.state_ids[slots] = ids
            self.state_logp[slots] = vals.to(self.state_logp.dtype)
        self.state_feat[slots] = feat.to(self.state_feat.dtype)

    def after_extend(self, fb, features, sampled, next_ids):
        # pair (token p+1, feature p): shift the chunk's tokens left, the token after the chunk comes last
        nxt = to_device(next_ids, torch.int64, sampled.device)
        nxt = torch.where(nxt >= 0, nxt, sampled)
        ids = torch.roll(fb.input_ids, -1)
        ids[fb.logits_indices] = nxt
        dfb = self._extend_batch(fb, ids)
        (logp, d2t), feat = self._draft_forward(dfb, features)
        self._save_state(dfb.req_slots, logp, d2t, feat)

    def propose(self, inp):
        if self.num_steps == 0:
            return self._root_only(inp)
        slots = inp.req_slots
        cand = TreeCandidates(inp.batch_size, self.topk, self.num_steps, slots.device, chain=self.chain)
        if self.chain:  # gathered straight into the chain's first node
            cand.add_root_children(torch.index_select(self.state_ids.view(-1), 0, slots, out=cand.next_chain_node()),
                                   None)
        else:
            cand.add_root_children(self.state_ids[slots], self.state_logp[slots])
        if self.num_steps > 1:
            feat = self.state_feat[slots]
            if not self.chain:
                feat = feat.repeat_interleave(self.topk, dim=0)
            self._expand_steps(inp, cand, feat, first_step=2, seq_offset=-1, root_visible=False)
        return cand.build(inp.root, self.num_draft_tokens, self.max_depth)

    def after_verify(self, inp, tree, verdict: Verdict, features):
        b, s1 = verdict.out_tokens.shape  # S + 1 tokens per request: t_{m+1} .. t_{m+S+1}, valid up to accept
        if tree.is_chain:  # the accepted nodes are its first ones, in order (the rows past the
            feats = features  # accepted ones feed positions that the next round writes before it reads them)
        else:
            feats = features.view(b, tree.num_nodes, -1).gather(
                1, verdict.path.unsqueeze(2).expand(b, s1, features.shape[-1])).reshape(b * s1, -1)
        # at positions m .. m+S (their storage positions), logits at the bonus token's row
        fb = self._batch(self.runner, ForwardMode.DRAFT_EXTEND, verdict.out_tokens.reshape(-1), inp, s1,
                         seq_offset=s1 - 1, logits_at=verdict.accept_len)
        (logp, d2t), feat = self._draft_forward(fb, feats)
        self._save_state(fb.req_slots, logp, d2t, feat)


class MTPProposer(EagleProposer):
    """DeepSeek-V3's MTP (NextN) layer of the target checkpoint (or of ``model``) drafting as an EAGLE-1 head:
    position p pairs token p+1 with the target's final hidden state at p; later steps feed the layer's own output."""

    def __init__(self, ctx: DraftContext, spec_cfg):
        _ModelProposer.__init__(self, ctx, spec_cfg)
        from workers.model_config import ModelConfig
        from workers.models.deepseek_v32 import DeepseekV32MTP

        target = ctx.target
        path = spec_cfg.model or target.cfg.path
        cfg = ModelConfig.from_pretrained(path)
        self.runner = ctx.runner(path, cfg, build_model=lambda: DeepseekV32MTP(cfg, ctx.dtype, ctx.tp, ctx.rope_len))
        self.head = self.runner.model
        self.head.attach_target(target)
        n, k, h = ctx.max_requests, self.topk, cfg.hidden_size
        self.state_ids = torch.zeros(n, k, dtype=torch.int64, device=ctx.device)
        self.state_logp = torch.zeros(n, k, dtype=torch.float32, device=ctx.device)
        self.state_feat = torch.zeros(n, h, dtype=ctx.dtype, device=ctx.device)


class DraftModelProposer(_ModelProposer):
    """A standalone smaller model with the target's tokenizer."""

    scratch_offset = 1

    def __init__(self, ctx: DraftContext, spec_cfg):
        super().__init__(ctx, spec_cfg)
        from workers.model_config import CheckpointError, ModelConfig

        cfg = ModelConfig.from_pretrained(spec_cfg.model)
        if cfg.vocab_size != ctx.target.cfg.vocab_size:
            raise CheckpointError(f"draft vocab {cfg.vocab_size} != target vocab {ctx.target.cfg.vocab_size}: "
                                  "a standalone draft must share the target's tokenizer")
        self.runner = ctx.runner(spec_cfg.model, cfg, max_positions=max(cfg.max_position_embeddings, ctx.rope_len))

    def _draft_forward(self, fb, features):
        hidden = self.runner.forward(fb)
        logits = self.runner.logits(fb.logits_rows(hidden))
        return (self._draft_scores(logits), None), None

    def after_extend(self, fb, features, sampled, next_ids):
        self.runner.forward(self._extend_batch(fb, fb.input_ids))

    def stash(self, inp, fb, hidden, sampled):
        self._stash_at(inp, inp.root, None)  # draft position m holds the root itself

    def catch_up(self, slots, root_pos, lags):
        # no state to keep: a round's first step feeds the root from its position on
        self.runner.forward(self._stashed(slots, root_pos, lags)[0])

    def propose(self, inp):
        if self.num_steps == 0:
            return self._root_only(inp)
        # step 1: the root itself at position m
        fb = self._batch(self.runner, ForwardMode.DECODE, inp.root, inp, 1)
        (logp, _), _ = self._draft_forward(fb, None)
        cand = TreeCandidates(inp.batch_size, self.topk, self.num_steps, inp.root.device, chain=self.chain)
        cand.add_root_children(*self._topk(logp, None, cand.next_chain_node() if self.chain else None))
        if self.num_steps > 1:
            self._expand_steps(inp, cand, None, first_step=2, seq_offset=0, root_visible=True)
        return cand.build(inp.root, self.num_draft_tokens, self.max_depth)

    def after_verify(self, inp, tree, verdict, features):
        b, s1 = verdict.out_tokens.shape
        # consume root + accepted drafts (t_m .. t_{m+accept}, at positions m ..); the new bonus is next round's root
        ids = torch.cat([tree.tokens[:, :1], verdict.out_tokens[:, :-1]], dim=1).reshape(-1)
        fb = self._batch(self.runner, ForwardMode.DRAFT_EXTEND, ids, inp, s1, seq_offset=s1 - 1)
        self.runner.forward(fb)


class NgramProposer(Proposer):
    """Prompt lookup: drafts come from the host (``propose_ngram``), verified as a chain."""


def propose_ngram(tokens: list[int], num_tokens: int, n_min: int, n_max: int) -> list[int]:
    """Continue ``tokens`` by what followed the latest earlier occurrence of its longest suffix n-gram
    (n_max down to n_min). Pads with the last token when the match runs short or nothing matches."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                cont = tokens[start + n:start + n + num_tokens]
                return cont + [cont[-1]] * (num_tokens - len(cont))
    return [tokens[-1]] * num_tokens


def make_proposer(ctx: DraftContext, spec_cfg) -> Proposer:
    if spec_cfg.method in ("eagle", "eagle3", "naive"):
        return EagleProposer(ctx, spec_cfg)
    if spec_cfg.method == "draft":
        return DraftModelProposer(ctx, spec_cfg)
    if spec_cfg.method == "mtp":
        return MTPProposer(ctx, spec_cfg)
    return NgramProposer(ctx, spec_cfg)
