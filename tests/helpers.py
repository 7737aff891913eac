"""Helpers the tests share (the fixtures are in conftest.py): the repository root, transformers' greedy reference,
mixed prompts, running an engine until idle, a Llama-3-style tokenizer copy of a tiny checkpoint, and starting a
Serve application on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (stops at EOS like the engine)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def mixed_prompts(n: int = 8, vocab: int = 500, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 1, 40, 9, 64, 25, 5, 33, 12][:n]
    return [torch.randint(4, vocab, (L,), generator=g).tolist() for L in lengths]


def run_all(engine, prompts, params, overlap: bool) -> list:
    """Queue the requests and step the engine until idle; checks that steps were left unread on the worker exactly
    when ``overlap`` (one at most), that requests were preempted, and that every page came back. Returns the
    requests."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    most_unread = 0
    while engine.has_work():
        engine.step()
        most_unread = max(most_unread, len(engine.executor.worker._launched))
    assert most_unread == (1 if overlap else 0)
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_free == engine.allocator.capacity_pages
    assert all(r.num_inflight == 0 for r in reqs)
    return reqs


LLAMA3_STYLE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama3_style(src, dst):
    """A copy of a tiny checkpoint whose tokenizer prepends BOS (as Llama 3's tokenizer.json does) and whose chat
    template starts with ``{{ bos_token }}`` (as Llama 3's does) and refuses tool messages; generation_config.json
    asks for greedy decoding and names one more end-of-sequence id."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A {tok.bos_token} $B",
        special_tokens=[(tok.bos_token, tok.bos_token_id)])
    tok.chat_template = "{{ bos_token }}" + LLAMA3_STYLE_TEMPLATE
    tok.save_pretrained(dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    gen.update(temperature=0.0, top_p=0.9, eos_token_id=[gen["eos_token_id"], 7])
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout_s: float = 240.0) -> None:
    import httpx
    import pytest

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{base} did not become healthy")


@contextlib.contextmanager
def serve_app(args: dict, name: str = "specserve", num_cpus: int = 4):
    """Ray, Serve on a free loopback port, and one application built from ``args`` (an LLMConfig) at /; yields the
    base URL, and shuts both down afterwards."""
    import ray
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=name, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()
