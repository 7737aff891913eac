"""Ray Serve's throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1, the mode under HAProxy: user code and
the router on the replica's event loop, where a deployment handle used from another thread raises), on a Ray
instance of its own started with that switch: the ingress's ready line comes, and a streamed completion is served."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import serve_app


@pytest.fixture(scope="module")
def base(tiny_models):
    old = os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED")
    os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"  # read by the Serve processes this Ray instance starts
    try:
        args = {"model_loading_config": {"model_id": "tiny", "model_source": str(tiny_models["llama"])},
                "engine_kwargs": {"device": "cpu", "page_size": 4, "max_model_len": 256, "max_num_seqs": 4}}
        with serve_app(args, "fast") as url:
            yield url
    finally:
        if old is None:
            os.environ.pop("RAY_SERVE_THROUGHPUT_OPTIMIZED", None)
        else:
            os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = old


def test_ready_line_and_a_stream_in_throughput_optimized_mode(base):
    import ray

    with httpx.stream("POST", f"{base}/v1/completions", timeout=120,
                      json={"prompt": "hi", "max_tokens": 4, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(c["text"] for line in lines[:-1] for c in json.loads(line[6:])["choices"])
    assert text, lines
    # the line goes to the replica process's own stdout (Serve points sys.stdout at its buffered log in this mode)
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    deadline = time.monotonic() + 30
    while not any("specserve ready:" in p.read_text(errors="replace") for p in logs.glob("worker-*.out")):
        assert time.monotonic() < deadline, "no ready line in the ingress replica's stdout"
        time.sleep(0.5)
