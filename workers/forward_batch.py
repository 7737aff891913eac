"""Forward modes and the per-forward batch description every layer and attention backend reads."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from workers.kv_cache import KVCache, PageTable


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host list → device tensor without stalling the host: on CUDA the copy goes through pinned memory,
    asynchronously (a plain ``torch.tensor(list, device="cuda")`` waits for the GPU to drain)."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype, non_blocking=True)
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a chunk of it) of new tokens after a cached prefix
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # num_draft_tokens per request, tree mask over the draft block
    DRAFT_EXTEND = "draft_extend"  # draft model catches up over accepted tokens (causal, like EXTEND)
    IDLE = "idle"  # no tokens on this rank (keeps TP collectives in step)

    @property
    def is_extend_like(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)


@dataclass
class ForwardBatch:
    """Device tensors for one forward pass plus what the host already knew (no device sync).

    ``extend_lens_cpu`` (the batch's shape) is always known on the host; ``seq_lens_cpu`` is None when the lengths
    exist only on the device (speculative rounds, CUDA-graph capture and replay), and backends must not need it then.

    Layout: requests are concatenated; request ``b`` owns tokens ``extend_start[b] : extend_start[b] + extend_lens[b]``
    which are stored at KV positions ``seq_lens[b] - extend_lens[b] ...  seq_lens[b] - 1``.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE positions (tree depth for draft tokens)
    req_slots: torch.Tensor  # [B] int64, rows of the page table
    seq_lens: torch.Tensor  # [B] int32, KV length after this forward
    extend_lens: torch.Tensor  # [B] int32, new tokens per request
    extend_start: torch.Tensor  # [B] int32, exclusive cumsum of extend_lens
    out_cache_loc: torch.Tensor  # [T] int64, KV slots the new tokens are written to
    logits_indices: torch.Tensor  # [N] int64, token rows whose logits are needed
    kv_cache: KVCache
    page_table: PageTable
    seq_lens_cpu: list[int] | None
    extend_lens_cpu: list[int]
    # Speculative block mask, [B, n, L] bool: the n new tokens against the last L positions of each sequence
    # (verify: L = n draft nodes, row i sees its ancestors and itself; draft steps: the scratch area). Positions
    # before the block are always visible. None = causal.
    tree_mask: torch.Tensor | None = None
    attn_backend: object | None = None
    capture_hidden: bool = False
    aux: dict = field(default_factory=dict)  # model outputs beside logits (hidden states for EAGLE)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[int] | torch.Tensor,
        req_slots: list[int] | torch.Tensor,
        seq_lens: list[int] | torch.Tensor,
        extend_lens: list[int],
        kv_cache: KVCache,
        page_table: PageTable,
        *,
        positions: list[int] | torch.Tensor | None = None,
        logits_indices: list[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        capture_hidden: bool = False,
    ) -> "ForwardBatch":
        """The one metadata builder for model inputs: KV write slots and positions are derived on the device from
        the page table, so the same code serves eager runs and CUDA-graph capture/replay buffers."""
        device = page_table.table.device
        ids = to_device(input_ids, torch.int64, device)
        t = int(ids.shape[0])
        slots_t = to_device(req_slots, torch.int64, device)
        seq_t = to_device(seq_lens, torch.int32, device)
        if len(set(extend_lens)) == 1:  # uniform (every graph-captured batch): made on the device, so a captured
            # graph holds no copy from a temporary host buffer that could be reused before a replay
            ext_t = torch.full((len(extend_lens),), extend_lens[0], dtype=torch.int32, device=device)
        else:
            ext_t = to_device(extend_lens, torch.int32, device)
        start_t = torch.cumsum(ext_t, 0, dtype=torch.int32) - ext_t
        tok_req = torch.repeat_interleave(slots_t, ext_t, output_size=t)
        offset = torch.arange(t, device=device) - torch.repeat_interleave(start_t, ext_t, output_size=t)
        storage_pos = torch.repeat_interleave(seq_t - ext_t, ext_t, output_size=t) + offset
        out_loc = page_table.slots(tok_req, storage_pos)
        pos = storage_pos if positions is None else to_device(positions, torch.int64, device)
        if logits_indices is None:  # last token of every request
            logits_idx = (start_t + ext_t - 1).long()
        else:
            logits_idx = to_device(logits_indices, torch.int64, device)
        return cls(
            mode=mode,
            input_ids=ids,
            positions=pos.long(),
            req_slots=slots_t,
            seq_lens=seq_t,
            extend_lens=ext_t,
            extend_start=start_t,
            out_cache_loc=out_loc,
            logits_indices=logits_idx,
            kv_cache=kv_cache,
            page_table=page_table,
            seq_lens_cpu=None if isinstance(seq_lens, torch.Tensor) else list(seq_lens),
            extend_lens_cpu=list(extend_lens),
            tree_mask=tree_mask,
            capture_hidden=capture_hidden,
        )

    @classmethod
    def build_steps(
        cls,
        mode: ForwardMode,
        req_slots: list[int] | torch.Tensor,
        seq_lens_per_step: list[list[int]] | torch.Tensor,
        tokens_per_request: int,
        positions: torch.Tensor,
        kv_cache: KVCache,
        page_table: PageTable,
    ) -> list["ForwardBatch"]:
        """The batches of every step of a multi-step draft round, from ONE ``build`` over the steps stacked as
        consecutive batches; step ``i`` gets views of the stacked tensors. ``seq_lens_per_step``: [steps][B] (host or
        device); ``positions``: [steps, B * tokens].
        Each step's ``input_ids`` (and ``tree_mask``) are filled in when the previous step has produced them."""
        steps, b, k = len(seq_lens_per_step), len(req_slots), tokens_per_request
        on_host = not isinstance(seq_lens_per_step, torch.Tensor)
        flat_lens = [x for lens in seq_lens_per_step for x in lens] if on_host else seq_lens_per_step.reshape(-1)
        slots = list(req_slots) * steps if isinstance(req_slots, list) else req_slots.repeat(steps)
        stacked = cls.build(mode, torch.zeros(steps * b * k, dtype=torch.int64, device=positions.device),
                            slots, flat_lens, [k] * (steps * b), kv_cache, page_table,
                            positions=positions.reshape(-1),
                            logits_indices=torch.arange(b * k, device=positions.device))
        tok, req = slice(0, b * k), slice(0, b)
        batches = []
        for i in range(steps):
            tok_i, req_i = slice(i * b * k, (i + 1) * b * k), slice(i * b, (i + 1) * b)
            batches.append(cls(
                mode=mode, input_ids=stacked.input_ids[tok_i], positions=stacked.positions[tok_i],
                req_slots=stacked.req_slots[req_i], seq_lens=stacked.seq_lens[req_i],
                extend_lens=stacked.extend_lens[req], extend_start=stacked.extend_start[req],
                out_cache_loc=stacked.out_cache_loc[tok_i], logits_indices=stacked.logits_indices[tok],
                kv_cache=kv_cache, page_table=page_table,
                seq_lens_cpu=list(seq_lens_per_step[i]) if on_host else None, extend_lens_cpu=[k] * b,
            ))
        return batches
