"""The engine on the host (see docs/structure.md). ``freeze_startup_heap`` lives here, torch-free, because both the
engine core and the ingress replicas (which import no engine) freeze their start-up heaps; ``tune_gc_for_steps``
beside it (the engine core's collector), and ``GcTimer``, which times its collections."""

import atexit
import gc
import time


def freeze_startup_heap() -> None:
    """Once a server process is up: collect, then move every object alive into the garbage collector's permanent
    generation (``gc.freeze``), as vLLM's engine core does after start-up. The start-up heap (torch, transformers,
    Ray, FastAPI, the tokenizer, the model's modules, the captured graphs) is large; left in the oldest generation,
    every full collection while serving scans all of it: a long pause inside a step, or in an ingress replica's
    event loop (every stream it serves). Objects created later are collected as before. For a process that keeps
    its start-up objects for its life (the engine core, an ingress replica); ``gc.unfreeze`` gives the frozen
    objects back to the collector, and runs at exit (frozen objects would outlive the interpreter's final
    collections, and Triton's bindings report them as leaked)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once
    atexit.register(gc.unfreeze)


# the youngest generation's threshold in a process that steps an engine (``tune_gc_for_steps``)
STEP_GC_THRESHOLD = 20_000


def tune_gc_for_steps(threshold: int = STEP_GC_THRESHOLD) -> None:
    """For the process whose thread steps the engine (the engine core), after ``freeze_startup_heap``: a collection
    of the youngest generation once ``threshold`` container objects more are alive than at the last one, instead of
    700 (the interpreter's default). A decode step keeps about four new objects alive, but at a large batch it holds
    over a thousand at once while it runs (each request's output and its lists; at 256 requests about 1,300), all
    freed by their reference counts when the step ends; with the default that transient alone started a collection
    in nearly every step (what that cost is in docs/performance.md).
    With the threshold above the largest batch's transient, collections follow what really accumulates (new
    requests' state): rare, each over at most ``threshold`` young objects. Process-local, like the freeze; the older
    generations' thresholds stay the interpreter's."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)


class GcTimer:
    """The collections of this process, timed (``gc.callbacks``): per generation how many, their total and their
    longest, in seconds. A full collection over a large heap is a pause inside whatever step triggers it, which
    /v1/stats should show rather than leave to guesswork. ``close`` removes the callback."""

    def __init__(self):
        self.by_generation = {g: [0, 0.0, 0.0] for g in range(3)}  # generation -> [count, total s, longest s]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        row = self.by_generation[info["generation"]]
        row[0] += 1
        row[1] += took
        row[2] = max(row[2], took)

    def seconds(self) -> float:
        """Every generation's collections, their time so far."""
        return sum(row[1] for row in self.by_generation.values())

    def stats(self) -> dict:
        return {f"gen{g}": {"collections": n, "s": round(total, 6), "longest_s": round(longest, 6)}
                for g, (n, total, longest) in self.by_generation.items()}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
