"""The Serve application the serve tests share: one Ray instance and one application (the tiny Llama, speculating
with itself as its draft, behind an API key from a file) for the whole tests/serve package, and further
applications on the same Serve instance for tests that need other settings (``second_app``)."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.helpers import free_port, wait_healthy

API_KEY = "test-key-0b6f2c"
ENV_KEY = "env-key-7d41aa"  # the second application's, from an environment variable


@pytest.fixture(scope="package")
def server(tiny_models, tmp_path_factory):
    import ray
    from ray import serve

    from deployments.app import build_app

    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(API_KEY + "\n")  # as a mounted Secret: surrounding whitespace is not part of the key
    os.environ["SPECSERVE_TEST_KEY_ENV"] = ENV_KEY  # before Ray starts: its processes inherit it
    metrics_port, http_port = free_port(), free_port()
    ray.init(num_cpus=8, include_dashboard=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000}, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    target = str(tiny_models["llama"])
    args = {
        "model_loading_config": {"model_id": "tiny", "model_source": target},
        "api_key_file": str(key_file),
        "engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 256, "max_num_seqs": 2,
                          "max_queue_len": 2,
                          # the target as its own draft: every draft token is accepted
                          "speculative_config": {"method": "draft", "model": target, "num_steps": 2}},
    }
    serve.run(build_app(args), name="specserve", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{http_port}"
    wait_healthy(base)
    yield {"base": base, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "target": target,
           "key_file": str(key_file)}
    serve.shutdown()
    ray.shutdown()


@contextlib.contextmanager
def second_app(server, name: str, app_args: dict, model_source: str | None = None):
    """Another application on the same Serve instance, at /<name>, serving the tiny target (or ``model_source``)
    with ``app_args``; yields an openai client for it and deletes the application afterwards."""
    from openai import OpenAI
    from ray import serve

    from deployments.app import build_app

    args = {"model_loading_config": {"model_id": name, "model_source": model_source or server["target"]},
            "engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 256, "max_num_seqs": 2}, **app_args}
    serve.run(build_app(args), name=f"specserve-{name}", route_prefix=f"/{name}", blocking=False)
    try:
        wait_healthy(f"{server['base']}/{name}")
        yield OpenAI(base_url=f"{server['base']}/{name}/v1", api_key=API_KEY if "api_key_file" in app_args else "none",
                     max_retries=0)
    finally:
        serve.delete(f"specserve-{name}")
