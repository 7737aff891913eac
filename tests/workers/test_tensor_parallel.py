"""Tensor parallelism over Ray worker actors with gloo (CPU): greedy tokens with TP=2 and TP=4 equal TP=1."""

from __future__ import annotations

import pytest

from deployments.engine.engine import Engine
from deployments.engine.request import SamplingParams
from deployments.make_heads import make_head
from deployments.make_tiny import make_tiny
from tests.helpers import mixed_prompts
from workers.config import EngineConfig, SpeculativeConfig

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    # 4 query heads, 1 KV head: TP=2 replicates the KV head; vocab 509 is not divisible by 2 (padded shards)
    target = make_tiny("qwen2", base / "t", layers=2, hidden=64, heads=4, kv_heads=1, vocab=509, max_position=512,
                       tie_embeddings=False)
    return {"target": target, "eagle3": make_head("eagle3", target, base / "e3", seed=3, draft_vocab=128),
            "draft": make_tiny("qwen2", base / "d", layers=1, hidden=64, heads=4, kv_heads=2, vocab=509,
                               max_position=512, tokenizer_from=str(target), seed=9)}


def run(tp_models, tp: int, spec: SpeculativeConfig | None, depths: list[int] | None = None):
    from deployments.engine.executor import RayExecutor

    cfg = EngineConfig(model=str(tp_models["target"]), device="cpu", tensor_parallel_size=tp, page_size=4,
                       max_model_len=256, speculative_config=spec)
    executor = RayExecutor.start(cfg)
    try:
        eng = Engine(cfg, executor)
        if depths is not None:  # adaptive speculation's depths forced (plain steps, the draft's lazy catch-ups)
            from speculative.adaptive import DepthSchedule

            eng.depth_policy = DepthSchedule(depths)
        return [o.token_ids for o in eng.generate(mixed_prompts(4), GREEDY)]
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def reference(tp_models):
    """Greedy tokens of the TP=1 target in-process (speculation changes none)."""
    return [o.token_ids for o in Engine(EngineConfig(model=str(tp_models["target"]), device="cpu", page_size=4,
                                                     max_model_len=256)).generate(mixed_prompts(4), GREEDY)]


@pytest.mark.parametrize("spec", [
    None,
    {"method": "eagle3", "num_steps": 2, "topk": 2, "num_draft_tokens": 4},
    {"method": "draft", "num_steps": 2, "draft_tensor_parallel_size": 2},
    {"method": "draft", "num_steps": 2, "draft_tensor_parallel_size": 1},
], ids=["plain", "eagle3-tree", "draft-tp2", "draft-tp1"])
def test_tp2_equals_tp1(ray_cluster, tp_models, reference, spec):
    sc = None
    if spec is not None:
        sc = SpeculativeConfig(model=str(tp_models[spec["method"]]), **spec)
    else:  # TP=1 through the Ray executor too (with speculation, the executor's path is the same one)
        assert run(tp_models, 1, sc) == reference
    assert run(tp_models, 2, sc) == reference


@pytest.mark.parametrize("spec", [
    None,
    {"method": "eagle3", "num_steps": 2, "topk": 2, "num_draft_tokens": 4},
    {"method": "draft", "num_steps": 2, "draft_tensor_parallel_size": 4},
], ids=["plain", "eagle3-tree", "draft-tp4"])
def test_tp4_equals_tp1(ray_cluster, tp_models, reference, spec):
    """Four ranks: one query head each, the target's single KV head (and the draft's two) replicated on every rank,
    the vocabulary's 509 rows in padded shards of 128."""
    sc = None if spec is None else SpeculativeConfig(model=str(tp_models[spec["method"]]), **spec)
    assert run(tp_models, 4, sc) == reference


def test_tp2_forced_depths_equal_tp1(ray_cluster, tp_models, reference):
    """Each rank counts its requests' plain steps and catches its draft up on the same steps (a stash of 2)."""
    sc = SpeculativeConfig(model=str(tp_models["eagle3"]), method="eagle3", num_steps=2, catch_up_window=2)
    assert run(tp_models, 2, sc, depths=[0, 0, 0, 2, 0, 1, 0, 0]) == reference


def test_shutdown_gives_back_the_placement_group(ray_cluster, tp_models):
    """An executor started outside Serve makes its own placement group; shutting down must remove it, or the next
    executor of the process (on GPUs: of the same GPUs) waits for its bundles forever."""
    import time

    import ray

    from deployments.engine.executor import RayExecutor

    cfg = EngineConfig(model=str(tp_models["target"]), device="cpu", tensor_parallel_size=2, page_size=4,
                       max_model_len=256)
    total = ray.cluster_resources()["CPU"]

    def free_cpus_reach(target: float) -> bool:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if ray.available_resources().get("CPU", 0) == target:
                return True
            time.sleep(0.2)
        return False

    assert free_cpus_reach(total)  # nothing left over from the other tests
    executor = RayExecutor.start(cfg)
    try:
        assert executor.owned_placement_group is not None
        assert free_cpus_reach(total - 1)  # two bundles of half a CPU
    finally:
        executor.shutdown()
    assert executor.owned_placement_group is None
    assert free_cpus_reach(total)


def _on_rank(executor, rank: int, fn) -> None:
    """Run ``fn(worker)`` inside rank ``rank``'s actor (to inject a fault there); this module's functions travel by
    value, as the worker processes cannot import it."""
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.get(executor.workers[rank].__ray_call__.remote(fn))


def _fail_after_the_collectives(worker):
    real = worker._launch

    def launch(step):
        real(step)  # (on a CPU the forward, its all-reduces included, runs here)
        raise RuntimeError("injected: rank 1 alone")

    worker._launch = launch


def _fail_before_the_collectives(worker):
    def launch(step):
        raise RuntimeError("injected: rank 1 skips the step")

    worker._launch = launch


@pytest.mark.parametrize("fault", ["ranks_disagree", "rank_hangs", "worker_killed"])
def test_failed_workers_fail_the_engine_not_just_the_step(ray_cluster, tp_models, monkeypatch, fault):
    """A step that failed on one TP rank only leaves the ranks out of step in their collectives (the other rank
    waits in one its peer never joins, or joins the peer's next one); a dead worker cannot step at all. Either way
    the executor refuses every later step and shutting down does not wait on the stuck rank. The engine core then
    starts fresh workers, whose greedy tokens equal the first ones'; past its restart limit (here none), its health
    check fails instead (Serve replaces the replica) and new requests are refused."""
    import time

    import ray

    from deployments.engine.core import EngineCore
    from deployments.engine.executor import RayExecutor, WorkersFailed

    monkeypatch.setattr(RayExecutor, "TEARDOWN_WAIT_S", 3.0)
    cfg = EngineConfig(model=str(tp_models["target"]), device="cpu", tensor_parallel_size=2, page_size=4,
                       max_model_len=256, worker_step_timeout_s=5.0)
    executor = RayExecutor.start(cfg)
    engine = Engine(cfg, executor)
    core = None
    try:
        first = [o.token_ids for o in engine.generate(mixed_prompts(2), GREEDY)]
        assert all(first)
        if fault == "ranks_disagree":
            _on_rank(executor, 1, _fail_after_the_collectives)
        elif fault == "rank_hangs":
            _on_rank(executor, 1, _fail_before_the_collectives)
        else:
            ray.kill(executor.workers[1])
            deadline = time.monotonic() + 10
            while engine.failure is None and time.monotonic() < deadline:  # noticed with no step to run
                time.sleep(0.05)
            assert engine.failure == "TP worker rank 1 died (ActorDiedError)"
        lost = engine.generate(mixed_prompts(2), GREEDY)
        assert all(o.finish_reason == "error" for o in lost)
        assert engine.failure is not None and engine.allocator.num_free == engine.allocator.capacity_pages
        if fault == "ranks_disagree":
            assert "ended step" in engine.failure and "injected: rank 1 alone" in engine.failure
        with pytest.raises(WorkersFailed):
            executor.step(None, 0)
        if fault != "worker_killed":  # (a restart is tested once, on the killed worker)
            monkeypatch.setattr(EngineCore, "MAX_RESTARTS", 0)
        core = EngineCore(cfg, "tiny", engine=engine)  # what the controller's health check asks
        if fault == "worker_killed":
            deadline = time.monotonic() + 60
            while core.restarts == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert core.restarts == 1 and core.engine.executor is not executor
            assert core.engine.executor.owned_placement_group is not None  # the group was kept, not remade
            core.check_health()
            core.check_health(serving=True)
            rids = [f"again{i}" for i in range(2)]
            assert core.submit("client", [(rid, p, vars(GREEDY), time.time())
                                          for rid, p in zip(rids, mixed_prompts(2))]) == [None, None]
            again: dict[str, list[int]] = {rid: [] for rid in rids}
            while rids and time.monotonic() < deadline:
                for rid, ids, reason, *_ in core.poll("client", 0.5):
                    again[rid] += ids
                    if reason is not None:
                        rids.remove(rid)
            assert list(again.values()) == first
        else:
            core._thread.join(10)  # it gave up on the workers
            with pytest.raises(RuntimeError, match="engine workers failed 1 time"):
                core.check_health()
            (refused,) = core.submit("client", [("late", [5, 6, 7], vars(GREEDY), time.time())])
            assert refused["status"] == 503 and "workers failed" in refused["message"]
    finally:
        t0 = time.monotonic()
        if core is not None:
            core.shutdown()
        else:
            engine.shutdown()
        assert time.monotonic() - t0 < 40  # a rank stuck in a collective is killed, not waited for
    assert executor.owned_placement_group is None
    assert (core.engine if core else engine).executor.owned_placement_group is None


def test_bad_tp_size_is_refused(tp_models):
    from workers.layers import QKVParallelLinear, TPGroup

    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 3"):
        QKVParallelLinear(64, 16, 4, 1, False, None, TPGroup(rank=0, size=3))


def test_gpu_visibility_is_widened_only_for_one_distinct_gpu_per_rank():
    """Ray gives each one-GPU actor CUDA_VISIBLE_DEVICES=<its id>; the custom all-reduce needs every rank's GPU
    visible, so the ranks join their ids (rank r then uses device r). Anything else stays as the launcher set it."""
    from workers.kernels.all_reduce import widened_visibility

    assert widened_visibility(["3", "5"]) == "3,5"
    assert widened_visibility(["GPU-aa", "GPU-bb", "GPU-cc"]) == "GPU-aa,GPU-bb,GPU-cc"
    assert widened_visibility(["", ""]) is None  # a launcher that shows every GPU and sets LOCAL_RANK
    assert widened_visibility(["0,1", "0,1"]) is None
    assert widened_visibility(["2", "2"]) is None  # two ranks on one GPU: never widen into a clash
    assert widened_visibility(["1", ""]) is None
    assert widened_visibility(["MIG-aa", "MIG-bb"]) is None  # CUDA shows one MIG instance per process


def test_custom_all_reduce_switch_reaches_the_config():
    import argparse

    from deployments.cli import _engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    _engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--tp", "2", "--disable-custom-all-reduce"]))
    assert cfg.disable_custom_all_reduce and cfg.tensor_parallel_size == 2
    assert not engine_config_from_args(p.parse_args(["--model", "m"])).disable_custom_all_reduce
    assert EngineConfig(model="m").resolved_device() == "cpu"  # auto on a machine without GPUs


# a prefill of 5 and 3 tokens, one-row and two-row steps, then a 20-token prefill (past MAX_ROWS: norm kernels)
FORWARDS = [([0, 1], [5, 3]), ([0], [1]), ([0, 1], [1, 1]), ([1], [20])]


def _logits(path: str, tp, fold: bool) -> list:
    """The model's logits over FORWARDS (torch-native attention, fp32), its norm weights folded if ``fold``."""
    import torch

    from attention.torch_native import TorchNativeBackend
    from workers.forward_batch import ForwardBatch
    from workers.kernels.small_m_linear import MAX_ROWS
    from workers.kv_cache import KVCache, PageTable
    from workers.loader import load_weights
    from workers.messages import ForwardMode
    from workers.model_config import ModelConfig
    from workers.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_pretrained(path)
    model = LlamaForCausalLM(cfg, torch.float32, tp)
    load_weights(model, path)
    if fold:
        model.fold_norms()
    spec = model.layers[0].self_attn.spec
    kv = KVCache(cfg.num_layers, 17, 4, spec.num_kv_heads, spec.head_dim, torch.float32, torch.device("cpu"))
    table = PageTable(2, 8, 4, torch.device("cpu"))
    table.table.copy_(torch.arange(1, 17, dtype=torch.int32).view(2, 8))
    g = torch.Generator().manual_seed(5)
    lens, out = [0, 0], []
    for slots, new in FORWARDS:
        ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=g)
        seq = [lens[s] + n for s, n in zip(slots, new)]
        fb = ForwardBatch.build(ForwardMode.EXTEND if max(new) > 1 else ForwardMode.DECODE, ids, slots, seq, new,
                                kv, table)
        fb.attn_backend = TorchNativeBackend()
        fb.attn_backend.init_forward_metadata(fb)
        assert model.fuses_norms(len(ids)) == (fold and len(ids) <= MAX_ROWS)
        with torch.no_grad():
            out.append(model.compute_logits(model(fb)).float())
        for s, n in zip(slots, new):
            lens[s] += n
    return out


def _folded_rank(rank: int, path: str, port: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    from workers.distributed import init_distributed

    tp = init_distributed(rank, 2, "127.0.0.1", port, "cpu")
    try:
        logits = _logits(path, tp, fold=True)
        agreed = tp.all_reduce_host([float(rank), 1.0], op=dist.ReduceOp.MIN)
        if rank == 0:
            torch.save({"logits": logits, "agreed": agreed}, result)
    finally:
        dist.destroy_process_group()


def test_tp2_norms_in_linears_equal_tp1(tp_models, tmp_path):
    """Under TP the folded model runs its norms inside the linears on every rank whatever each one's tuning picked,
    and rank 0 alone adds the residual stream to its partial sum before the all-reduce: the stream is added once,
    and the logits equal TP=1's with its norm kernels (gloo, two processes)."""
    import socket

    import torch
    import torch.multiprocessing as mp

    from workers.layers import SINGLE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = str(tmp_path / "tp2.pt")
    mp.spawn(_folded_rank, args=(str(tp_models["target"]), port, result), nprocs=2, join=True)
    got = torch.load(result)
    assert got["agreed"] == [0.0, 1.0]
    ref = _logits(str(tp_models["target"]), SINGLE, fold=False)
    assert len(got["logits"]) == len(ref) == len(FORWARDS)
    for a, b in zip(got["logits"], ref):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


def test_the_rendezvous_port_is_outside_the_ephemeral_range():
    """Rank 0 binds the port a moment after the executor picks it; a port from the ephemeral range could meanwhile
    become an outgoing connection's local port (a CI run once failed with EADDRINUSE there)."""
    import socket

    from deployments.engine.executor import _free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(20):
        port = _free_port()
        assert 20000 <= port < low, port
        with socket.socket() as s:
            s.bind(("", port))  # free when picked
