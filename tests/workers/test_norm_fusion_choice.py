"""A batch bucket's graphs with or without the norms inside the linears (``DecodeGraphs._capture_faster_fusion``), run on
the CPU with the small-M kernels in Triton's interpreter: the worker captures both, keeps one under the plain graph
keys (the kept one runs the forwards it was chosen for: counted norm kernels), generates the same tokens as an eager
run of that choice, stores the choice in the tuning cache, and a later start follows the cache without timing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROMPT = [[5, 17, 99, 3, 42]]
# GEMV tiles for 1 and 2 rows (what the GPU's tuner fills in; on the CPU nothing is tuned)
TILES = {1: (1, 16, 32, 2, 1), 2: (2, 16, 32, 2, 1)}


def start(model_dir: str, cache_path: Path, norms_in_linears: bool = True):
    """An engine on the CPU with its target's norms folded and small-M kernels in every projection's table."""
    from deployments.engine.engine import Engine
    from workers.config import EngineConfig
    from workers.kernels import small_m_linear as sml
    from workers.kernels.tuning import TuningCache

    eng = Engine(EngineConfig(model=model_dir, device="cpu", cuda_graph_max_bs=2, max_model_len=128))
    worker = eng.executor.worker
    model = worker.target.model
    model.fold_norms()
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            proj.small_m.update({rows: sml.TileConfig(*tile) for rows, tile in TILES.items()})
    model.norms_in_linears = norms_in_linears
    worker.tuning_cache = TuningCache(cache_path, "interpreter")
    return eng, worker, model


def norm_kernels_per_replay(worker, bucket: int) -> int:
    """How many RMSNorm kernels one replay of the bucket's decode graph runs."""
    from workers import layers

    calls = []
    real = layers.rms_norm
    layers.rms_norm = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        worker.graphs.replay(("decode", bucket, "greedy", False))
    finally:
        layers.rms_norm = real
    return len(calls)


def check(model_dir: str, cache_dir: str) -> None:
    import torch

    from deployments.engine.request import SamplingParams
    from workers import graphs as worker_module
    from workers.kernels.tuning import TuningCache

    worker_module.NORM_FUSION_PASSES = worker_module.NORM_FUSION_REPLAYS = 1  # interpreted forwards are slow
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cache_path = Path(cache_dir) / "small_m_linear.json"
    eng, worker, model = start(model_dir, cache_path)
    assert model.fuses_norms(1) and model.fuses_norms(2) and not model.fuses_norms(3)
    with torch.inference_mode():
        worker.capture_graphs()
    chosen = dict(worker.graphs.norm_fusion)
    assert set(chosen) == {1, 2}, chosen
    assert all(len(key) == 4 for key in worker.graphs.graphs), list(worker.graphs.graphs)  # no variant left
    assert len(worker.graphs.graphs) == len(worker.graphs.phases)  # one decode graph per bucket
    layers = len(model.layers)
    for bucket, fused in chosen.items():
        assert norm_kernels_per_replay(worker, bucket) == (1 if fused else 1 + 2 * layers), (bucket, fused)
    tokens = [o.token_ids for o in eng.generate(PROMPT, params)]
    ref_eng, _, _ = start(model_dir, Path(cache_dir) / "unused.json", norms_in_linears=chosen[1])
    assert tokens == [o.token_ids for o in ref_eng.generate(PROMPT, params)]  # eager, the same choice

    stored = TuningCache(cache_path, "interpreter")
    assert {b: stored.get_choice(worker.graphs.norm_fusion_key(b)) for b in chosen} == chosen
    for bucket, fused in chosen.items():  # a later start follows the cache, even against its own timing
        stored.put_choice(worker.graphs.norm_fusion_key(bucket), not fused)
    stored.save()
    eng, worker, model = start(model_dir, cache_path)
    with torch.inference_mode():
        worker.capture_graphs()
    assert worker.graphs.norm_fusion == {b: not f for b, f in chosen.items()}
    for bucket, fused in worker.graphs.norm_fusion.items():
        assert norm_kernels_per_replay(worker, bucket) == (1 if fused else 1 + 2 * layers), (bucket, fused)
    print(f"norm fusion choice ok: {chosen}")


def test_a_bucket_keeps_the_faster_fusion_choice(tiny_models, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, __file__, str(tiny_models["llama"]), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "norm fusion choice ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_the_worker_keeps_the_tuning_cache_it_opened(tiny_models, tmp_path, monkeypatch):
    """The tuning cache the start-up tuning opens is the one each bucket's fusion choice is then read from and saved
    to: a worker that dropped it timed every bucket again at each start (and could choose otherwise, so its bf16
    tokens could change between restarts). Run as on a GPU (no graph refusal); CPU weights are timed by nothing."""
    from workers.config import EngineConfig
    from workers.kernels import tuning
    from workers.worker import Worker

    monkeypatch.setattr(Worker, "_graph_refusal", lambda self: None)
    monkeypatch.setattr(tuning, "tuning_environment", lambda device: "cpu")
    worker = Worker(EngineConfig(model=str(tiny_models["llama"]), device="cpu", tuning_cache_dir=str(tmp_path)))
    assert worker.tuning_cache is not None and worker.tuning_cache.path == tmp_path / "small_m_linear.json"
    assert worker.graphs.norm_fusion_key(1) != worker.graphs.norm_fusion_key(2)
    assert "| tp 1 |" in worker.graphs.norm_fusion_key(1)  # a TP=2 start of the same model times its own choice


if __name__ == "__main__":
    check(sys.argv[1], sys.argv[2])
