"""Ray Serve LLM compatibility: its args shape (``llm_configs``) through ``deployments.app:build_openai_app``, the
vLLM-style engine_kwargs its users write, and a two-model application routed by ``model``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import openai
import pytest
import yaml

from tests.helpers import wait_healthy
from tests.serve.conftest import API_KEY

ROOT = Path(__file__).resolve().parents[2]


def _controllers(app):
    """The bound controller deployments of an application built by build_openai_app (the ingress's args)."""
    ingress = app._bound_deployment
    return [ingress.init_args[0]._bound_deployment] + [
        m["controller"]._bound_deployment for m in ingress.init_kwargs.get("more_models", [])]


def test_the_ray_serve_llm_sample_yaml_builds_with_only_import_path_changed():
    from deployments.app import build_openai_app
    from deployments.config import LLMConfig

    text = (ROOT / "configs/ray-serve-llm-llama8b-eagle3.yaml").read_text()
    app_cfg = yaml.safe_load(text)["applications"][0]
    assert app_cfg["import_path"] == "deployments.app:build_openai_app"
    # the same YAML as Ray Serve LLM's docs would write it (their import path): only that line differs
    theirs = text.replace("deployments.app:build_openai_app", "ray.serve.llm:build_openai_app")
    assert yaml.safe_load(theirs)["applications"][0]["args"] == app_cfg["args"]
    [ctl] = _controllers(build_openai_app(app_cfg["args"]))
    cfg = LLMConfig(**ctl.init_args[0])
    engine = cfg.engine_config()
    spec = engine.speculative_config
    assert (spec.method, spec.num_steps, spec.topk, spec.num_draft_tokens) == ("eagle3", 3, 1, 4)
    assert spec.model == "/models/EAGLE3-LLaMA3.1-Instruct-8B"
    assert (engine.device, engine.dtype, engine.max_model_len, engine.max_num_seqs, engine.max_prefill_tokens) == (
        "cuda", "bfloat16", 8192, 128, 2048)
    # accelerator_type: a sliver of Ray's accelerator_type:H100 resource in every bundle, GPU bundles for the rank
    bundles = ctl._replica_config.placement_group_bundles
    assert all(b["accelerator_type:H100"] == 0.001 for b in bundles)
    assert bundles[1]["GPU"] == 1 and len(bundles) == 2
    # runtime_env: the controller replica's (the engine core and the workers inherit it); num_cpus stays 0
    assert ctl._replica_config.ray_actor_options["runtime_env"] == {
        "env_vars": {"SPECSERVE_CACHE_DIR": "/tmp/specserve-cache"}}
    assert ctl._replica_config.ray_actor_options["num_cpus"] == 0


def test_vllm_engine_kwargs_map_to_ours():
    from deployments.rayllm import translate_engine_kwargs

    ours = translate_engine_kwargs({
        "enforce_eager": True, "max_num_batched_tokens": 512, "block_size": 32, "dtype": "half",
        "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "pipeline_parallel_size": 1,
        "enable_prefix_caching": True,
        "speculative_config": {"model": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                               "prompt_lookup_min": 2}})
    assert ours == {"disable_cuda_graph": True, "max_prefill_tokens": 512, "page_size": 32, "dtype": "float16",
                    "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "enable_prefix_caching": True,
                    "speculative_config": {"method": "ngram", "num_steps": 5, "ngram_max": 3, "ngram_min": 2}}
    assert translate_engine_kwargs(ours) == ours  # ours pass through: translating twice changes nothing
    spec = translate_engine_kwargs({"speculative_config": {"method": "draft_model", "model": "/m/small",
                                                           "num_speculative_tokens": 4,
                                                           "draft_tensor_parallel_size": 1}})
    assert spec["speculative_config"] == {"method": "draft", "model": "/m/small", "num_steps": 4,
                                          "draft_tensor_parallel_size": 1}
    # no method: vLLM's inference from the draft's name
    spec = translate_engine_kwargs({"speculative_config": {"model": "/m/EAGLE3-x", "num_speculative_tokens": 2}})
    assert spec["speculative_config"]["method"] == "eagle3"


@pytest.mark.parametrize("kwargs, named", [
    ({"speculative_config": {"method": "medusa", "model": "/m", "num_speculative_tokens": 2}}, "medusa"),
    ({"speculative_config": {"method": "eagle", "model": "/m", "speculative_token_tree": "[(0,)]"}},
     "speculative_token_tree"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "num_steps": 2}}, "num_steps"),
    ({"quantization": "awq"}, "quantization"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"no_such_engine_arg": 1}, "no_such_engine_arg"),
    ({"distributed_executor_backend": "external_launcher"}, "distributed_executor_backend"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
    ({"tensor_parallel_size": 2, "placement_group_config": {"bundles": [{"GPU": 1}, {"GPU": 1}]}},
     "placement_group_config.bundles: 2 given"),
])
def test_what_has_no_mapping_is_refused_naming_it(kwargs, named):
    from deployments.config import LLMConfig

    pg = kwargs.pop("placement_group_config", {})
    with pytest.raises(ValueError, match=named):
        LLMConfig(model_loading_config={"model_id": "m", "model_source": "/m"}, engine_kwargs=kwargs,
                  placement_group_config=pg)


def test_harmless_vllm_keys_are_ignored_with_a_warning(caplog):
    from deployments.rayllm import translate_engine_kwargs

    with caplog.at_level(logging.WARNING, logger="specserve"):
        assert translate_engine_kwargs({"swap_space": 4, "enable_chunked_prefill": True}) == {}
    assert "swap_space" in caplog.text and "enable_chunked_prefill" not in caplog.text  # (as ours)
    with caplog.at_level(logging.WARNING, logger="specserve"):  # vLLM's worker processes: ours are actors
        assert translate_engine_kwargs({"distributed_executor_backend": "mp"}) == {"distributed_executor_backend": "ray"}
    assert "'mp' runs as 'ray'" in caplog.text


def test_builder_args_are_checked(tmp_path):
    from deployments.app import build_openai_app

    one = {"model_loading_config": {"model_id": "a", "model_source": "/m"}, "engine_kwargs": {"device": "cpu"}}
    with pytest.raises(ValueError, match="unique"):
        build_openai_app({"llm_configs": [one, one]})
    with pytest.raises(ValueError, match="model_loading_config"):  # a single LLMConfig belongs to build_app
        build_openai_app(one)
    with pytest.raises(ValueError, match="api_key_env"):
        other = {"model_loading_config": {"model_id": "b", "model_source": "/m"}, "api_key_env": "OTHER"}
        build_openai_app({"llm_configs": [one, other]})
    with pytest.raises(ValueError, match="min_replicas must be >= 1"):  # nothing could scale an engine up from 0
        build_openai_app({"llm_configs": [{**one, "deployment_config": {"autoscaling_config": {
            "min_replicas": 0, "max_replicas": 2}}}]})
    # several engines of one model autoscale on their own load (deployments/autoscaling.py), and Ray Serve LLM's
    # PrefixCacheAffinityRouter config becomes the ingress's router
    scaled_app = build_openai_app({"llm_configs": [{**one, "deployment_config": {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2},
        "request_router_config": {"request_router_class": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
                                  "request_router_kwargs": {"imbalanced_threshold": 3}}}}]})
    (scaled,) = _controllers(scaled_app)
    router = scaled_app._bound_deployment.init_kwargs["router"]
    assert (router["policy"], router["imbalanced_threshold"]) == ("prefix_aware", 3)
    auto = scaled._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 2, 64)  # max_num_seqs
    assert auto.policy.policy_function == "deployments.autoscaling:engine_load_policy"
    path = tmp_path / "b.yaml"  # an entry may be a YAML file's path, as Ray Serve LLM allows
    path.write_text(yaml.safe_dump({**one, "model_loading_config": {"model_id": "b", "model_source": "/m"},
                                    "accelerator_type": "L4", "accelerator_config": {"kind": "cpu"}}))
    a, b = _controllers(build_openai_app({"llm_configs": [one, str(path)]}))
    assert a.name == "LLMController-a" and b.name == "LLMController-b"
    assert all(x["accelerator_type:L4"] == 0.001 for x in b._replica_config.placement_group_bundles)
    assert not any("accelerator_type:L4" in x for x in a._replica_config.placement_group_bundles)


def _alive_workers() -> int:
    """TP worker actors alive in this Ray instance (from the GCS's actor table)."""
    import ray

    return sum(a["ActorClassName"].endswith("WorkerActor") and a["State"] == "ALIVE"
               for a in ray._private.state.actors().values())


def test_two_models_in_one_app_routed_by_model(server, tiny_models):
    """build_openai_app with two tiny checkpoints (Llama, Qwen3), each its own controller and engine, behind one
    ingress: the official client reaches each by name; each answers as its own offline engine does."""
    import ray
    from ray import serve

    from deployments.app import build_openai_app
    from deployments.engine.engine import Engine
    from deployments.engine.request import SamplingParams
    from workers.config import EngineConfig

    engine = {"device": "cpu", "page_size": 4, "max_model_len": 128, "max_num_seqs": 2}
    llm_configs = [
        {"model_loading_config": {"model_id": "m-llama", "model_source": str(tiny_models["llama"])},
         # vLLM's names, as a Ray Serve LLM user writes them
         "engine_kwargs": {**engine, "enforce_eager": True, "enable_chunked_prefill": True,
                           "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                  "prompt_lookup_max": 3}},
         "runtime_env": {"env_vars": {"SPECSERVE_TEST_MARK": "1"}}},
        # vLLM's "uni": rank 0 inside the engine core's process, no worker actor
        {"model_loading_config": {"model_id": "m-qwen3", "model_source": str(tiny_models["qwen3"])},
         "engine_kwargs": {**engine, "distributed_executor_backend": "uni"}},
    ]
    workers_before = _alive_workers()
    serve.run(build_openai_app({"llm_configs": llm_configs}), name="multi", route_prefix="/multi", blocking=False)
    try:
        wait_healthy(server["base"] + "/multi")
        client = openai.OpenAI(base_url=server["base"] + "/multi/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["m-llama", "m-qwen3"]
        assert _alive_workers() == workers_before + 1  # m-llama's rank; m-qwen3's runs in its engine core
        # references: the package's app serves the same Llama checkpoint; the Qwen3 one's offline engine
        tiny = openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        offline = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", max_model_len=128))
        refs = {"m-llama": tiny.completions.create(model="tiny", prompt="def main():", max_tokens=10, temperature=0,
                                                   extra_body={"ignore_eos": True}).choices[0].text,
                "m-qwen3": offline.generate(["def main():"], SamplingParams(max_tokens=10, temperature=0.0,
                                                                            ignore_eos=True))[0].text}
        assert refs["m-llama"] != refs["m-qwen3"]
        for name in ("m-llama", "m-qwen3"):
            r = client.completions.create(model=name, prompt="def main():", max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.model == name and r.choices[0].text == refs[name]
        chat = client.chat.completions.create(model="m-qwen3", max_tokens=2, messages=[{"role": "user",
                                                                                       "content": "hi"}])
        assert chat.model == "m-qwen3"
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="m-none", prompt="x", max_tokens=1)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        assert "m-llama, m-qwen3" in e.value.body["message"]
        # the ready line, once both engines are up: the URL and the node's Prometheus port
        logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
        port = server["metrics"].rsplit(":", 1)[1]  # (":<port>/metrics": the port Ray was started with)
        want = f"specserve ready: {server['base']}/multi/v1 serving m-llama, m-qwen3; Prometheus metrics"
        deadline = time.monotonic() + 20
        while not (lines := [line for p in logs.glob("worker-*.out")
                             for line in p.read_text(errors="replace").splitlines() if want in line]):
            assert time.monotonic() < deadline, "no ready line in the replicas' output"
            time.sleep(0.5)
        assert lines[0].endswith(f":{port}")
    finally:
        serve.delete("multi")


def test_the_ingress_runs_four_replicas_by_default_on_gpus_only():
    """One ingress replica's CPU falls behind a GPU engine's streams (docs/design.md, Streaming): 4 by default there;
    what a config gives (a count, or autoscaling) is kept, and CPU engines get 1."""
    from deployments.config import LLMConfig

    def cfg(device, ingress=None):
        return LLMConfig(model_loading_config={"model_id": "m", "model_source": "/nowhere"},
                         engine_kwargs={"device": device}, ingress_deployment_config=ingress or {})

    assert cfg("cuda").ingress_options() == {"num_replicas": 4}
    assert cfg("cpu").ingress_options() == {"num_replicas": 1}
    assert cfg("cuda", {"num_replicas": 1, "max_ongoing_requests": 64}).ingress_options() == {
        "num_replicas": 1, "max_ongoing_requests": 64}
    scaled = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}
    assert cfg("cuda", scaled).ingress_options() == scaled
    assert cfg("cuda").ingress_options({"max_ongoing_requests": 8}) == {"max_ongoing_requests": 8, "num_replicas": 4}


def test_a_multi_model_ingress_gets_gpu_replicas_when_any_engine_runs_on_gpus():
    """One ingress serves every model of build_openai_app: a GPU engine's streams behind it want 4 replicas even
    where the first model runs on CPU."""
    from deployments.app import build_openai_app

    def app(*devices):
        return build_openai_app({"llm_configs": [
            {"model_loading_config": {"model_id": f"m{i}", "model_source": "/nowhere"}, "engine_kwargs": {"device": d}}
            for i, d in enumerate(devices)]})._bound_deployment.num_replicas

    assert app("cpu", "cuda") == 4, "a GPU engine behind the ingress, not first"
    assert app("cuda", "cpu") == 4 and app("cpu", "cpu") == 1
