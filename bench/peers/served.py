"""The served rows: one engine's OpenAI server on a random-weight checkpoint, driven by our load generator.

    python3 -m bench.peers.served --engine vllm --model /tmp/llama-3.1-8b-random --out /tmp/peer_runs/served_vllm_8b
    python3 -m bench.peers.served --engine specserve --model /tmp/llama-3.1-8b-random --out ...

vllm: `python3 -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs) with load_format dummy and the offline
rows' dtype and max_model_len, vLLM's defaults otherwise. specserve: `serve run` of a config written here for the
same checkpoint (the offline rows' engine settings, no speculation, every step's tokens streamed:
stream_batching_interval_ms 0). The server runs as its own process group (``--server-pythonpath`` is its
PYTHONPATH); ``python3 -m bench.serving`` waits for its /health and drives it at each concurrency C (2C requests,
C in flight, fixed lengths, greedy, ignore_eos), then the server is stopped. Results: <out>.json / .md / .png
(bench.serving's) and <out>.log (the server's whole log); <out>.yaml is our config.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.peers.workload import MAX_MODEL_LEN, SPECSERVE_GPU_KWARGS


def specserve_config(model: str, model_id: str, port: int, engine_kwargs: dict | None = None) -> dict:
    """A serve config for ``model`` with the offline rows' engine settings (``engine_kwargs`` merged over them) and
    no speculation."""
    kwargs = {"device": "cuda", "tensor_parallel_size": 1, **SPECSERVE_GPU_KWARGS, **(engine_kwargs or {})}
    return {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "specserve", "route_prefix": "/", "import_path": "deployments.app:build_app",
                              "args": {"model_loading_config": {"model_id": model_id, "model_source": model},
                                       "engine_kwargs": kwargs,
                                       "stream_interval": 1, "stream_batching_interval_ms": 0,
                                       "deployment_config": {"max_ongoing_requests": 1024},
                                       "placement_group_config": {"strategy": "STRICT_PACK"}}}]}


def vllm_command(model: str, model_id: str, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
            model_id, "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--load-format", "dummy",
            "--seed", "0", "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]


def stop(proc: subprocess.Popen, ray: bool) -> None:
    """SIGINT to the server's group (Serve shuts down, uvicorn drains), SIGKILL to what is left after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if ray:
        subprocess.run(["ray", "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["vllm", "specserve"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="result prefix (bench.serving's --out)")
    ap.add_argument("--port", type=int, default=None, help="default 8100 (vllm) / 8000 (specserve)")
    ap.add_argument("--server-pythonpath", default=os.environ.get("PYTHONPATH", ""))
    ap.add_argument("--concurrencies", default="1,16,64,128,256")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--waves", type=int, default=2, help="requests per level in units of C (bench.serving's)")
    ap.add_argument("--wait-s", type=float, default=900)
    ap.add_argument("--device-label", default=None)
    ap.add_argument("--engine-kwargs", default=None, help="specserve: JSON merged over the engine settings (a CPU "
                    "smoke run of this script: '{\"device\": \"cpu\", \"dtype\": \"float32\", ...}')")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the server (finally below)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_id = Path(args.model).name
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    port = args.port or (8100 if args.engine == "vllm" else 8000)
    env = dict(os.environ, PYTHONPATH=args.server_pythonpath)
    if args.engine == "vllm":
        cmd = vllm_command(args.model, model_id, port)
        target = ["--url", f"http://127.0.0.1:{port}/v1", "--model-id", model_id, "--vocab-size", str(vocab)]
    else:
        cfg = out.with_suffix(".yaml")
        kw = json.loads(args.engine_kwargs) if args.engine_kwargs else None
        cfg.write_text(yaml.safe_dump(specserve_config(args.model, model_id, port, kw), sort_keys=False))
        cmd = ["serve", "run", str(cfg)]
        env["RAY_AUTH_MODE"] = "disabled"
        target = ["--server-config", str(cfg)]
    log = out.with_suffix(".log")
    t0 = time.time()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    rc = 1
    try:
        client = [sys.executable, "-m", "bench.serving", *target, "--wait-s", str(args.wait_s), "--server-pid",
                  str(proc.pid), "--server-log", str(log), "--concurrencies", args.concurrencies, "--input-len",
                  str(args.input_len), "--output-len", str(args.output_len), "--range-ratio", "0", "--waves", str(args.waves), "--out", str(out)]
        if args.device_label:
            client += ["--device-label", args.device_label]
        rc = subprocess.call(client)
    finally:
        stop(proc, ray=args.engine == "specserve")
    res = out.with_suffix(".json")
    if res.is_file():  # which server answered, and how it was started
        meta = json.loads(res.read_text())
        meta.update(engine=args.engine, server_command=" ".join(cmd), served_command=" ".join(sys.argv))
        res.write_text(json.dumps(meta, indent=1))
    print(f"{args.engine} served sweep: exit {rc}, {time.time() - t0:.0f}s with the server's start", flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
