"""GPU performance suite on random-weight Llama shapes (same process, same weights):

1. bs=1 decode ms/token: specserve (CUDA graphs, and eager) vs the bandwidth floor (weight bytes ÷ device-to-device
   copy bandwidth measured in this run);
2. speculation at a simulated accept length (an EAGLE-3-shaped head, chain) vs our own no-spec, bs=1;
3. the 1-step (naive) mode: the round fused in one CUDA graph vs draft / verify / draft-extend graphs, bs=1 and 64;
4. decode throughput, speculation vs no-spec, over batch sizes (parts 2-4: each row the fastest of --spec-repeats runs);
5. (part ``hf``) HF transformers baselines at bs=1 on the same checkpoint: eager ``generate``, static cache +
   ``torch.compile`` (transformers' own compile of the decoding forward), and assisted generation with a standalone
   random draft (``bench.common.DRAFT_SHAPES``: same vocabulary and tokenizer);
6. (part ``draft``) our engine with that same standalone draft (real acceptance and simulated), bs=1, beside no-spec;
7. (part ``sampling``) decode throughput greedy, at a temperature only, and with top-k + top-p, per batch size.

Random weights accept nothing, so speculative runs use ``simulated_accept_length`` (benchmark-only: the verify
forward, acceptance and KV work are all real, the emitted tokens are the drafts). Decode time comes from token
timestamps after each request's first token (prefill excluded). HF assisted generation cannot simulate acceptance:
it and ``specserve_draft`` run at the real acceptance of two random models (about none), so their accept lengths say
nothing about a trained pair; what they compare is the cost of a round.

    python3 -m bench.gpu_perf --shape llama-3.1-8b --out bench/results/decode/gpu_perf_llama8b_h100
    python3 -m bench.gpu_perf --shape llama-3.2-1b --parts hf,draft --out bench/results/decode/gpu_perf_llama1b_hf_h100
    python3 -m bench.gpu_perf --device cpu --shape llama-smoke --parts hf,draft --new-tokens 16 --out /tmp/smoke
    (the last one: a CPU smoke test of the HF and draft code paths, no result)
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from bench.common import (DRAFT_SHAPES, GCTimer, command, commit, copy_bandwidth, device_name, graph_replay_ms,
                          out_path, pyplot, weight_bytes_per_token, write_checkpoint, write_json, write_markdown)


class Suite:
    def __init__(self, args):
        self.args = args
        self.dev = args.device
        self.ckpt = Path(args.ckpt)
        on_gpu = self.dev == "cuda" and torch.cuda.is_available()  # (--report-only works without a GPU)
        self.results = {"device": device_name("cuda" if on_gpu else "cpu"), "commit": commit(),
                        "command": command(),
                        "shape": args.shape, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        if self.dev != "cuda":
            self.results["note"] = "CPU smoke test of the code paths: no result"
        self.out = out_path(args.out)
        self.vocab = 0  # set once the checkpoint exists

    def save(self) -> None:  # after every measurement: a run cut short keeps what it measured
        write_json(self.out, self.results)

    def sync(self) -> None:
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.unfreeze()  # (--gc-freeze) the dropped engine's objects go back to the collector
        gc.collect()  # graphs and their closures form cycles with the worker
        if self.dev == "cuda":
            torch.cuda.empty_cache()

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dev == "cuda" else torch.float32

    def prompt(self, seed: int, n: int | None = None) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(10, min(100000, self.vocab - 10), (n or self.args.prompt_len,), generator=g).tolist()

    def engine(self, spec=None, **kw):
        from deployments.engine.engine import Engine
        from workers.config import EngineConfig

        if self.dev == "cuda":
            kw = {"max_model_len": 4096, "max_num_seqs": 256, "cuda_graph_max_bs": 256, "gpu_memory_utilization": 0.8,
                  "prefill_attention_backend": "triton", "decode_attention_backend": "triton", **kw}
            dtype = "bfloat16"
        else:  # smoke test: the reference backends, no graphs
            kw = {"max_model_len": 1024, "kv_cache_tokens": 16384, **kw, "disable_cuda_graph": True}
            kw.pop("cuda_graph_max_bs", None)
            dtype = "float32"
        eng = Engine(EngineConfig(model=str(self.ckpt), device=self.dev, dtype=dtype, speculative_config=spec, **kw))
        if self.dev == "cuda":
            self.record_kernels(eng)
        if self.args.gc_freeze:  # as the server's controller does after start-up
            from deployments.engine.engine import freeze_startup_heap

            freeze_startup_heap()
        return eng

    def record_kernels(self, eng) -> None:
        """The small-M kernels the engine's start-up tuning chose (per weight shape and row bucket: a tile config or
        cuBLAS): two runs of one commit can differ by these choices alone."""
        from workers.kernels.tuning import shape_key

        worker = eng.executor.worker
        runner = getattr(worker.proposer, "runner", None)
        chosen = self.results.setdefault("small_m_kernels", {})
        for model in [worker.target.model] + ([runner.model] if runner is not None else []):
            for module in model.modules():
                for suffix, table in (("", getattr(module, "small_m", None)),
                                      (" activated", getattr(module, "small_m_act", None))):
                    if table:
                        key = shape_key(module.weight, getattr(module, "bias", None) is not None,
                                        getattr(module, "gated_input", False)) + suffix
                        chosen[key] = {rows: "cublas" if c is None else list(c) for rows, c in table.items()}
        fusion = getattr(worker, "norm_fusion", None)  # per batch bucket: norms inside the linears or not
        if fusion:
            spec = worker.cfg.speculative_config
            self.results.setdefault("norms_in_linears", []).append(
                {"speculation": spec.method if spec is not None else "none", "by_bucket": dict(fusion)})

    def decode_rate(self, eng, bs: int, **sampling) -> dict:
        """Decode tokens/s and ms per token per request for ``bs`` concurrent requests: from when the last request
        got its first token (prefill excluded) to when the last token arrived; ms per step over the steps (rounds)
        that brought tokens. Under the overlap schedule the engine has launched one more step (or speculative round)
        by then, whose results are discarded: draining it delays no token, so it is not timed (timed, it cost a
        speculative run a whole round, 1/43 of a 130-token request's decode, and a plain one a step in 129).
        Greedy unless ``sampling`` (SamplingParams fields) says."""
        from deployments.engine.request import SamplingParams

        for i in range(bs):
            params = SamplingParams(**{"max_tokens": self.args.new_tokens, "temperature": 0.0, "ignore_eos": True,
                                       **sampling, **({"seed": i} if sampling else {})})
            eng.add_request(self.prompt(bs * 1000 + i), params)
        started, start, end, tokens, steps, drafts, accepted = set(), None, None, 0, 0, 0, 0
        with GCTimer() as gct:
            while eng.has_work():
                outs = eng.step()
                now = time.perf_counter()
                for o in outs:
                    if o.finished and o.request.spec is not None:
                        drafts += o.request.spec.num_drafts
                        accepted += o.request.spec.num_accepted_tokens
                if start is None:
                    started.update(o.rid for o in outs if o.new_token_ids)
                    if len(started) == bs:
                        start = now
                        gct.reset()  # collections of the timed steps only
                    continue
                new = sum(len(o.new_token_ids) for o in outs)
                if new:  # a step (round) whose tokens came back; the last one ends the timing
                    tokens += new
                    steps += 1
                    end = now
        if not tokens:
            raise ValueError("no decode steps after the last first token: raise --new-tokens")
        row = {"batch_size": bs, "decode_tok_s": round(tokens / (end - start), 1),
               "ms_per_token_per_request": round((end - start) / (tokens / bs) * 1e3, 3),
               "ms_per_step": round((end - start) / steps * 1e3, 3), "decode_steps": steps,
               "gc_ms_per_step": round(sum(gct.seconds) / steps * 1e3, 3), "gc_collections": gct.count}
        if drafts:
            row["accept_length"] = round(1 + accepted / drafts, 3)
        return row

    @staticmethod
    def fastest_run(runs: list[dict]) -> dict:
        """The run with the fewest ms per step, with every run's ms per step (``ms_per_step_runs``): a stall (a
        host pause inside the timed rounds) only adds time."""
        best = min(runs, key=lambda r: r["ms_per_step"])
        return {**best, "ms_per_step_runs": [r["ms_per_step"] for r in runs]}

    def best_rate(self, eng, bs: int, repeats: int) -> dict:
        """``decode_rate`` timed ``repeats`` times (``fastest_run``)."""
        return self.fastest_run([self.decode_rate(eng, bs) for _ in range(repeats)])

    def floor(self) -> dict:
        """The bs=1 bandwidth floor: weight bytes ÷ measured device-to-device copy bandwidth (CUDA only)."""
        if self.dev != "cuda":
            return {}
        if "floor_ms" not in self.results.get("bs1", {}):
            bw = copy_bandwidth()
            self.results.setdefault("bs1", {}).update(
                {"copy_bandwidth_gb_s": round(bw / 1e9, 1), "weight_bytes": weight_bytes_per_token(self.args.shape),
                 "floor_ms": round(weight_bytes_per_token(self.args.shape) / bw * 1e3, 3)})
        return self.results["bs1"]

    # ---- 1. bs=1 vs floor ----------------------------------------------------------------------------------------
    def bs1_floor(self) -> None:
        row = self.floor()
        floor_ms = row["floor_ms"]
        for name, kw in (("specserve_graphs", {}), ("specserve_graphs_no_overlap", {"disable_overlap_schedule": True}),
                         ("specserve_eager", {"disable_cuda_graph": True})):
            eng = self.engine(**kw, max_num_seqs=8, cuda_graph_max_bs=8)
            self.decode_rate(eng, 1)  # warm-up
            r = self.decode_rate(eng, 1)
            row[f"{name}_ms"] = r["ms_per_token_per_request"]
            row[f"{name}_vs_floor"] = round(r["ms_per_token_per_request"] / floor_ms, 3)
            if name == "specserve_graphs":  # GPU time alone: the bs=1 decode graph replayed back to back
                row["graph_replay_ms"] = round(self.replay_ms(eng), 3)
                row["graph_replay_vs_floor"] = round(row["graph_replay_ms"] / floor_ms, 3)
            del eng
            self.free()
            self.save()
            print(row, flush=True)

    @staticmethod
    def replay_ms(eng, iters: int = 50) -> float:
        """The bs=1 greedy decode graph replayed on its static inputs (the engine is idle: the writes land in
        freed pages), timed with CUDA events."""
        graphs = eng.executor.worker.graphs
        graph = graphs.graphs[("decode", 1, "greedy", False)][0]  # (name, bucket, sampling kind, top logprobs)
        for _ in range(5):
            graph.replay()
        return graph_replay_ms(graph, iters)

    # ---- 5. HF transformers baselines (bs=1, same checkpoint) ----------------------------------------------------
    def draft_ckpt(self) -> Path:
        """The standalone draft (random, same vocabulary and tokenizer as the target), written if missing."""
        a = self.args
        shape = a.draft_shape or DRAFT_SHAPES[a.shape]
        path = Path(a.draft_ckpt or f"/tmp/{shape}-random")
        if not (path / "config.json").is_file():
            t0 = time.time()
            write_checkpoint(path, shape)
            print(f"draft checkpoint {shape} written in {time.time() - t0:.0f}s", flush=True)
        self.results["draft_model"] = {"shape": shape, "path": str(path)}
        return path

    def hf_generate(self, m, ids: torch.Tensor, n: int, **kw) -> tuple[float, int]:
        """One timed greedy ``generate`` of exactly ``n`` new tokens (EOS suppressed); returns (seconds, new tokens
        actually generated)."""
        self.sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **kw)
        self.sync()
        dt = time.perf_counter() - t0
        return dt, out.shape[1] - ids.shape[1]

    @staticmethod
    def check_len(got: int, want: int, what: str) -> None:
        if got != want:
            raise RuntimeError(f"{what}: generate returned {got} new tokens, asked for {want}")

    def hf_part(self) -> None:
        from transformers import AutoModelForCausalLM

        floor_ms = self.floor().get("floor_ms")
        hf = self.results.setdefault("hf", {})
        m = AutoModelForCausalLM.from_pretrained(str(self.ckpt), dtype=self.torch_dtype).to(self.dev).eval()
        ids = torch.tensor([self.prompt(1000)], device=self.dev)  # the prompt decode_rate gives its bs=1 request
        # static + compile last: a compile failure (or what it leaves behind) cannot spoil the eager rows
        for name, fn in (("hf_eager", self.hf_eager), ("hf_assisted_draft", self.hf_assisted),
                         ("hf_static_compile", self.hf_static_compile)):
            try:
                row = fn(m, ids)
            except Exception as e:  # noqa: BLE001 - the exception text is the result; keep the rest of the suite
                import traceback

                row = {"error": f"{type(e).__name__}: {e}"[:1500],
                       "where": "".join(traceback.format_tb(e.__traceback__)[-3:])[-1500:]}
                self.free()
            if floor_ms and "decode_ms_per_token" in row:
                row["vs_floor"] = round(row["decode_ms_per_token"] / floor_ms, 3)
            hf[name] = row
            self.save()
            print(name, row, flush=True)
        del m
        self.free()

    def hf_eager(self, m, ids) -> dict:
        """Eager ``generate`` (dynamic cache): the difference of an n-token and an n/4-token call cancels prefill."""
        n, short = self.args.new_tokens, self.args.new_tokens // 4
        self.hf_generate(m, ids, 16)  # warm-up
        t_short, got_short = self.hf_generate(m, ids, short)
        t_n, got_n = self.hf_generate(m, ids, n)
        self.check_len(got_short, short, "hf_eager")
        self.check_len(got_n, n, "hf_eager")
        ms = (t_n - t_short) / (got_n - got_short) * 1e3
        return {"decode_ms_per_token": round(ms, 3), "ms_per_token_incl_prefill": round(t_n / got_n * 1e3, 3),
                "decode_tok_s": round(1e3 / ms, 1), "new_tokens": got_n,
                "method": f"(T({n}) - T({short})) / {n - short}"}

    def hf_assisted(self, m, ids) -> dict:
        """Assisted generation (``assistant_model=``) with the standalone draft: a constant chain of
        --spec-steps draft tokens per round (no confidence early exit), greedy. HF keeps no acceptance counter: the
        target's forward passes are counted with a hook; accept length = tokens per verify forward after prefill."""
        from transformers import AutoModelForCausalLM

        n, short = self.args.new_tokens, self.args.new_tokens // 4
        d = AutoModelForCausalLM.from_pretrained(str(self.draft_ckpt()), dtype=self.torch_dtype).to(self.dev).eval()
        d.generation_config.num_assistant_tokens = self.args.spec_steps
        d.generation_config.num_assistant_tokens_schedule = "constant"
        d.generation_config.assistant_confidence_threshold = 0.0
        calls = [0]
        hook = m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            self.hf_generate(m, ids, 16, assistant_model=d)  # warm-up
            t_short, got_short = self.hf_generate(m, ids, short, assistant_model=d)
            calls[0] = 0
            t_n, got = self.hf_generate(m, ids, n, assistant_model=d)
        finally:
            hook.remove()
            del d
            self.free()
        self.check_len(got_short, short, "hf_assisted_draft")
        self.check_len(got, n, "hf_assisted_draft")
        ms = (t_n - t_short) / (got - got_short) * 1e3
        return {"decode_ms_per_token": round(ms, 3), "ms_per_token_incl_prefill": round(t_n / got * 1e3, 3),
                "decode_tok_s": round(1e3 / ms, 1), "new_tokens": got, "target_forwards": calls[0],
                "accept_length": round((got - 1) / max(calls[0] - 1, 1), 3),
                "num_assistant_tokens": self.args.spec_steps, "method": f"(T({n}) - T({short})) / {n - short}",
                "note": "random target and draft: acceptance is about none, not comparable with a trained pair"}

    def hf_static_compile(self, m, ids) -> dict:
        """Static cache + ``torch.compile``, the way transformers documents it: with a compileable (static) cache,
        ``generate`` compiles the decoding forward itself (``generation_config.compile_config``; the default is
        inductor, mode="reduce-overhead", i.e. CUDA graphs). One StaticCache object serves every call (reset in
        between): its tensors keep their addresses and its shape, so nothing is re-compiled or re-recorded across
        calls. Warm-up calls generate the same n new tokens as the timed ones (compile and graph recording happen
        there); the timed calls must add no dynamo graph. decode ms/token = (T(n) - T(1)) / (n - 1): T(1) is the
        prefill (the first token comes from the prompt's logits); T(n) / n is reported too."""
        import statistics

        from transformers import StaticCache
        from transformers.generation import CompileConfig

        n, reps = self.args.new_tokens, self.args.hf_repeats
        if self.dev != "cuda":  # transformers compiles on CUDA only unless told to (CPU: smoke test of this path)
            cc = CompileConfig()
            cc._compile_all_devices = True
            m.generation_config.compile_config = cc
        cache = StaticCache(config=m.config, max_cache_len=ids.shape[1] + n + 16)

        def gen(k: int) -> tuple[float, int]:
            cache.reset()
            return self.hf_generate(m, ids, k, past_key_values=cache)

        from torch._dynamo.utils import counters

        graphs_start = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        gen(n)  # compiles
        compile_s = time.perf_counter() - t0
        for _ in range(2):
            gen(n)
            gen(1)
        graphs_before = counters["stats"]["unique_graphs"]
        if graphs_before == graphs_start:
            raise RuntimeError("generate compiled nothing (transformers' auto-compile criteria not met): "
                               "the numbers would be an eager static cache")
        t_n, t_1 = [], []
        for _ in range(reps):
            dt, got = gen(n)
            self.check_len(got, n, "hf_static_compile")
            t_n.append(dt)
            dt, got = gen(1)
            self.check_len(got, 1, "hf_static_compile prefill")
            t_1.append(dt)
        new_graphs = counters["stats"]["unique_graphs"] - graphs_before
        if new_graphs:
            raise RuntimeError(f"invalid timing: {new_graphs} dynamo graph(s) compiled during the timed calls")
        tn, t1 = statistics.median(t_n), statistics.median(t_1)
        ms = (tn - t1) / (n - 1) * 1e3
        return {"decode_ms_per_token": round(ms, 3), "ms_per_token_incl_prefill": round(tn / n * 1e3, 3),
                "decode_tok_s": round(1e3 / ms, 1), "prefill_ms": round(t1 * 1e3, 3), "new_tokens": n,
                "timed_calls": reps, "first_call_s_incl_compile": round(compile_s, 1),
                "dynamo_graphs_compiled": graphs_before - graphs_start,
                "compile_config": {k: v for k, v in (m.generation_config.compile_config or CompileConfig()).to_dict()
                                   .items() if isinstance(v, (str, int, float, bool, type(None)))},
                "method": f"warm-up = timed = generate(n={n}); (T({n}) - T(1)) / {n - 1}, median of {reps}"}

    # ---- 6. our engine with the same standalone draft ------------------------------------------------------------
    def draft_part(self) -> None:
        from workers.config import SpeculativeConfig

        a = self.args
        draft = str(self.draft_ckpt())
        runs = {"specserve_no_spec": None,
                "specserve_draft": SpeculativeConfig(method="draft", model=draft, num_steps=a.spec_steps, topk=1,
                                                     adaptive=False),
                f"specserve_draft_sim{a.accept_length:g}": SpeculativeConfig(
                    method="draft", model=draft, num_steps=a.spec_steps, topk=1,
                    simulated_accept_length=a.accept_length, adaptive=False)}
        rows = self.results.setdefault("draft", {})
        for name, spec in runs.items():
            eng = self.engine(spec, max_num_seqs=8, cuda_graph_max_bs=8)
            self.decode_rate(eng, 1)  # warm-up
            r = self.decode_rate(eng, 1)
            rows[name] = {"decode_ms_per_token": r["ms_per_token_per_request"], "decode_tok_s": r["decode_tok_s"],
                          "ms_per_step": r["ms_per_step"], **({"accept_length": r["accept_length"]}
                                                              if "accept_length" in r else {})}
            if spec is not None:
                rows[name]["num_steps"] = a.spec_steps
                rows[name]["acceptance"] = ("simulated" if spec.simulated_accept_length else
                                            "real (random target and draft: about none)")
            del eng
            self.free()
            self.save()
            print(name, rows[name], flush=True)

    # ---- sampled decoding ----------------------------------------------------------------------------------------
    SAMPLING_SETTINGS = {"greedy": {}, "temperature": {"temperature": 0.8},
                      "top_p": {"temperature": 0.8, "top_p": 0.9},  # what an OpenAI client can ask for
                      "top_k_top_p": {"temperature": 0.8, "top_k": 50, "top_p": 0.9}}

    def sampling_part(self) -> None:
        """Decode throughput of one engine (no speculation) greedy, at a temperature only (one fused Gumbel race),
        with top-p, and with top-k + top-p (sort, filter floor, race), at each --batch-sizes size: what sampling
        costs."""
        eng = self.engine()
        self.decode_rate(eng, 1)  # warm-up
        table = self.results.setdefault("sampling", {})
        for bs in [int(x) for x in self.args.batch_sizes.split(",")]:
            for name, kw in self.SAMPLING_SETTINGS.items():
                self.decode_rate(eng, bs, **kw)  # warm-up: the kind's graphs are captured on first use
                table.setdefault(name, []).append(self.decode_rate(eng, bs, **kw))
                print("sampling", name, table[name][-1], flush=True)
                self.save()
        del eng
        self.free()

    # ---- 2-4. speculation ----------------------------------------------------------------------------------------
    def head(self) -> Path:
        from deployments.make_heads import make_head

        path = self.ckpt.parent / (self.ckpt.name + "-eagle3")
        if not (path / "config.json").is_file():
            make_head("eagle3", self.ckpt, path, seed=0, draft_vocab=min(32000, self.vocab))
        return path

    def spec_cfg(self, method: str, steps: int, accept: float):
        from workers.config import SpeculativeConfig

        return SpeculativeConfig(method=method, model=str(self.head()), num_steps=steps, topk=1,
                                 simulated_accept_length=accept, adaptive=False)  # (a fixed chain's cost)

    def speculation(self) -> None:
        a = self.args
        sizes = [int(x) for x in a.batch_sizes.split(",")]
        runs = {"no_spec": (None, {}),
                f"eagle3_chain{a.spec_steps}": (self.spec_cfg("eagle3", a.spec_steps, a.accept_length), {}),
                "naive_fused": (self.spec_cfg("naive", 1, a.naive_accept_length), {}),
                "naive_separate": (self.spec_cfg("naive", 1, a.naive_accept_length), {"fuse_speculative_round": False})}
        sweep = self.results.setdefault("throughput", {})
        for name, (spec, kw) in runs.items():
            eng = self.engine(spec, **kw)
            self.decode_rate(eng, 1)  # warm-up
            for bs in sizes if name in ("no_spec", f"eagle3_chain{a.spec_steps}") else [1, 64]:
                sweep.setdefault(name, []).append(self.best_rate(eng, bs, a.spec_repeats))
                print(name, sweep[name][-1], flush=True)
                self.save()
            del eng
            self.free()
        self.summarize()
        self.save()
        print(self.results["summary"], flush=True)

    def summarize(self) -> None:
        """Ratios from the measured rows (per-round comparisons use ms per step: the simulated accept lengths of two
        runs differ by chance, tokens per step with them)."""
        a, sweep = self.args, self.results["throughput"]
        by = {name: {r["batch_size"]: r for r in rows} for name, rows in sweep.items()}
        chain = next(name for name in sweep if name.startswith("eagle3_chain"))
        sizes = sorted(by["no_spec"])
        summary = {
            "accept_length_simulated": a.accept_length,
            f"{chain}_vs_no_spec_bs1": round(by[chain][1]["decode_tok_s"] / by["no_spec"][1]["decode_tok_s"], 3),
            f"{chain}_accept_length_measured_bs1": by[chain][1].get("accept_length"),
            # the round's cost apart from the simulation's luck: a round in no-spec decode steps, and the speedup a
            # round of exactly the simulated accept length would give (accept length / that cost)
            f"{chain}_round_in_decode_steps_bs1": round(by[chain][1]["ms_per_step"] / by["no_spec"][1]["ms_per_step"],
                                                        3),
            f"{chain}_vs_no_spec_bs1_at_simulated_accept_length": round(
                a.accept_length * by["no_spec"][1]["ms_per_step"] / by[chain][1]["ms_per_step"], 3),
            "naive_fused_over_separate_round_ms_bs1": round(by["naive_fused"][1]["ms_per_step"]
                                                            / by["naive_separate"][1]["ms_per_step"], 3),
            # what fusing the 1-step round could at best reach: a fused round costing no more than one no-spec
            # decode step (it still reads every target weight), over the separate round
            "naive_fused_over_separate_bound_bs1": round(by["no_spec"][1]["ms_per_step"]
                                                         / by["naive_separate"][1]["ms_per_step"], 3),
        }
        if 64 in by["no_spec"]:  # (--batch-sizes without 64: no no-spec row to compare with)
            summary["naive_fused_vs_no_spec_bs64"] = round(by["naive_fused"][64]["decode_tok_s"]
                                                           / by["no_spec"][64]["decode_tok_s"], 3)
        summary["spec_vs_no_spec_by_bs"] = {bs: round(by[chain][bs]["decode_tok_s"] / by["no_spec"][bs]["decode_tok_s"],
                                                      3) for bs in sizes if bs in by[chain]}
        self.results["summary"] = summary

    # ---- report --------------------------------------------------------------------------------------------------
    def bs1_rows(self) -> list[tuple[str, dict]]:
        """Every bs=1 measurement as (name, row): row has decode_ms_per_token or ms_per_token_incl_prefill, or
        error. Older JSONs kept HF numbers inside ``bs1`` (hf_*_ms / hf_*_error): read those too."""
        r, rows = self.results, []
        b = r.get("bs1", {})
        for k in ("graph_replay", "specserve_graphs", "specserve_graphs_no_overlap", "specserve_eager", "hf_eager",
                  "hf_static_compile"):
            if f"{k}_ms" in b:
                rows.append((k, {"decode_ms_per_token": b[f"{k}_ms"]}))
            elif f"{k}_error" in b and k not in r.get("hf", {}):
                rows.append((k, {"error": b[f"{k}_error"]}))
        rows += list(r.get("draft", {}).items()) + list(r.get("hf", {}).items())
        return rows

    def report(self) -> None:
        r = self.results
        lines = [f"# GPU performance, {r['shape']} shape, random {'bf16' if self.dev == 'cuda' else 'fp32'} weights",
                 "", f"device: {r['device']} · commit: {r['commit']} · command: `{r['command']}`", "",
                 f"prompt {r['prompt_len']} tokens, {r['new_tokens']} new tokens, "
                 + ("greedy unless a table says otherwise, " if "sampling" in r else "greedy, ")
                 + ("Triton attention." if self.dev == "cuda" else "torch-native attention.")]
        if r.get("note"):
            lines += ["", f"**{r['note']}**"]
        b = r.get("bs1", {})
        rows = self.bs1_rows()
        if rows:
            lines += ["", "## bs=1 decode", ""]
            if "floor_ms" in b:
                lines += [f"floor = {b['weight_bytes'] / 1e9:.2f} GB of weights ÷ {b['copy_bandwidth_gb_s']} GB/s "
                          f"copy bandwidth = {b['floor_ms']} ms", ""]
            if "draft_model" in r:
                lines += [f"standalone draft (specserve_draft*, hf_assisted_draft): random {r['draft_model']['shape']}"
                          f" shape, same vocabulary; decode ms/token excludes prefill, 'incl. prefill' spreads one "
                          f"prompt prefill over the new tokens", ""]
            lines += ["| system | decode ms/token | ms/token incl. prefill | × floor | accept length | note |",
                      "|---|---|---|---|---|---|"]
            for name, x in rows:
                if "error" in x:
                    err = x["error"][:160].replace("|", "/").replace("\n", " ")
                    lines.append(f"| {name} | failed: {err} | | | | |")
                    continue
                ms = x.get("decode_ms_per_token")
                vs = round(ms / b["floor_ms"], 3) if ms and "floor_ms" in b else ""
                note = x.get("acceptance") or x.get("note") or x.get("method") or ""
                lines.append(f"| {name} | {ms if ms is not None else ''} | {x.get('ms_per_token_incl_prefill', '')} "
                             f"| {vs} | {x.get('accept_length', '')} | {note} |")
        if "summary" in r:
            s = r["summary"]
            lines += ["", "## Speculation (simulated acceptance)", "", "| measure | value |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in s.items() if not isinstance(v, dict)]
            lines += ["", "| batch | " + " | ".join(r["throughput"]) + " |", "|---" * (len(r["throughput"]) + 1) + "|"]
            sizes = sorted({x["batch_size"] for rows in r["throughput"].values() for x in rows})
            for bs in sizes:
                cells = []
                for rows_ in r["throughput"].values():
                    hit = [x for x in rows_ if x["batch_size"] == bs]
                    cells.append(f"{hit[0]['decode_tok_s']} tok/s" if hit else "")
                lines.append(f"| {bs} | " + " | ".join(cells) + " |")
        if "sampling" in r:
            kinds = list(r["sampling"])
            settings = "; ".join(f"{k}: " + (", ".join(f"{a} {b}" for a, b in self.SAMPLING_SETTINGS[k].items())
                                              or "temperature 0") for k in kinds if k in self.SAMPLING_SETTINGS)
            lines += ["", f"## Sampled decoding (no speculation; {settings})", "",
                      "| batch | " + " | ".join(f"{k} tok/s" for k in kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
            for bs in sorted({x["batch_size"] for rows_ in r["sampling"].values() for x in rows_}):
                cells = [next((str(x["decode_tok_s"]) for x in r["sampling"][k] if x["batch_size"] == bs), "")
                         for k in kinds]
                lines.append(f"| {bs} | " + " | ".join(cells) + " |")
        write_markdown(self.out, lines)
        self.plot()

    def plot(self) -> None:
        plt = pyplot()
        r = self.results
        two = bool(r.get("throughput"))
        fig, axes = plt.subplots(1, 2 if two else 1, figsize=(11, 4) if two else (6.5, 4), squeeze=False)
        axes = axes[0]
        bars = [(name, x["decode_ms_per_token"]) for name, x in self.bs1_rows()
                if name != "graph_replay" and "decode_ms_per_token" in x]
        if bars:
            axes[0].bar([n for n, _ in bars], [v for _, v in bars],
                        color=["C1" if n.startswith("hf_") else "C0" for n, _ in bars])
            if "floor_ms" in r.get("bs1", {}):
                axes[0].axhline(r["bs1"]["floor_ms"], color="k", ls="--", label="bandwidth floor")
                axes[0].legend(fontsize=7)
            axes[0].set_ylabel("decode ms / token, bs=1 (orange: HF)")
            axes[0].set_yscale("log")
            axes[0].tick_params(axis="x", labelrotation=30, labelsize=6)
        for name, rows in r.get("throughput", {}).items():
            axes[1].plot([x["batch_size"] for x in rows], [x["decode_tok_s"] for x in rows], "o-", label=name)
        if two:
            axes[1].set_xscale("log", base=2)
            axes[1].set_xlabel("batch size")
            axes[1].set_ylabel("decode tokens/s")
            axes[1].legend(fontsize=7)
        fig.suptitle(f"{r['shape']} · {r['device']} · {r['commit']}", fontsize=8)
        fig.tight_layout()
        fig.savefig(self.out.with_suffix(".png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--ckpt", default=None, help="default: /tmp/<shape>-random (written if missing)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke test of the parts hf and draft (tiny shape), no result")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16,64,128,256")
    ap.add_argument("--spec-steps", type=int, default=3)
    ap.add_argument("--accept-length", type=float, default=3.0)
    ap.add_argument("--naive-accept-length", type=float, default=1.7)
    ap.add_argument("--spec-repeats", type=int, default=2, help="timed runs per speculation row, the fastest kept "
                    "(all runs' ms per step are in the JSON)")
    ap.add_argument("--parts", default="bs1,spec", help="comma list of bs1, spec, hf, draft, sampling (bs1 brings hf "
                    "unless --skip-hf)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--gc-freeze", action="store_true", help="freeze the start-up heap after building each engine "
                    "(deployments.engine.freeze_startup_heap, as the server does)")
    ap.add_argument("--draft-shape", default=None, help="standalone draft shape (default: DRAFT_SHAPES[shape])")
    ap.add_argument("--draft-ckpt", default=None, help="default: /tmp/<draft shape>-random (written if missing)")
    ap.add_argument("--hf-repeats", type=int, default=3, help="timed calls per length, static+compile (median)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    args = ap.parse_args()
    args.ckpt = args.ckpt or f"/tmp/{args.shape}-random"
    suite = Suite(args)
    if args.report_only:
        suite.results = json.loads(suite.out.with_suffix(".json").read_text())
        suite.dev = "cpu" if suite.results["device"].startswith("CPU") else "cuda"
        if "throughput" in suite.results:
            suite.summarize()
            suite.save()
        suite.report()
        return
    parts = args.parts.split(",")
    if "bs1" in parts and not args.skip_hf and "hf" not in parts:
        parts.append("hf")
    if args.skip_hf:
        parts = [p for p in parts if p != "hf"]
    unknown = set(parts) - {"bs1", "spec", "hf", "draft", "sampling"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    if args.spec_repeats < 1:
        ap.error("--spec-repeats must be at least 1")
    if args.device != "cuda" and {"bs1", "spec"} & set(parts):
        ap.error("parts bs1 and spec need CUDA (graphs, Triton, copy bandwidth); on cpu run --parts hf,draft,sampling")
    if not (suite.ckpt / "config.json").is_file():
        t0 = time.time()
        write_checkpoint(suite.ckpt, args.shape)
        print(f"checkpoint written in {time.time() - t0:.0f}s", flush=True)
    suite.vocab = json.loads((suite.ckpt / "config.json").read_text())["vocab_size"]
    try:
        if "bs1" in parts:
            suite.bs1_floor()
        if "draft" in parts:
            suite.draft_part()
        if "hf" in parts:
            suite.hf_part()
        if "spec" in parts:
            suite.speculation()
        if "sampling" in parts:
            suite.sampling_part()
    finally:
        suite.save()
        suite.report()


if __name__ == "__main__":
    main()
