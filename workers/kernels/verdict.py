"""A speculative round's verdict (the walk down a verified draft tree and the emitted tokens) and its outcome
recorded into the worker's per-request state, one kernel each.
"""

from __future__ import annotations

import torch

from workers.kernels.launch import triton, use_triton

if triton is not None:
    import triton.language as tl



# ---- a round's verdict: the walk down a verified draft tree and the emitted tokens, one kernel ------------------
if triton is not None:

    @triton.jit
    def _verdict(Parents, Tokens, Choice, Lse, Logits, Uniform, Accept, Path, Out, OutLogprob, d, max_depth, offset,
                 stride_p, stride_t, stride_c, stride_lse, stride_row, stride_path, stride_out, stride_olp,
                 D_P2: tl.constexpr, CHAIN: tl.constexpr, FORCED: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, D_P2)
        ok = j < d
        emit = j <= max_depth
        tokens = tl.load(Tokens + b * stride_t + j, mask=ok, other=-1)
        if FORCED:  # a chain's first floor(u + offset) drafts, whatever the target chose
            accept = tl.minimum(tl.maximum((tl.load(Uniform + b) + offset).to(tl.int64), 0), max_depth)
            path = j.to(tl.int64)
        else:
            if CHAIN:  # node j's parent is j - 1
                parents = tl.where(ok, j - 1, -2).to(tl.int64)
            else:
                parents = tl.load(Parents + b * stride_p + j, mask=ok, other=-2)
            cur = tl.zeros([], dtype=tl.int64)
            alive = tl.full([], 1, dtype=tl.int64)
            accept = tl.zeros([], dtype=tl.int64)
            path = tl.zeros([D_P2], dtype=tl.int64)
            for step in range(max_depth):
                want = tl.load(Choice + b * stride_c + cur)
                match = (parents == cur) & (tokens == want) & ok & (alive != 0)
                alive = tl.max(match.to(tl.int64), 0)
                cur = tl.where(alive != 0, tl.min(tl.where(match, j, D_P2), 0).to(tl.int64), cur)
                accept += alive
                path = tl.where(j == step + 1, cur, path)
        out = tl.load(Choice + b * stride_c + path, mask=emit, other=0)
        if FORCED:
            drafted = j < accept
            out = tl.where(drafted, tl.load(Tokens + b * stride_t + j + 1, mask=drafted & emit, other=0), out)
        logit = tl.load(Logits + (b * d + path) * stride_row + out, mask=emit, other=0.0).to(tl.float32)
        lse = tl.load(Lse + b * stride_lse + path, mask=emit, other=0.0)
        tl.store(Accept + b, accept)
        tl.store(Path + b * stride_path + j, path, mask=emit)
        tl.store(Out + b * stride_out + j, out, mask=emit)
        tl.store(OutLogprob + b * stride_olp + j, logit - lse, mask=emit)


def tree_verdict(parents: torch.Tensor | None, tokens: torch.Tensor, choice: torch.Tensor, lse: torch.Tensor,
                 logits: torch.Tensor, max_depth: int, forced: tuple[torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verified round's outcome for each request's draft tree ([B, D] ``parents``, ``tokens``; ``parents`` None:
    a chain, node j's parent is j - 1), given the target's choice after each node (``choice`` [B, D]), each node's
    log-normaliser (``lse`` [B, D] fp32) and logits ([B * D, V] rows, or [B, D, V]).

    Walks from the root along the child whose token is the target's choice at the current node (the first such
    child), for ``max_depth`` hops or until there is none. ``forced`` = (u [B] fp32, offset), a chain only (the
    benchmark's simulated acceptance): accept ``floor(u + offset)`` drafts (clamped to 0 .. max_depth) whatever the
    target chose, the emitted tokens being those drafts and then the target's choice.

    Returns (accepted drafts [B] int64; path [B, max_depth + 1] int64, node indices from the root, padded with the
    last; emitted tokens [B, max_depth + 1] int64, valid up to accept + 1; their target log-probs, fp32). One
    program per request where Triton runs (about 15 PyTorch ops otherwise)."""
    b, d = tokens.shape
    chain = parents is None
    if forced is not None and not chain:
        raise ValueError("a forced accept count takes a chain")
    rows = logits.reshape(b * d, -1)
    if not use_triton(tokens):
        depth = torch.arange(max_depth + 1, device=tokens.device).expand(b, -1)
        if forced is not None:
            u, offset = forced
            accept, path = (u + offset).long().clamp_(0, max_depth), depth
            drafts = torch.cat([tokens[:, 1:], choice[:, -1:]], dim=1)  # node j + 1's token at j (the last: unread)
            out = torch.where(depth < accept.unsqueeze(1), drafts.gather(1, path), choice.gather(1, path))
        else:
            accept, path = _walk_reference(parents, tokens, choice, max_depth)
            out = choice.gather(1, path)
        row = torch.arange(b, device=tokens.device).unsqueeze(1) * d + path
        return accept, path, out, rows[row, out].float() - lse.gather(1, path)
    accept = torch.empty(b, dtype=torch.int64, device=tokens.device)
    path, out = (torch.empty(b, max_depth + 1, dtype=torch.int64, device=tokens.device) for _ in range(2))
    logprob = torch.empty(b, max_depth + 1, dtype=torch.float32, device=tokens.device)
    if b:
        parents = tokens if chain else parents  # (unread for a chain)
        u, offset = forced if forced is not None else (lse, 0.0)  # (unread unless forced)
        _verdict[(b,)](parents, tokens, choice, lse, rows, u.contiguous(), accept, path, out, logprob, d, max_depth,
                       float(offset), parents.stride(0), tokens.stride(0), choice.stride(0), lse.stride(0),
                       rows.stride(0), path.stride(0), out.stride(0), logprob.stride(0),
                       D_P2=max(16, triton.next_power_of_2(d)), CHAIN=chain, FORCED=forced is not None)
    return accept, path, out, logprob


def _walk_reference(parents: torch.Tensor | None, tokens: torch.Tensor, choice: torch.Tensor,
                    max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree_verdict``'s walk in PyTorch: (accept [B], path [B, max_depth + 1])."""
    b, d = tokens.shape
    if parents is None:
        parents = (torch.arange(d, device=tokens.device) - 1).expand(b, d)
    rows = torch.arange(b, device=parents.device)
    cur = torch.zeros(b, dtype=torch.int64, device=parents.device)
    alive = torch.ones(b, dtype=torch.bool, device=parents.device)
    accept = torch.zeros(b, dtype=torch.int64, device=parents.device)
    path = [cur]
    for _ in range(max_depth):
        want = choice[rows, cur]
        match = (parents == cur.unsqueeze(1)) & (tokens == want.unsqueeze(1))
        found = match.any(1) & alive
        cur = torch.where(found, match.int().argmax(1), cur)
        alive = found
        accept += found.long()
        path.append(cur)
    return accept, torch.stack(path, 1)


# ---- a round's outcome into the worker's per-request state, one kernel -------------------------------------------
if triton is not None:

    @triton.jit
    def _record_round(Slots, Accept, OutTokens, LastToken, Advance, b, stride_slots, stride_out, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < b
        slot = tl.load(Slots + i * stride_slots, mask=ok, other=0)
        accept = tl.load(Accept + i, mask=ok, other=0)
        tl.store(LastToken + slot, tl.load(OutTokens + i.to(tl.int64) * stride_out + accept, mask=ok), mask=ok)
        tl.store(Advance + slot, accept + 1, mask=ok)


def record_round(slots: torch.Tensor, accept: torch.Tensor, out_tokens: torch.Tensor, last_token: torch.Tensor,
                 advance: torch.Tensor) -> None:
    """After a speculative round: each request's newest token (``out_tokens[b, accept[b]]``, the bonus token after
    its accepted drafts) into ``last_token[slot]`` and the tokens the round appended (``accept + 1``) into
    ``advance[slot]`` (int64 tensors; slots distinct). One kernel where Triton runs, else four PyTorch ops."""
    if not use_triton(slots) or out_tokens.stride(1) != 1:
        last_token[slots] = out_tokens.gather(1, accept.unsqueeze(1)).squeeze(1)
        advance[slots] = accept + 1
        return
    b = slots.shape[0]
    if b:
        block = min(1024, max(16, triton.next_power_of_2(b)))
        _record_round[(triton.cdiv(b, block),)](slots, accept.contiguous(), out_tokens, last_token, advance, b,
                                                slots.stride(0), out_tokens.stride(0), BLOCK=block)
