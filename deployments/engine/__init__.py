"""The engine on the host (see docs/structure.md). ``freeze_startup_heap`` lives here, torch-free, because both the
engine core and the ingress replicas (which import no engine) freeze their start-up heaps."""

import atexit
import gc


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
