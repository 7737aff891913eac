"""One-shot all-reduce over NVLink for the small tensors of decode and verify: our own Triton kernel over buffers in
PyTorch's symmetric memory.

Every rank owns a buffer that its peers map directly (``torch.distributed._symmetric_memory``, CUDA backend), one
slot per rank. One kernel does it all: each program writes its slice of the local input into its rank's slot of
every peer's buffer (stores over NVLink, which wait for no answer), then waits until the peers' slices have landed
in its own buffer and sums them in rank order. No ring, no protocol steps and no flags, so a decode-sized all-reduce
costs a fraction of NCCL's. All ranks sum in the same order, so they hold bit-identical results (they must: every
rank samples the same tokens).

- The data is its own signal: an empty slot holds -0.0 everywhere, and a rank sends -0.0 as +0.0, so a slice has
  landed when none of its elements is -0.0 any more (each element is read again until then).
- A rank can be one call ahead of a peer (the peer is still reading while the rank writes its next slice), so each
  slot has three phases and a program's consecutive calls go round them; after reading a phase, a program empties
  the phase of its previous call, which no peer writes again before two calls on. A slice always belongs to the
  same program, and the programs count their calls, so the same kernel replays from CUDA graphs.
- Inside ``launch.pdl_launches`` (graph captures on Hopper) it launches with programmatic dependent launch like
  our other kernels: it becomes resident while the linear before it finishes and lets the next linear prefetch its
  weights while the ranks exchange.

Larger tensors (prefill) go to NCCL: past a few hundred KiB the ring's bandwidth wins over one-shot reads.
Creation is collective; any rank that cannot take part (no symmetric memory in this PyTorch build, peers it cannot
see or reach, fp16, a failing check) makes every rank fall back to NCCL, with the reason logged.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from workers.kernels.launch import pdl_launch, triton

logger = logging.getLogger(__name__)

MAX_BYTES = 1 << 20  # largest tensor sent through one-shot: bs 64 x 8192 hidden in bf16
BLOCK = 1024  # elements per program: a slice of the tensor, always the same program's

if triton is not None:
    import triton.language as tl

    from workers.kernels.launch import pdl_start

    @triton.jit
    def _is_empty(v):
        """Where ``v`` still holds the empty mark, -0.0 (its fp32 bits: only the sign bit)."""
        return v.to(tl.float32).to(tl.int32, bitcast=True) == -2147483648

    @triton.jit
    def _one_shot_sum_kernel(x_ptr, out_ptr, buffer_ptrs, calls_ptr, n, slot_numel,
                             RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
        pid = tl.program_id(0)
        pdl_start(PDL)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        calls = tl.load(calls_ptr + pid)  # this program's calls so far: the same count on every rank
        phase = calls % 3
        x = tl.load(x_ptr + offs, mask=mask)
        xf = x.to(tl.float32)
        x = tl.where(xf == 0, 0.0, xf).to(x.dtype)  # -0.0 marks a slot empty: every rank sends and adds +0.0
        for peer in tl.static_range(WORLD):  # push: our slice into our slot of every peer's buffer
            if peer != RANK:
                buf = tl.load(buffer_ptrs + peer).to(tl.pointer_type(x_ptr.dtype.element_ty))
                buf = tl.multiple_of(buf + (phase * WORLD + RANK) * slot_numel, 16)  # (aligned: vector stores)
                tl.store(buf + offs, x, mask=mask)
        own = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
        empty = tl.full([BLOCK], -2147483648, tl.int32).to(tl.float32, bitcast=True).to(x_ptr.dtype.element_ty)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order: every rank rounds the same sum
            if r == RANK:
                acc += x.to(tl.float32)
            else:  # the peer's slice, in our own memory once it has landed: no element still empty
                slot = tl.multiple_of(own + (phase * WORLD + r) * slot_numel, 16)
                v = tl.load(slot + offs, mask=mask, other=0.0, volatile=True)
                while tl.max((_is_empty(v) & mask).to(tl.int32), axis=0) > 0:
                    v = tl.load(slot + offs, mask=mask, other=0.0, volatile=True)
                acc += v.to(tl.float32)
                # the slot of this program's previous call is empty again before this peer's next write to it,
                # two calls on (it can already be writing the next call's slot, not that one). All of the program's
                # slice, not only this call's n: a call larger than this one in that phase must not find an older
                # call's elements there, taken for landed (every peer write to it has landed: the reads waited)
                used = tl.multiple_of(own + (((phase + 2) % 3) * WORLD + r) * slot_numel, 16)
                tl.store(used + offs, empty, mask=offs < slot_numel)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(calls_ptr + pid, calls + 1)


class SymmMemAllReduce:
    """Sum over the ranks of ``group`` for contiguous ``dtype`` tensors of at most ``max_bytes`` (module docstring)."""

    def __init__(self, group, dtype: torch.dtype, device: torch.device, max_bytes: int = MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.rank, self.world = group.rank(), group.size()
        programs = -(-self.max_numel // BLOCK)
        # three phases of one slot per rank, all empty (-0.0): the peers write their slices into theirs
        self.buffer = symm_mem.empty(3 * self.world * self.max_numel, dtype=dtype, device=device)
        self.buffer.fill_(-0.0)
        torch.cuda.synchronize(device)  # empty before any peer can write here
        self.handle = symm_mem.rendezvous(self.buffer, group)  # keeps the peers' mappings alive
        self.buffer_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.calls = torch.zeros(programs, dtype=torch.int64, device=device)
        dist.barrier(group=group)  # every rank's buffer is empty before the first call

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the one-shot kernel runs ``x``."""
        return 0 < x.numel() <= self.max_numel and x.dtype == self.dtype and x.is_cuda and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A new tensor: the sum of every rank's ``x``."""
        out = torch.empty_like(x)
        n = x.numel()
        _one_shot_sum_kernel[(triton.cdiv(n, BLOCK),)](
            x, out, self.buffer_ptrs, self.calls, n, self.max_numel, RANK=self.rank,
            WORLD=self.world, BLOCK=BLOCK, num_warps=4, **pdl_launch(x))
        return out

    def close(self) -> None:
        """Drop the buffers and the peers' mappings (after the graphs that use them)."""
        self.buffer = self.handle = None
        self.max_numel = 0


def widened_visibility(visible_per_rank: list[str]) -> str | None:
    """CUDA_VISIBLE_DEVICES for every rank when each rank sees exactly one GPU of its own (e.g. ["3", "5"] → "3,5";
    rank r then uses device r), else None."""
    if any(not v or "," in v or v.startswith("MIG-") for v in visible_per_rank) \
            or len(set(visible_per_rank)) != len(visible_per_rank):  # MIG: one instance per process, never widen
        return None
    return ",".join(visible_per_rank)


def _agree(ok: bool, group, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _local_refusal(world_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this rank cannot take part, found before the collective set-up: a rank that failed inside the
    rendezvous alone would leave its peers waiting there."""
    if not 2 <= world_size <= 8:
        return f"{world_size} ranks (one-shot takes 2 to 8)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{dtype} (the one-shot kernel sums bf16 and fp32)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "a GPU older than sm80"
    count = torch.cuda.device_count()
    if count < world_size:
        return f"this rank sees {count} GPU(s), not its {world_size - 1} peers' (CUDA_VISIBLE_DEVICES)"
    here = device.index if device.index is not None else torch.cuda.current_device()
    blocked = [j for j in range(count) if j != here and not torch.cuda.can_device_access_peer(here, j)]
    if blocked:
        return f"no peer access from GPU {here} to {blocked}"
    if triton is None:
        return "no Triton for the one-shot kernel"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"this PyTorch has no symmetric memory ({e})"
    return None


def create_custom_all_reduce(group, rank: int, world_size: int, dtype: torch.dtype,
                             device: torch.device) -> SymmMemAllReduce | None:
    """Collective: the one-shot all-reduce when every rank can run it and a check sum is right, else None."""
    reason = _local_refusal(world_size, dtype, device)
    if not _agree(reason is None, group, device):
        logger.warning("custom all-reduce off, NCCL for every all-reduce: %s", reason or "another rank refused")
        return None
    comm, reason = None, None
    try:
        comm = SymmMemAllReduce(group, dtype, device)
        for i, numel in enumerate((4096, 3 * BLOCK + 5, 4096)):  # each of the three phases, a ragged slice
            y = comm.all_reduce(torch.full((numel,), float((rank + 1) * (i + 1)), dtype=dtype, device=device))
            expect = world_size * (world_size + 1) / 2 * (i + 1)
            if not torch.all(y == expect).item():
                reason = f"check sum {y[0].item()} != {expect}"
                break
    except Exception as e:  # noqa: BLE001 -- any failure here means: use NCCL
        reason = f"{type(e).__name__}: {e}"
    if not _agree(reason is None, group, device):
        logger.warning("custom all-reduce off, NCCL for every all-reduce: %s", reason or "another rank failed")
        return None
    logger.info("custom all-reduce: one-shot over symmetric memory for tensors up to %d KiB", MAX_BYTES >> 10)
    return comm
