"""Which small-M linear kernel (``workers.kernels.small_m_linear``) each layer runs, measured once at start-up.

``tune_small_m_linears`` times cuBLAS (``F.linear``) and every candidate tile config on each layer's real weight for
each row bucket, as CUDA graph replays of back-to-back calls, each after a short PDL kernel (``replayed_ms``,
``_fastest``: how a decode step runs them) in the order of ``small_m_linear.candidates`` (an incumbent first; a later
kernel must be SWITCH_MARGIN faster), and stores the winner in that layer's ``small_m`` table (row bucket →
TileConfig, or None for cuBLAS). An MLP's [gate; up] layer also gets a ``small_m_act`` table (``tune_activated``): a
weight-left tile writing silu(gate) * up in its epilogue, where that beats the layer's own kernel followed by the
silu_and_mul kernel.

Timings are noisy, and kernels round differently, so two starts that chose differently would give different bf16
tokens for the same greedy request. A ``TuningCache`` file keeps each choice per GPU model and software versions:
later starts (restarts, other replicas sharing the file) read it and time nothing, so they run the same kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from workers.kernels.launch import capturing, pdl_launches, pdl_supported
from workers.kernels.norm_rope import rms_norm, silu_and_mul
from workers.kernels.small_m_linear import (
    ACTIVATED_CANDIDATES,
    ROW_BUCKETS,
    TileConfig,
    candidates,
    linear,
    small_m_linear,
)

try:
    import triton
except ImportError:  # CPU-only install without triton
    triton = None

logger = logging.getLogger(__name__)

# A later candidate must be this much faster than the best before it to be chosen: kernels of nearly the same speed
# then resolve the same way on every start, so replicas and restarts mostly run the same kernels and round alike
# (timings stay noisy: this narrows run-to-run differences, it cannot rule them out).
SWITCH_MARGIN = 0.03


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and as many copies as it takes for all of them to be twice the GPU's L2 cache (at most 256), so
    that timed calls cycling over them stream their weight from memory, as every layer of a decode step does."""
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 0) or 50 << 20
    n = min(256, max(1, -(-2 * l2 // (weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def replayed_ms(call, weights: list[torch.Tensor], side: torch.cuda.Stream, min_calls: int = 8,
                replays: int = 5, between=None) -> float:
    """Milliseconds per ``call(weight)`` as a decode step runs it: captured in a CUDA graph as back-to-back calls
    cycling over ``weights`` (no launch gaps, a cold weight each time, the next kernel queued behind), the median
    over replays. Isolated timings (``do_bench``: one call after an L2 flush) add several microseconds of dirty
    L2 write-back and launch latency to each call, enough to rank kernels of a few tens of microseconds wrongly.
    ``between()``: launched before each call (its time is part of the result)."""
    import statistics


    calls = max(min_calls, len(weights))
    side.wait_stream(torch.cuda.current_stream())
    with pdl_launches(), torch.cuda.stream(side):  # compile and warm up outside the capture (PDL: as in graphs)
        for w in weights:
            if between is not None:
                between()
            call(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: as GraphRunner.capture, another thread's CUDA calls (the NCCL watchdog under TP) must not
    # invalidate the capture
    with pdl_launches(), capturing(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            if between is not None:
                between()
            call(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def pdl_neighbour(weight: torch.Tensor):
    """A short Triton kernel launched with PDL, like those around a linear in a layer (its RMS norm, RoPE, the
    attention merge): an RMS norm of one row as wide as ``weight``'s input."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
    gamma, out = torch.ones_like(x[0]), torch.empty_like(x)
    return lambda: rms_norm(x, gamma, 1e-6, out=out)


def _fastest(weights: list[torch.Tensor], side: torch.cuda.Stream, runs) -> TileConfig | None:
    """Of ``runs`` [(choice, call(weight))] in order, the choice timed fastest (``replayed_ms``), each later one
    taken only when it beats the best before it by SWITCH_MARGIN. A candidate that fails to compile or launch (e.g.
    too much shared memory on this GPU) is simply not a candidate.

    Each call is timed after a short PDL kernel (``pdl_neighbour``), less that kernel's own time: in a layer a
    linear starts after, and is followed by, such kernels, and a Triton kernel meets them under PDL (each starts
    while the one before it ends) where a cuBLAS one waits at both ends: timed back to back among themselves, the
    kernels ranked as they do not in the model."""
    neighbour = pdl_neighbour(weights[0])
    alone = replayed_ms(lambda w: None, weights, side, between=neighbour)
    best, best_ms = None, float("inf")
    for choice, call in runs:
        try:
            ms = replayed_ms(call, weights, side, between=neighbour) - alone
        except Exception:  # noqa: BLE001
            torch.cuda.synchronize()
            continue
        if ms < best_ms * (1 - SWITCH_MARGIN):
            best, best_ms = choice, ms
    return best


def tune(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, gated: bool = False,
         side: torch.cuda.Stream | None = None) -> TileConfig | None:
    """Time cuBLAS and every candidate tile config at ``rows`` rows on this weight (``replayed_ms``), in the order
    of ``candidates``; the fastest (None: cuBLAS). ``gated`` layers are timed as they run: cuBLAS after the
    separate silu_and_mul kernel, Triton with it fused. ``side``: the stream warm-ups run on (one for a whole
    tuning: PyTorch keeps a cuBLAS workspace of tens of MB per stream, which must not pile up before the KV cache
    is sized)."""
    x = torch.randn(rows, weight.shape[1] * (2 if gated else 1), dtype=weight.dtype, device=weight.device)
    cublas = (lambda w: F.linear(silu_and_mul(x), w, bias)) if gated else (lambda w: F.linear(x, w, bias))
    runs = [(c, cublas if c is None else lambda w, c=c: small_m_linear(x, w, bias, c, gated)) for c in candidates(rows)]
    return _fastest(weight_copies(weight), side or torch.cuda.Stream(weight.device), runs)


def tune_activated(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, plain: TileConfig | None,
                   side: torch.cuda.Stream | None = None) -> TileConfig | None:
    """For a [gate; up] weight: the tile that writes silu(gate) * up at ``rows`` rows (None: the layer's own kernel
    for them, ``plain`` (None: cuBLAS), followed by the silu_and_mul kernel). A weight-left ``plain`` tile's own
    activated form is the incumbent (the same weight stream, one kernel less), then the two kernels, then the
    ACTIVATED_CANDIDATES."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    own = [plain] if plain is not None and plain.weight_left else []
    runs = [(c, lambda w, c=c: small_m_linear(x, w, bias, c, activated=True)) for c in own]
    runs.append((None, lambda w: silu_and_mul(linear(x, w, bias, {rows: plain}))))
    runs += [(c, lambda w, c=c: small_m_linear(x, w, bias, c, activated=True))
             for c in ACTIVATED_CANDIDATES if c not in own]
    return _fastest(weight_copies(weight), side or torch.cuda.Stream(weight.device), runs)


class TuningCache:
    """The tuned choices, in a JSON file shared by every start on this machine (or volume):
    ``{environment: {shape key: {row bucket: [tile config] | null (cuBLAS)}}}``, and yes / no choices
    (``put_choice``) under their own keys. The environment names the GPU model
    and the torch and triton versions, whose kernels were timed. Saving merges with what the file holds by then and
    replaces it atomically, so concurrent starts (TP ranks, replicas) never leave it half written; an unreadable
    file is logged, timed afresh and replaced by the next save."""

    def __init__(self, path: str | os.PathLike, environment: str):
        self.path = Path(path)
        self.environment = environment
        self._entries: dict[str, dict[str, list[int] | None] | bool] = self._read().get(environment, {})
        self._new: dict[str, dict[str, list[int] | None] | bool] = {}

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("small-M tuning cache %s is unreadable (%s): tuning afresh", self.path, e)
            return {}

    def get(self, key: str) -> dict[int, TileConfig | None] | None:
        """The row bucket → kernel table stored for this shape key, or None when any bucket is missing."""
        entry = self._entries.get(key)
        if entry is None or any(str(rows) not in entry for rows in ROW_BUCKETS):
            return None
        try:
            return {rows: None if entry[str(rows)] is None else TileConfig(*entry[str(rows)]) for rows in ROW_BUCKETS}
        except TypeError:  # a config of another shape (an older file): time it again
            return None

    def put(self, key: str, table: dict[int, TileConfig | None]) -> None:
        entry = {str(rows): None if cfg is None else list(cfg) for rows, cfg in table.items()}
        self._entries[key] = self._new[key] = entry

    def get_choice(self, key: str) -> bool | None:
        """A yes / no choice stored under ``key`` (``put_choice``), or None."""
        value = self._entries.get(key)
        return value if isinstance(value, bool) else None

    def put_choice(self, key: str, value: bool) -> None:
        """A yes / no choice timed once, such as whether a batch bucket's graphs run the norms inside the linears
        (``DecodeGraphs._capture``), so that later starts make the same one."""
        self._entries[key] = self._new[key] = value

    def get_step_costs(self, key: str) -> dict[int, dict[int, float]] | None:
        """Step timings stored under ``key`` (``put_step_costs``), or None."""
        value = self._entries.get(key)
        if not isinstance(value, dict) or not value.get("step_costs"):
            return None
        return {int(b): {int(d): float(ms) for d, ms in row.items()} for b, row in value["step_costs"].items()}

    def put_step_costs(self, key: str, costs: dict[int, dict[int, float]]) -> None:
        """Milliseconds of a step per batch bucket and draft depth (adaptive speculation's cost model, timed at
        start-up as graph replays), so that later starts choose depths from the same table without timing."""
        entry = {"step_costs": {str(b): {str(d): ms for d, ms in row.items()} for b, row in costs.items()}}
        self._entries[key] = self._new[key] = entry

    def save(self) -> None:
        """Write the entries tuned since loading (nothing when none was); errors are logged, not raised."""
        if not self._new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = self._read()
            data.setdefault(self.environment, {}).update(self._new)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            self._new = {}
        except OSError as e:
            logger.warning("small-M tuning cache %s not written: %s", self.path, e)


# part of the cache's environment: choices timed another way are timed again
TIMING_METHOD = "graph replays after a PDL kernel"


def candidates_digest() -> str:
    """A short digest of every tile config the tuner times, in its order: choices made among other candidates or in
    another order (an older release's file) are timed again rather than kept."""
    timed = [candidates(rows) for rows in ROW_BUCKETS]  # in order: the incumbents matter too
    # (an activated tile's block_n counts its interleaved gate and up rows; the plain tile's own form goes first)
    activated = ("interleaved, own first", ACTIVATED_CANDIDATES)
    return hashlib.sha1(repr((timed, activated)).encode()).hexdigest()[:8]


def tuning_environment(device: torch.device) -> str:
    """What a timing depends on besides the shape: the GPU model, the torch / triton builds, how it was timed and
    among which candidates, whether the kernels launch with PDL."""
    pdl = " | pdl" if pdl_supported(device) else ""
    return (f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} | triton {triton.__version__} | "
            f"{TIMING_METHOD} | candidates {candidates_digest()}{pdl}")


def shape_key(weight: torch.Tensor, has_bias: bool, gated: bool) -> str:
    n, k = weight.shape
    return f"{n}x{k} {str(weight.dtype).removeprefix('torch.')}{' bias' if has_bias else ''}{' gated' if gated else ''}"


def tune_small_m_linears(model: torch.nn.Module, cache: TuningCache | None = None) -> int:
    """Fill the ``small_m`` table of every layer of ``model`` that has one, for every row bucket (CUDA, 16-bit
    weights only), and a [gate; up] layer's ``small_m_act`` table (``activated_output``: ``tune_activated``);
    layers of the same shape share one timing, and a shape the cache holds is not timed. Returns how many
    (shape, bucket) pairs were timed."""
    tables: dict[str, dict] = {}
    timed = 0
    side = None  # one warm-up stream for every timing (made when the first shape needs timing)

    def table(key: str, device: torch.device, time_bucket) -> dict:
        nonlocal side, timed
        if key not in tables:
            tables[key] = cache.get(key) if cache is not None else None
            if tables[key] is None:
                side = side or torch.cuda.Stream(device)
                tables[key] = {rows: time_bucket(rows, side) for rows in ROW_BUCKETS}
                timed += len(ROW_BUCKETS)
                if cache is not None:
                    cache.put(key, tables[key])
        return tables[key]

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "small_m", None) is None or weight is None or not weight.is_cuda or weight.dtype not in (
                torch.bfloat16, torch.float16):
            continue
        bias = getattr(module, "bias", None)
        gated = getattr(module, "gated_input", False)
        key = shape_key(weight, bias is not None, gated)
        plain = table(key, weight.device, lambda rows, side: tune(weight, bias, rows, gated, side))
        module.small_m.update(plain)
        if getattr(module, "activated_output", False):
            module.small_m_act.update(table(key + " activated", weight.device, lambda rows, side: tune_activated(
                weight, bias, rows, plain[rows], side)))
    return timed
