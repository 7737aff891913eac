"""A step's token metadata in one kernel: uniform batches (every request extends by n tokens) and a replayed
step's inputs under the overlap schedule.
"""

from __future__ import annotations

import torch

from workers.kernels.launch import triton, use_triton

if triton is not None:
    import triton.language as tl



# ---- token metadata of a uniform batch (every request extends by n tokens), one kernel ---------------------------
def paged_slots(table: torch.Tensor, page_size: int, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Physical KV slots of token ``positions`` of requests ``req_slots`` (same shape) through the page ``table``
    [requests, pages] (PyTorch ops; ``uniform_token_metadata`` does it in its kernel)."""
    pages = table[req_slots.long(), positions.long() // page_size].long()
    return pages * page_size + positions.long() % page_size


if triton is not None:

    @triton.jit
    def _uniform_tokens(Slots, SeqIn, Table, LogitsAt, SeqOut, ExtOut, StartOut, LogitsIdx, StoragePos, OutLoc,
                        n, page_size, num_req, seq_offset, seq_step, stride_slots, stride_seq, stride_table,
                        BLOCK: tl.constexpr, HAS_AT: tl.constexpr):
        b = tl.program_id(0)
        req = b % num_req
        slot = tl.load(Slots + req * stride_slots).to(tl.int64)
        seq = (tl.load(SeqIn + req * stride_seq) + seq_offset + (b // num_req) * seq_step).to(tl.int32)
        if tl.program_id(1) == 0:
            tl.store(SeqOut + b, seq)
            tl.store(ExtOut + b, n)
            tl.store(StartOut + b, b * n)
            if HAS_AT:
                tl.store(LogitsIdx + b, b * n + tl.load(LogitsAt + req).to(tl.int64))
            else:
                tl.store(LogitsIdx + b, (b * n + n - 1).to(tl.int64))
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = j < n
        pos = (seq - n + j).to(tl.int64)
        page = tl.load(Table + slot * stride_table + pos // page_size, mask=ok, other=0).to(tl.int64)
        tl.store(StoragePos + b * n + j, pos, mask=ok)
        tl.store(OutLoc + b * n + j, page * page_size + pos % page_size, mask=ok)


def uniform_token_block(n: int) -> int:
    """``uniform_token_metadata``'s block for ``n`` tokens a request: few distinct compiles whatever the length."""
    return min(1024, max(16, 1 << max(0, n - 1).bit_length()))


def uniform_token_metadata(slots: torch.Tensor, seq_lens: torch.Tensor, n: int, table: torch.Tensor,
                           page_size: int, *, seq_offset: int = 0, steps: int = 1, seq_step: int = 0,
                           logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A batch where each of the B requests extends by ``n`` tokens ending at ``seq_lens + seq_offset``: (seq_lens
    int32, extend_lens int32 [B] = n, extend_start int32 [B] = b*n, logits row indices int64 [B] (each request's
    last token, or its token ``logits_at[b]``), storage positions int64 [B*n], KV slots int64 [B*n] through the page
    ``table`` [requests, pages] of request slots ``slots``). ``steps`` > 1 stacks the batch that many times (a
    multi-step draft round), step i's lengths ``i * seq_step`` further. One Triton kernel where it runs (the same
    values as the PyTorch ops below, which it replaces in every forward's metadata), else those ops."""
    b, device = slots.shape[0], slots.device
    if not (use_triton(slots) and b):
        seq = (seq_lens.to(torch.int32) + seq_offset).repeat(steps)
        if steps > 1:
            seq = seq + torch.arange(steps, dtype=torch.int32, device=device).repeat_interleave(b) * seq_step
        rows = b * steps
        ext = torch.full((rows,), n, dtype=torch.int32, device=device)
        start = torch.arange(0, rows * n, n, dtype=torch.int32, device=device)
        at = ext - 1 if logits_at is None else logits_at.to(torch.int32).repeat(steps)
        storage_pos = ((seq - n).unsqueeze(1) + torch.arange(n, device=device)).reshape(-1).long()
        tok_req = slots.long().repeat(steps).unsqueeze(1).expand(rows, n).reshape(-1)
        out_loc = paged_slots(table, page_size, tok_req, storage_pos)
        return seq, ext, start, (start + at).long(), storage_pos, out_loc
    rows = b * steps
    seq = torch.empty(rows, dtype=torch.int32, device=device)
    ext, start = torch.empty_like(seq), torch.empty_like(seq)
    last = torch.empty(rows, dtype=torch.int64, device=device)
    storage_pos = torch.empty(rows * n, dtype=torch.int64, device=device)
    out_loc = torch.empty_like(storage_pos)
    block = uniform_token_block(n)
    _uniform_tokens[(rows, triton.cdiv(max(n, 1), block))](
        slots, seq_lens, table, logits_at.contiguous() if logits_at is not None else last, seq, ext, start, last,
        storage_pos,
        out_loc, n, page_size, b, seq_offset, seq_step, slots.stride(0), seq_lens.stride(0), table.stride(0),
        BLOCK=block, HAS_AT=logits_at is not None)
    return seq, ext, start, last, storage_pos, out_loc


# ---- a replayed step's inputs under the overlap schedule, one kernel ---------------------------------------------
if triton is not None:

    @triton.jit
    def _overlap_inputs(Slots, Pending, SeqLens, Counters, Advance, LastToken, SeqOut, Root, RootPos, CountersOut,
                        b, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < b
        slot = tl.load(Slots + i, mask=ok, other=0)
        ahead = tl.load(Pending + i, mask=ok, other=0) * tl.load(Advance + slot, mask=ok, other=0)
        seq = tl.load(SeqLens + i, mask=ok, other=0) + ahead
        tl.store(SeqOut + i, seq, mask=ok)
        tl.store(RootPos + i, seq - 1, mask=ok)
        tl.store(Root + i, tl.load(LastToken + slot, mask=ok, other=0), mask=ok)
        tl.store(CountersOut + i, tl.load(Counters + i, mask=ok, other=0) + ahead, mask=ok)


def overlap_step_inputs(slots: torch.Tensor, pending: torch.Tensor, seq_lens: torch.Tensor, counters: torch.Tensor,
                        advance: torch.Tensor, last_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A step's device inputs from the host's view of it (int64 [B] each): with ``pending`` (the step in flight
    appends ``advance[slot]`` tokens, 1 or a round's accepted drafts + 1, before this one runs) the sequence length
    and the sampling counter move ahead by that much. Returns (seq_lens, root token = ``last_token[slot]``, root
    position = seq_lens - 1, counters). One kernel where Triton runs, else the same PyTorch ops."""
    if not use_triton(slots):
        ahead = pending * advance[slots]
        seq = seq_lens + ahead
        return seq, last_token[slots], seq - 1, counters + ahead
    b = slots.shape[0]
    slots, pending, seq_lens, counters = (x.contiguous() for x in (slots, pending, seq_lens, counters))  # views: as is
    seq, root, root_pos, ctr = (torch.empty(b, dtype=torch.int64, device=slots.device) for _ in range(4))
    if b:
        block = min(1024, max(16, triton.next_power_of_2(b)))
        _overlap_inputs[(triton.cdiv(b, block),)](slots, pending, seq_lens, counters, advance, last_token, seq, root,
                                                  root_pos, ctr, b, BLOCK=block)
    return seq, root, root_pos, ctr
