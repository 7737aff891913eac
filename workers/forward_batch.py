"""The per-forward batch description every layer and attention backend reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workers.config import MAX_TREE_BLOCK
from workers.kernels.metadata import uniform_token_metadata
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode

if TYPE_CHECKING:  # the backends import this module
    from attention.base import AttentionMetadata


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host list (or numpy array) → device tensor without stalling the host: on CUDA the copy goes through pinned memory,
    asynchronously (a plain ``torch.tensor(list, device="cuda")`` waits for the GPU to drain)."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype, non_blocking=True)
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class PinnedRing:
    """A few host buffers of one shape and dtype (pinned on CUDA) handed out in turn for host→device copies: each
    waits on the event of its last copy before it is written again (under the overlap schedule that copy finished
    steps ago), so no pinned tensor is allocated per step (the caching host allocator's event bookkeeping costs more
    than a small copy). ``take`` → (tensor, its numpy view, index); ``copied(index)`` after queueing its copy."""

    def __init__(self, shape, dtype: torch.dtype, device, buffers: int):
        self.pinned = torch.device(device).type == "cuda"
        self.hosts = [torch.empty(shape, dtype=dtype, pin_memory=self.pinned) for _ in range(buffers)]
        self.views = [h.numpy() for h in self.hosts]
        self.events = [torch.cuda.Event() for _ in self.hosts] if self.pinned else None
        self.turn = 0

    def take(self):
        i = self.turn
        self.turn = (i + 1) % len(self.hosts)
        if self.pinned:
            self.events[i].synchronize()  # (an event never recorded returns at once)
        return self.hosts[i], self.views[i], i

    def copied(self, i: int) -> None:
        if self.pinned:
            self.events[i].record()


class StagedCopies:
    """Host→device copies of a small int64 array made every step (a DECODE step's page grants) through a
    ``PinnedRing``. Off CUDA, and for arrays past a buffer, ``to_device``."""

    def __init__(self, device, buffers: int = 4, capacity: int = 3 * 1024):
        self.device = torch.device(device)
        self.capacity = capacity
        self.ring = PinnedRing((capacity,), torch.int64, device, buffers) if self.device.type == "cuda" else None

    def __call__(self, values) -> torch.Tensor:
        n = values.size
        if self.ring is None or n > self.capacity:
            return to_device(values, torch.int64, self.device)
        host, image, i = self.ring.take()
        image[:n] = values.reshape(-1)
        out = host[:n].to(self.device, non_blocking=True)
        self.ring.copied(i)
        return out.view(values.shape)


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
    logits_indices: torch.Tensor | None  # [N] int64, token rows whose logits are needed (None: every token's)
    kv_cache: KVCache
    page_table: PageTable
    seq_lens_cpu: list[int] | None
    extend_lens_cpu: list[int]
    # Speculative block mask, [B, n, L] bool: the n new tokens against the last L positions of each sequence
    # (verify: L = n draft nodes, row i sees its ancestors and itself; draft steps: the scratch area). Positions
    # before the block are always visible. None = causal.
    tree_mask: torch.Tensor | None = None
    # The same block mask as one int64 bitmask per token ([T], bit j: the j-th position of a block of ``tree_len``
    # positions), which is what the steps of a draft round carry (``DraftSteps``); backends read whichever is set.
    tree_bits: torch.Tensor | None = None
    tree_len: int = 0
    attn_backend: object | None = None
    # The attention backend's typed metadata for this forward (its ``init_forward_metadata`` builds it), and for a
    # draft-round step the part its ``init_round_metadata`` prepared once for the whole round.
    attn_metadata: AttentionMetadata | None = None
    round_metadata: AttentionMetadata | None = None
    logits_all_tokens: bool = False  # every token gets logits, in order (``logits_rows``); logits_indices is None
    # ``extend_lens_cpu`` is only a bound of each request's new tokens (a prefill graph: the device has them)
    extend_lens_bound: bool = False
    aux: dict = field(default_factory=dict)  # model outputs beside logits (hidden states for EAGLE)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def logits_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` ([T, ...], one per token) that logits are computed for: ``x[logits_indices]``, or ``x``
        itself when those are every token in order (one token per request, or a draft step's k per request), which
        saves a gather kernel per forward."""
        return x if self.logits_all_tokens else x[self.logits_indices]

    @property
    def has_tree(self) -> bool:
        return self.tree_mask is not None or self.tree_bits is not None

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
        logits_at: torch.Tensor | None = None,
        all_logits: bool = False,
        seq_offset: int = 0,
        steps: int = 1,
        seq_step: int = 0,
        tree_mask: torch.Tensor | None = None,
        max_extend: int | None = None,
    ) -> "ForwardBatch":
        """The one metadata builder for model inputs: KV write slots and positions are derived on the device from
        the page table, so the same code serves eager runs and CUDA-graph capture/replay buffers.

        ``positions`` default to the storage positions (a chain's draft and verify tokens sit at consecutive
        positions); the KV lengths are ``seq_lens + seq_offset``. Logits rows: ``logits_indices``, else each
        request's token ``logits_at[b]`` (a device tensor, [B]), else ``all_logits`` (every token, in order), else
        each request's last token. ``steps`` > 1 (uniform batches, ``DraftSteps``): the requests repeated that many
        times, copy i's lengths ``i * seq_step`` further; ``req_slots`` then holds them once. ``max_extend`` (a
        prefill's CUDA graph): ``extend_lens`` is a device tensor, each at most ``max_extend``, and ``input_ids``
        holds exactly their sum; the host knows only that bound (``extend_lens_cpu``)."""
        device = page_table.table.device
        ids = to_device(input_ids, torch.int64, device)
        t = int(ids.shape[0])
        slots_t = to_device(req_slots, torch.int64, device)
        lens_cpu = None  # the host's view of the (moved) lengths, when it has them
        if not isinstance(seq_lens, torch.Tensor):
            lens_cpu = [x + seq_offset + i * seq_step for i in range(steps) for x in seq_lens]
        if max_extend is not None:  # lengths only on the device: the ragged path below, bounded on the host
            ext_device, extend_lens = extend_lens, [max_extend] * int(extend_lens.shape[0])
        if max_extend is None and len(set(extend_lens)) == 1:
            # uniform (every captured decode batch): made on the device (one kernel on the GPU), so a captured graph
            # holds no copy from a temporary host buffer that could be reused before a replay; and no
            # repeat_interleave: request b's tokens are rows b*n .. b*n+n-1
            seq_in = seq_lens if isinstance(seq_lens, torch.Tensor) else to_device(seq_lens, torch.int32, device)
            seq_t, ext_t, start_t, last_t, storage_pos, out_loc = uniform_token_metadata(
                slots_t, seq_in.to(device), extend_lens[0], page_table.table, page_table.page_size,
                seq_offset=seq_offset, steps=steps, seq_step=seq_step, logits_at=logits_at)
        else:
            if steps > 1:
                raise ValueError("a stacked multi-step batch must be uniform")
            seq_t = to_device(seq_lens, torch.int32, device)
            if seq_offset:
                seq_t = seq_t + seq_offset
            ext_t = to_device(extend_lens, torch.int32, device) if max_extend is None else ext_device.to(torch.int32)
            start_t = torch.cumsum(ext_t, 0, dtype=torch.int32) - ext_t
            tok_req = torch.repeat_interleave(slots_t, ext_t, output_size=t)
            offset = torch.arange(t, device=device) - torch.repeat_interleave(start_t, ext_t, output_size=t)
            storage_pos = torch.repeat_interleave(seq_t - ext_t, ext_t, output_size=t) + offset
            out_loc = page_table.slots(tok_req, storage_pos)
            last_t = (start_t + (ext_t - 1 if logits_at is None else logits_at)).long()
        pos = storage_pos if positions is None else to_device(positions, torch.int64, device)
        if logits_indices is not None:
            logits_idx = to_device(logits_indices, torch.int64, device)
        else:  # each request's last token or its ``logits_at`` token; unused with ``all_logits``
            logits_idx = None if all_logits else last_t
        all_logits = all_logits or (logits_indices is None and logits_at is None and set(extend_lens) == {1})
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
            seq_lens_cpu=lens_cpu,
            extend_lens_cpu=list(extend_lens),
            tree_mask=tree_mask,
            logits_all_tokens=all_logits,
            extend_lens_bound=max_extend is not None,
        )


def mask_from_bits(bits: torch.Tensor, length: int) -> torch.Tensor:
    """[..., n] int64 bitmasks → [..., n, length] bool (bit j → column j)."""
    return ((bits.unsqueeze(-1) >> torch.arange(length, device=bits.device)) & 1) != 0


class DraftSteps:
    """The batches of a multi-step draft round and the round's tree masks, built once at round start.

    Every step feeds ``k`` tokens per request and stores them at the next ``k`` positions of the request's scratch
    area, so step ``i``'s KV length is step 0's plus ``i * k``. The steps are stacked as consecutive batches and
    built by ONE ``ForwardBatch.build``; step ``i``'s batch holds views of the stacked tensors.

    Trees (k > 1): step ``i``'s block is the last ``prefix + (i + 1) * k`` positions (``prefix`` = 1 when the
    block opens with a node every row sees: the standalone draft's root), so every step's block starts at the same
    KV position and block bit j means the same position in every step. The masks are one [steps, B, k] int64 buffer
    of per-token bitmasks, initialised at round start with what is known then (each node sees itself, and the
    prefix); ``advance`` ORs in a step's ancestors once the previous step has chosen its frontier: two small device
    ops, nothing else per step. Step ``i``'s batch carries ``tree_bits`` = a view of row ``i``.

    The attention backend's ``init_round_metadata(steps)`` may compute every step's metadata once for the stacked
    round (each step's ``round_metadata``); each step's ``init_forward_metadata`` then only picks it up (the
    torch-native reference also writes the step's tree rows into its block's columns of the precomputed mask).
    FlashInfer prepares nothing and builds each step's metadata from the step's ``tree_bits``.
    """

    def __init__(self, stacked: ForwardBatch, batches: list[ForwardBatch], tokens_per_request: int,
                 tree_bits: torch.Tensor | None, tree_prefix: int):
        self.stacked = stacked
        self.batches = batches
        self.num_steps = len(batches)
        self.batch_size = batches[0].batch_size
        self.tokens_per_request = tokens_per_request
        self.tree_bits = tree_bits  # [steps, B, k] int64, or None (a chain: plain causal)
        self.tree_prefix = tree_prefix

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return self.num_steps

    def tree_len(self, step: int) -> int:
        return self.tree_prefix + (step + 1) * self.tokens_per_request

    def advance(self, step: int, origin: torch.Tensor) -> None:
        """Step ``step``'s tree rows, once step ``step - 1`` has chosen its frontier: new frontier slot j of request b
        descends from the previous step's slot ``origin[b, j]`` ([B, k] int64), so it sees what that parent saw
        (the prefix, its ancestors, the parent itself) besides itself (set at round start). A chain: nothing."""
        if self.tree_bits is None:
            return
        self.tree_bits[step].bitwise_or_(self.tree_bits[step - 1].gather(1, origin))

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        req_slots: list[int] | torch.Tensor,
        seq_lens: list[int] | torch.Tensor,
        tokens_per_request: int,
        kv_cache: KVCache,
        page_table: PageTable,
        *,
        steps: int,
        seq_offset: int = 0,
        positions: torch.Tensor | None = None,
        tree_prefix: int = 0,
    ) -> "DraftSteps":
        """Step i's KV lengths are ``seq_lens + seq_offset + (i + 1) * k`` ([B], host or device); ``positions``:
        [steps, B * k], or None for the storage positions (a chain). A tree when ``tokens_per_request`` > 1 (see
        the class), ``tree_prefix`` positions before the first step's nodes visible to all. Each step's
        ``input_ids`` are filled in when the previous step has produced them (and its tree rows by ``advance``).
        The stacked batch is built by ONE ``ForwardBatch.build`` (one kernel on the GPU: the lengths are moved per
        step in it) and holds the requests' slots once."""
        b, k = len(req_slots), tokens_per_request
        device = page_table.table.device
        stacked = ForwardBatch.build(mode, torch.empty(steps * b * k, dtype=torch.int64, device=device),
                                     req_slots, seq_lens, [k] * (steps * b), kv_cache, page_table,
                                     positions=None if positions is None else positions.reshape(-1),
                                     all_logits=True, seq_offset=seq_offset + k, steps=steps, seq_step=k)
        tree_bits = None
        if k > 1:
            if tree_prefix + steps * k > MAX_TREE_BLOCK:
                raise ValueError(f"a draft round's block of {tree_prefix + steps * k} positions exceeds the "
                                 f"{MAX_TREE_BLOCK}-bit mask")
            # every node sees itself (block position prefix + i*k + j) and the prefix: made on the device, so a
            # captured round holds no copy from a temporary host buffer
            own = torch.arange(tree_prefix, tree_prefix + steps * k, device=device)
            own = torch.bitwise_left_shift(torch.ones_like(own), own) + ((1 << tree_prefix) - 1)
            tree_bits = own.view(steps, 1, k).expand(steps, b, k).contiguous()
        # step i's views: one unbind per per-step field; the per-request shape is the same in every step
        per_tok = [x.view(steps, b * k).unbind(0) for x in (stacked.input_ids, stacked.positions,
                                                             stacked.out_cache_loc)]
        per_seq = stacked.seq_lens.view(steps, b).unbind(0)
        lens_cpu = stacked.seq_lens_cpu
        bits = [None] * steps if tree_bits is None else tree_bits.view(steps, b * k).unbind(0)
        ext, start = stacked.extend_lens[:b], stacked.extend_start[:b]
        batches = [ForwardBatch(
            mode=mode, input_ids=per_tok[0][i], positions=per_tok[1][i], req_slots=stacked.req_slots,
            seq_lens=per_seq[i], extend_lens=ext, extend_start=start, out_cache_loc=per_tok[2][i],
            logits_indices=None, kv_cache=kv_cache, page_table=page_table,
            seq_lens_cpu=None if lens_cpu is None else lens_cpu[i * b:(i + 1) * b], extend_lens_cpu=[k] * b,
            tree_bits=bits[i], tree_len=0 if tree_bits is None else tree_prefix + (i + 1) * k,
            logits_all_tokens=True,
        ) for i in range(steps)]
        return cls(stacked, batches, k, tree_bits, tree_prefix)
