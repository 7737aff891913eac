"""``check_ray_tp`` runs the in-process TP=1 reference first, then the Ray workers take the GPUs: the reference's
engine (its worker's weights, KV cache and graphs) must be gone when ``run`` returns, not left to a later collection
of the reference cycles it sits in (``torch.cuda.empty_cache`` releases only blocks nothing holds, and the next
run's ``freeze_startup_heap`` would collect it after the TP workers had loaded). A CPU check, no GPU needed."""

from __future__ import annotations

import gc

from deployments.make_tiny import make_tiny
from tests.gpu.check_ray_tp import run
from workers.worker import Worker


def test_the_tp1_reference_engine_is_freed_when_its_run_returns(tmp_path):
    # (the script's prompt is ids 1000..1127)
    ckpt = make_tiny("llama", tmp_path / "llama", layers=2, hidden=64, vocab=2048, max_position=4096)
    gc.collect()  # (other tests' engines left as garbage: ``run`` collects, which would count them as freed)
    before = sum(isinstance(o, Worker) for o in gc.get_objects())  # (other tests' engines still alive)
    result = run(str(ckpt), 1, 4, "torch_native", "float32", device="cpu")
    assert len(result["tokens"]) == 4 and result["error"] is None
    left = sum(isinstance(o, Worker) for o in gc.get_objects())  # (garbage not yet collected is listed too)
    assert left == before, f"{left - before} TP=1 worker(s) left for a later collection"
