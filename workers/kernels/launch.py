"""Kernel launch control shared by every Triton kernel: where Triton runs, programmatic dependent launch
(PDL), and L2 prefetch."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
import time

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install without triton: PyTorch paths only
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: kernels start when the previous one has ended
    gdc_launch_dependents = gdc_wait = None


logger = logging.getLogger(__name__)

_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels on CPU tensors


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or _INTERPRETER)


# ---- programmatic dependent launch (PDL) --------------------------------------------------------------------------
# On Hopper and later a kernel launched with PDL may start while the one before it still runs: its programs become
# resident and wait (``griddepcontrol.wait``) until that kernel has ended and its writes are visible. A decode step
# of a small batch is a chain of ~9 kernels a layer, each too short to hide its own start: the short kernels let the
# next one start at once, and the linear layers pull the first weight tile of each of their programs into L2 before
# they wait, so a layer's weight stream starts while the norm / RoPE / attention kernels before it run. Nothing is
# read from an activation or written before the wait, so results are those of kernels run one after another.
# Only launches inside ``pdl_launches()`` (CUDA-graph warm-ups and captures) take part: eager steps, bound by the
# host's launches, were slower with it.
# SPECSERVE_PDL=0 turns it off (A/B, debugging).
_PDL_ALLOWED = os.environ.get("SPECSERVE_PDL", "1") != "0"
_pdl_scope = threading.local()


@contextlib.contextmanager
def pdl_launches():
    """Kernels launched inside (this thread) use PDL where ``pdl_supported``."""
    was = getattr(_pdl_scope, "on", False)
    _pdl_scope.on = True
    try:
        yield
    finally:
        _pdl_scope.on = was


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device | str) -> bool:
    """Whether Triton kernels on ``device`` can launch with PDL (CUDA sm90+, a Triton with grid dependency
    control, not turned off by SPECSERVE_PDL=0)."""
    device = torch.device(device)
    if not (_PDL_ALLOWED and device.type == "cuda" and triton is not None and gdc_wait is not None
            and torch.cuda.is_available()):
        return False
    return _pdl_device(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(x: torch.Tensor) -> dict:
    """Launch keywords of a kernel on ``x``'s device with a ``PDL`` constexpr (``pdl_start``, or ``pdl_release``
    and a wait)."""
    on = getattr(_pdl_scope, "on", False) and pdl_supported(x.device)
    return {"PDL": True, "launch_pdl": True} if on else {}


if triton is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A short kernel's first statement: let the next kernel's programs start now, then wait for the previous
        kernel's results."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        """Let the next kernel's programs start (a linear layer: once its weight stream is done)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def prefetch_to_l2(ptrs, nbytes):
        """Bring ``nbytes`` from each pointer into L2 without waiting for them (sm90 bulk prefetch; skipped where
        nbytes <= 0). Pointers 16-byte aligned, nbytes a multiple of 16."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_lines_to_l2(ptrs, mask):
        """Bring the cache line of each pointer where ``mask`` holds into L2 without waiting (a streaming kernel's
        tiles ahead: one line a row, rows anywhere)."""
        tl.inline_asm_elementwise("@$2 prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l,b", [ptrs, mask],
                                  dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_bytes(weight: torch.Tensor, block_k: int) -> int:
    """Bytes of each weight row a linear kernel's program prefetches before it waits (its first K tile), 0 where
    the rows are not 16-byte aligned."""
    row = weight.stride(0) * weight.element_size()
    if weight.data_ptr() % 16 or row % 16:
        return 0
    return min(block_k, weight.shape[1]) * weight.element_size() // 16 * 16


# ---- CUDA graph capture --------------------------------------------------------------------------------------
@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off inside (restored after, as it was). For CUDA graph captures: a
    collection that lands in one can destroy unreachable CUDA graphs (a dropped engine's: its graphs and the
    worker's closures form cycles), which is not permitted while a stream captures, and the capture fails."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **kwargs):
    """``torch.cuda.graph(graph, **kwargs)`` with the garbage collector paused (``gc_paused``)."""
    with gc_paused(), torch.cuda.graph(graph, **kwargs):
        yield


# ---- compiles while serving ----------------------------------------------------------------------------------------
class CompileWatch:
    """Triton's compiles in this process from ``start`` on (Triton's JIT hooks), each logged with its kernel's
    specialisation and how long it took. After start-up a compile runs inside a step and stalls every stream for up
    to seconds; the warm-ups exist to prevent that, and a compile that still happens should say which kernel and
    which specialisation it was (vLLM logs its post-start compiles likewise). A kernel Triton finds in its disk
    cache passes the same hooks, in milliseconds. The hooks are process-wide: ``compile_watch()`` is the one."""

    def __init__(self):
        self.compiles = 0  # since start
        self.seconds = 0.0
        self.longest_s = 0.0
        self._began: dict[str, float] = {}
        self._chained: tuple = (None, None)  # the hooks set before ours, still called
        self.started = False

    def start(self) -> None:
        if self.started or triton is None or _INTERPRETER:
            return
        try:
            from triton import knobs
        except ImportError:  # (a Triton without its hooks: nothing to watch)
            return
        self._chained = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self.before, self.after
        self.started = True

    def before(self, **kwargs):
        first = self._chained[0]
        if first is not None and first(**kwargs):
            return True  # (that hook took the compile over)
        self._began[str(kwargs.get("key"))] = time.perf_counter()
        return None

    def after(self, **kwargs):
        took = time.perf_counter() - self._began.pop(str(kwargs.get("key")), time.perf_counter())
        self.compiles += 1
        self.seconds += took
        self.longest_s = max(self.longest_s, took)
        logger.warning("Triton compiled (or loaded from its cache) %s after start-up in %.0f ms, inside a step",
                       specialisation(kwargs), took * 1e3)
        second = self._chained[1]
        return second(**kwargs) if second is not None else None

    def stats(self) -> dict:
        return {"compiles": self.compiles, "s": round(self.seconds, 6), "longest_s": round(self.longest_s, 6)}


def specialisation(hook_kwargs: dict) -> str:
    """A compile's kernel and what it was specialised on, from Triton's hook arguments: each argument's type, an
    int's or pointer's divisibility by 16 (``%16``), and constexprs (an int equal to 1 becomes one) with their value;
    Triton's own ``repr`` where the arguments are not in the shape this reads."""
    try:
        c = hook_kwargs["compile"]
        name = hook_kwargs["fn"].name
        consts = c.get("constants") or {}
        divisible = {path[0] for path, attr in ((c.get("configs") or [{}])[0] or {}).items()
                     if any(item[0] == "tt.divisibility" for item in attr)}
        parts = []
        for i, (arg, ty) in enumerate(c["signature"].items()):
            if ty == "constexpr":
                value = consts.get((i,))
                parts.append(f"{arg}={getattr(value, 'value', value)}")
            else:
                parts.append(f"{arg}:{ty}{'%16' if i in divisible else ''}")
        return f"{name}({', '.join(parts)})"
    except (KeyError, AttributeError, TypeError, IndexError):
        return str(hook_kwargs.get("repr"))


@functools.cache
def compile_watch() -> CompileWatch:
    """This process's watch (started by the worker once its start-up compiles are done; its counts are for tools
    and tests, the log is what a server shows)."""
    return CompileWatch()
