"""Adaptive speculation (issue #41) vs no speculation and vs every fixed draft depth, in one run per model shape.

Random-weight Llama shapes with a random EAGLE-3-shaped head (a chain of ``--steps``): random weights accept nothing,
so rounds use ``simulated_accept_length`` (benchmark-only: the drafts, verify, acceptance and KV work are real, the
emitted tokens are the drafts), set on the device between runs. Per shape:

1. no speculation (its own engine), decode tok/s per batch size;
2. one speculative engine (adaptive on): its start-up cost model (ms per step by batch bucket and depth), then per
   simulated accept length and batch size: the adaptive chooser (fresh per accept length, warmed by one untimed
   run), and each fixed depth 0..steps (``DepthSchedule``; depth 0 = plain decode steps, the draft catching up lazily);
   each timed batch follows an untimed one of ``--warm-rounds`` new tokens at the same accept length and batch size
   on the same engine and policy, so a row is the chooser's steady state under that load (as in a loaded server),
   with every kernel shape it meets compiled;
3. a run whose acceptance changes halfway (``--change``, default 3.0 then 1.2): the chosen depth and tok/s per step.

``--shapes`` may also name ``family``: the shipped trained tiny family (models/specserve-tiny and its EAGLE-3 head)
at its real acceptance on held-out Python source prompts (no simulation, no change run). ``--merge`` adds the shapes
run now to an existing result (one device call per shape when one call cannot hold them all).

Decode tok/s counts the tokens after every request has its first token (prefill excluded), as bench.gpu_perf does.

    python3 -m bench.adaptive --out bench/results/adaptive/adaptive_h100            # 8B and 1B shapes, one H100
    python3 -m bench.adaptive --cpu --out bench/results/adaptive/cpu_smoke          # tiny shape on the CPU
    python3 -m bench.adaptive --shapes family --merge --out bench/results/adaptive/adaptive_h100
    python3 -m bench.adaptive --report-only --out bench/results/adaptive/adaptive_h100
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from bench.common import (ROOT, SHAPES, command, commit, device_name, held_out_prompts, out_path, pyplot,
                          write_checkpoint, write_json, write_markdown)

FAMILY = "family"  # the shipped trained tiny family, at its real acceptance


def median_row(rows: list[dict]) -> dict:
    """The timed batch of median tok/s among repeats (the others' tok/s listed beside it)."""
    rows = sorted(rows, key=lambda r: r["decode_tok_s"])
    row = rows[len(rows) // 2]
    if len(rows) > 1:
        row["decode_tok_s_runs"] = [r["decode_tok_s"] for r in rows]
    return row


class Bench:
    def __init__(self, args):
        self.args = args
        self.cuda = not args.cpu
        self.out = out_path(args.out)
        self._text_prompts: list[list[int]] = []
        self.results = {"device": device_name("cuda" if self.cuda else "cpu"), "commit": commit(),
                        "command": command(), "steps": args.steps, "prompt_len": args.prompt_len,
                        "new_tokens": args.new_tokens, "batch_sizes": self.sizes,
                        "accept_lengths": self.accept_lengths, "change": args.change,
                        "warm_rounds": args.warm_rounds, "gc_threshold": None if args.default_gc else "engine core's",
                        "shapes": {}}
        if not self.cuda:
            self.results["note"] = "CPU smoke run (tiny shape, eager rounds, eager cost model): not a performance result"

    @property
    def sizes(self) -> list[int]:
        return [int(x) for x in self.args.batch_sizes.split(",")]

    @property
    def accept_lengths(self) -> list[float]:
        return [float(x) for x in self.args.accept_lengths.split(",")]

    def save(self) -> None:  # after every measurement: a run cut short keeps what it measured
        write_json(self.out, self.results)

    def free(self) -> None:
        gc.unfreeze()  # (the engine's start-up heap, frozen in ``engine``, is collectable again)
        gc.collect()  # graphs and their closures form cycles with the worker
        if self.cuda:
            torch.cuda.empty_cache()

    # ---- engines -------------------------------------------------------------------------------------------------
    def checkpoint(self, shape: str) -> tuple[Path, Path]:
        from deployments.make_heads import make_head

        if shape == FAMILY:
            return ROOT / "models" / "specserve-tiny", ROOT / "models" / "specserve-tiny-eagle3"

        ckpt = Path(self.args.ckpt_dir) / f"{shape}-random"
        if not (ckpt / "config.json").is_file():
            t0 = time.time()
            write_checkpoint(ckpt, shape)
            print(f"{ckpt} written in {time.time() - t0:.0f}s", flush=True)
        head = Path(self.args.ckpt_dir) / f"{shape}-random-eagle3"
        if not (head / "config.json").is_file():
            make_head("eagle3", ckpt, head, seed=0, draft_vocab=min(32000, SHAPES[shape]["vocab_size"]))
        return ckpt, head

    def engine(self, ckpt: Path, spec=None, **overrides):
        from deployments.engine.engine import Engine
        from workers.config import EngineConfig

        max_bs = max(self.sizes)
        if self.cuda:
            kw = {"max_model_len": 4096, "max_num_seqs": max_bs, "cuda_graph_max_bs": max_bs,
                  "gpu_memory_utilization": 0.8, "prefill_attention_backend": "triton",
                  "decode_attention_backend": "triton", "dtype": "bfloat16"}
        else:
            kw = {"max_model_len": 1024, "max_num_seqs": max_bs, "kv_cache_tokens": 16384, "dtype": "float32"}
        if self.args.tuning_cache_dir is not None:
            kw["tuning_cache_dir"] = self.args.tuning_cache_dir
        kw.update(overrides)
        t0 = time.time()
        eng = Engine(EngineConfig(model=str(ckpt), device="cuda" if self.cuda else "cpu", speculative_config=spec,
                                  **kw))
        print(f"engine ({'spec' if spec else 'no spec'}) ready in {time.time() - t0:.0f}s", flush=True)
        # as a server's engine core does once it is up (``freeze_startup_heap``): a full collection would otherwise
        # scan the start-up heap (torch, the model, the graphs): a long pause inside a timed batch; and its
        # collector's threshold (``tune_gc_for_steps``), unless --default-gc
        gc.collect()
        gc.freeze()
        if not self.args.default_gc:
            from deployments.engine import tune_gc_for_steps

            tune_gc_for_steps()
        return eng

    def prompt(self, seed: int, vocab: int) -> list[int]:
        if self._text_prompts:  # the family: real text, where its acceptance means something
            return self._text_prompts[seed % len(self._text_prompts)]
        g = torch.Generator().manual_seed(seed)
        return torch.randint(10, min(100000, vocab - 10), (self.args.prompt_len,), generator=g).tolist()

    # ---- one timed run -------------------------------------------------------------------------------------------
    def decode_rate(self, eng, bs: int, new_tokens: int | None = None) -> dict:
        """Decode tokens/s of ``bs`` concurrent greedy requests, from when the last request got its first token to
        when the last token came back, and the steps by depth in that time; with ``--repeats`` n, n batches back to
        back, the one of median tok/s kept (the others' tok/s listed)."""
        repeats = max(1, self.args.repeats) if new_tokens is None else 1
        return median_row([self._decode_rate(eng, bs, new_tokens) for _ in range(repeats)])

    def _decode_rate(self, eng, bs: int, new_tokens: int | None = None) -> dict:
        from deployments.engine.request import SamplingParams
        from bench.common import GCTimer

        gc.collect()  # (untimed: the collector's generations start empty)
        vocab = eng.executor.model_config.vocab_size
        for i in range(bs):
            # (a fixed seed per request: the simulated acceptance's draws are the same for every policy's row)
            params = SamplingParams(max_tokens=new_tokens or self.args.new_tokens, temperature=0.0, ignore_eos=True,
                                    seed=bs * 1000 + i)
            eng.add_request(self.prompt(bs * 1000 + i, vocab), params)
        started, start, end, tokens, steps, by_depth = set(), None, None, 0, 0, None
        step_ms, last = [], None  # each decode step's time and the depth it launched (one-off costs show here)
        gct = GCTimer()  # collections inside the timed steps (a full one is a pause of its own)
        with gct:
            while eng.has_work():
                outs = eng.step()
                now = time.perf_counter()
                if start is None:
                    started.update(o.rid for o in outs if o.new_token_ids)
                    if len(started) == bs:
                        start, by_depth, last = now, dict(eng.steps_by_depth), now
                        paused_before = eng.paused_steps
                        gct.reset()
                    continue
                new = sum(len(o.new_token_ids) for o in outs)
                if new:
                    tokens, steps, end = tokens + new, steps + 1, now
                    step_ms.append((round((now - last) * 1e3, 3), getattr(eng.depth_policy, "last_depth", None)))
                    last = now
        if not tokens:
            raise ValueError("no decode steps after the last first token: raise --new-tokens")
        depths = {str(d): n - (by_depth or {}).get(d, 0) for d, n in sorted(eng.steps_by_depth.items())
                  if n - (by_depth or {}).get(d, 0)}
        row = {"batch_size": bs, "decode_tok_s": round(tokens / (end - start), 1),
               "ms_per_step": round((end - start) / steps * 1e3, 3), "decode_steps": steps,
               "tokens_per_step_per_request": round(tokens / steps / bs, 3)}
        if depths:
            row["steps_by_depth"] = depths
        if start is not None and eng.paused_steps > paused_before:  # (plain steps with the draft paused)
            row["paused_steps"] = eng.paused_steps - paused_before
        times = sorted(ms for ms, _ in step_ms)
        row["median_step_ms"] = times[len(times) // 2]
        # the slowest steps: (index after the last first token, ms, depth launched then)
        row["slowest_steps"] = sorted(((i, ms, d) for i, (ms, d) in enumerate(step_ms)), key=lambda x: -x[1])[:4]
        row["gc"] = {"collections": gct.count, "ms": round(sum(gct.seconds) * 1e3, 2)}
        stats = eng.depth_policy.stats() if eng.depth_policy is not None else {}
        if stats.get("host_ms"):  # the chooser's host medians and the step costs it chose from, at this point
            row["chooser"] = {k: stats[k] for k in ("host_ms", "step_cost_ms", "host_ms_per_request_depth",
                                                    "rate_check", "checking") if k in stats}
        return row

    # ---- the suite -----------------------------------------------------------------------------------------------
    def shape(self, shape: str) -> None:
        from speculative.adaptive import DepthChooser, DepthSchedule
        from workers.config import SpeculativeConfig

        a = self.args
        res = self.results["shapes"].setdefault(shape, {})
        res["stamp"] = {"device": self.results["device"], "commit": self.results["commit"],
                        "command": self.results["command"]}
        ckpt, head = self.checkpoint(shape)
        family = shape == FAMILY
        self._text_prompts = []
        if family:
            from transformers import AutoTokenizer

            self._text_prompts = held_out_prompts(AutoTokenizer.from_pretrained(str(ckpt)), 64, a.prompt_len)
        if "no_spec" not in res:
            eng = self.engine(ckpt)
            self.decode_rate(eng, 1, 8)  # warm-up
            res["no_spec"] = {}
            for bs in self.sizes:
                res["no_spec"][str(bs)] = self.decode_rate(eng, bs)
                print(shape, "no_spec", res["no_spec"][str(bs)], flush=True)
                self.save()
            del eng
            self.free()
        window = {} if a.catch_up_window is None else {"catch_up_window": a.catch_up_window}
        spec = SpeculativeConfig(method="eagle3", model=str(head), num_steps=a.steps, topk=1, adaptive=True,
                                 simulated_accept_length=None if family else self.accept_lengths[0], **window)
        eng = self.engine(ckpt, spec)
        costs, per_token = eng.executor.depth_costs, eng.executor.context_costs
        res["cost_ms"] = {str(b): {str(d): round(ms, 4) for d, ms in row.items()} for b, row in costs.items()}
        res["cost_ms_per_1k_context"] = {str(b): {str(d): round(1e3 * ms, 4) for d, ms in row.items()}
                                         for b, row in (per_token or {}).items()}
        rnd = eng.executor.worker.spec_round
        # (``adaptive_no_context``: the chooser without the context's table, an A/B of it in the same run)
        policies = ["adaptive"] + ["adaptive_no_context"] * a.ab_context + [f"depth{d}" for d in range(a.steps + 1)]
        if a.policies:  # (their order: the first runs on the freshest engine)
            policies = a.policies.split(",")
        for length in [None] if family else self.accept_lengths:
            if length is not None:
                rnd.set_simulated_accept_length(length)
            runs = res.setdefault("spec", {}).setdefault("real" if length is None else f"{length:g}", {})
            made = {}
            for name in policies:
                if name.startswith("adaptive"):
                    made[name] = eng.depth_policy = DepthChooser(
                        costs, a.steps, context_costs=per_token if name == "adaptive" else None)
                    self.decode_rate(eng, min(16, max(self.sizes)), 16)  # untimed: the chooser learns acceptance
                else:
                    made[name] = DepthSchedule([int(name.removeprefix("depth"))])
            for bs in self.sizes:
                # every policy in turn in each repeat (policy by policy, the first ran on an engine still warming
                # up, its steps up to 2x longer on the shipped family, whose steps are the host's alone)
                timed: dict[str, list] = {}
                for rep in range(max(1, a.repeats)):
                    for name in policies:
                        eng.depth_policy = made[name]
                        if a.warm_rounds and not rep:  # untimed: the same load first (the chooser's steady state)
                            self.decode_rate(eng, bs, a.warm_rounds)
                        timed.setdefault(name, []).append(self._decode_rate(eng, bs))
                for name, rows in timed.items():
                    row = runs.setdefault(name, {})[str(bs)] = median_row(rows)
                    print(shape, f"L={length}", name, row, flush=True)
                self.save()
        if not family:
            res["change"] = self.change_run(eng, DepthChooser(costs, a.steps, context_costs=per_token))
            self.save()
        del eng, rnd
        self.free()

    def change_run(self, eng, chooser) -> dict:
        """``--change-bs`` requests decoding ``--change-steps`` steps; the simulated accept length is the first of
        ``--change`` until half of them, then the second. Per decode step: the chosen depth and its tok/s."""
        from deployments.engine.request import SamplingParams

        a = self.args
        first, second = (float(x) for x in a.change.split(","))
        rnd = eng.executor.worker.spec_round
        rnd.set_simulated_accept_length(first)
        eng.depth_policy = chooser
        vocab = eng.executor.model_config.vocab_size
        params = SamplingParams(max_tokens=a.change_steps * (a.steps + 1) + 8, temperature=0.0, ignore_eos=True)
        reqs = [eng.add_request(self.prompt(7_000_000 + i, vocab), params) for i in range(a.change_bs)]
        started, timeline, changed_at, last = set(), [], None, None
        while eng.has_work() and len(timeline) < a.change_steps:
            if changed_at is None and len(timeline) >= a.change_steps // 2:
                rnd.set_simulated_accept_length(second)
                changed_at = len(timeline)
            outs = eng.step()
            now = time.perf_counter()
            if len(started) < a.change_bs:
                started.update(o.rid for o in outs if o.new_token_ids)
                last = now
                continue
            new = sum(len(o.new_token_ids) for o in outs)
            # (the depth of the step launched now; its tokens come back with the next call under overlap)
            timeline.append({"depth": chooser.last_depth, "tokens": new, "s": round(now - last, 6),
                             "accept_length": second if changed_at is not None else first})
            last = now
        for req in reqs:  # the rest of the requests is not needed
            eng.abort(req.rid)
        while eng.has_work():
            eng.step()
        after = [t["depth"] for t in timeline[changed_at:]]
        settled = max(set(after[len(after) // 2:]), key=after[len(after) // 2:].count) if after else None
        readapt = next((i for i, d in enumerate(after) if d == settled), None)
        return {"batch_size": a.change_bs, "accept_lengths": [first, second], "changed_at_step": changed_at,
                "settled_depth_after": settled, "steps_to_settled_depth": readapt, "timeline": timeline}

    def run(self) -> None:
        for shape in self.args.shapes.split(","):
            self.shape(shape)
        self.report()

    # ---- report --------------------------------------------------------------------------------------------------
    def summary(self, res: dict) -> dict:
        """Per accept length and batch size: adaptive vs no-spec and vs the best fixed depth; the worst of each."""
        out = {}
        for length, runs in res.get("spec", {}).items():
            for bs, row in runs.get("adaptive", {}).items():
                base = res["no_spec"][bs]["decode_tok_s"]
                fixed = {n: r[bs]["decode_tok_s"] for n, r in runs.items() if n.startswith("depth") and bs in r}
                best = max(fixed, key=fixed.get) if fixed else None
                out.setdefault(length, {})[bs] = {
                    "vs_no_spec": round(row["decode_tok_s"] / base, 3),
                    "vs_best_fixed": round(row["decode_tok_s"] / fixed[best], 3) if best else None,
                    "best_fixed": best}
        points = [p for per in out.values() for p in per.values()]
        worst = {"min_vs_no_spec": min((p["vs_no_spec"] for p in points), default=None),
                 "min_vs_best_fixed": min((p["vs_best_fixed"] for p in points if p["vs_best_fixed"]), default=None)}
        return {"points": out, **worst}

    def report(self) -> None:
        r, lines = self.results, []
        lines += ["# Adaptive speculation vs no speculation and every fixed depth", "",
                  f"Device: {r['device']}; commit {r['commit']}; `{r['command']}`", "",
                  f"EAGLE-3-shaped random head, chain of {r['steps']}, simulated accept lengths "
                  f"{', '.join(f'{x:g}' for x in r['accept_lengths'])}; {r['prompt_len']}-token prompts, "
                  f"{r['new_tokens']} new tokens, greedy; decode tok/s after every request's first token. "
                  "`depth0` = plain decode steps (the draft catches up on them before a round, or when its stash of "
                  "plain steps is full); cost table: `catch-up L` = the draft's catch-up over L plain steps per request.",
                  ""]
        if r.get("warm_rounds"):
            lines += [f"At each batch size the policies take turns in every repeat, each first after an untimed batch "
                      f"of {r['warm_rounds']} new tokens at the same accept "
                      "length and batch size on the same engine and policy: the adaptive rows are the chooser's steady "
                      "state under that load (a loaded server), not its start. The change run below starts from the "
                      "first acceptance's steady state and shows re-adaptation.", ""]
        if r.get("note"):
            lines += [f"**{r['note']}**", ""]
        for shape, res in r["shapes"].items():
            s = self.summary(res)
            res["summary"] = {k: v for k, v in s.items()}
            lines += [f"## {shape}", "",
                      f"Worst adaptive / no-spec: **{s['min_vs_no_spec']}x**; worst adaptive / best fixed depth: "
                      f"**{s['min_vs_best_fixed']}x**.", ""]
            sizes = list(res.get("no_spec", {}))
            for length, runs in res.get("spec", {}).items():
                title = "real acceptance (held-out text)" if length == "real" else f"simulated accept length {length}"
                lines += [f"### {title}", "",
                          "| run | " + " | ".join(f"bs {b}" for b in sizes) + " |",
                          "|---|" + "---|" * len(sizes)]
                lines.append("| no spec (tok/s) | " + " | ".join(f"{res['no_spec'][b]['decode_tok_s']:.0f}"
                                                             for b in sizes) + " |")
                for name, rows in runs.items():
                    cells = []
                    for b in sizes:
                        if b not in rows:
                            cells.append("")
                            continue
                        ratio = rows[b]["decode_tok_s"] / res["no_spec"][b]["decode_tok_s"]
                        cell = f"{ratio:.2f}x"
                        if name == "adaptive":
                            depths = rows[b].get("steps_by_depth", {})
                            cell = f"**{cell}** ({', '.join(f'd{d}:{n}' for d, n in depths.items())})"
                        cells.append(cell)
                    lines.append(f"| {name} | " + " | ".join(cells) + " |")
                pts = s["points"].get(length, {})
                lines.append("| adaptive / best fixed | " + " | ".join(
                    f"{pts[b]['vs_best_fixed']}x ({pts[b]['best_fixed']})" if b in pts else "" for b in sizes) + " |")
                lines.append("")
                # (a one-off cost, a compile or an allocation, is one slow step; a host cost is in all of them)
                spread = [f"{name} bs {b}: {row['median_step_ms']} / {row['slowest_steps'][0][1]} "
                          f"(d{row['slowest_steps'][0][2]})"
                          for name, rows in runs.items() for b, row in rows.items() if row.get("slowest_steps")]
                if spread:
                    lines += ["Step ms, median / slowest (the depth it launched): " + "; ".join(spread) + ".", ""]
                paused = [f"{name} bs {b}: {row['gc']['ms']} ms ({'/'.join(map(str, row['gc']['collections']))})"
                          for name, rows in [("no spec", res["no_spec"]), *runs.items()] for b, row in rows.items()
                          if row.get("gc", {}).get("ms", 0) >= 1]
                hosts = [f"bs {b}: " + ", ".join(f"d{d} {ms}" for d, ms in row["chooser"]["host_ms"].get(
                    str(b), next(iter(row["chooser"]["host_ms"].values()))).items())
                         for b, row in runs.get("adaptive", {}).items() if row.get("chooser")]
                if hosts:
                    lines += ["The adaptive chooser's host ms per step by depth after the timed batch (medians of "
                              "launch intervals less the waits for the device; the table's bucket): "
                              + "; ".join(hosts) + ".", ""]
                if paused:
                    lines += ["Garbage collections inside the timed steps, 1 ms or more (collections by generation): "
                              + "; ".join(paused) + ".", ""]
            if "cost_ms" in res:
                # (depths first, then catch-ups; buckets ascending, whatever order the JSON kept)
                depths = sorted(next(iter(res["cost_ms"].values())), key=lambda d: (int(d) < 0, abs(int(d))))
                shown = sorted((b for b in res["cost_ms"] if b in sizes), key=int) or sorted(res["cost_ms"], key=int)
                lines += ["### start-up cost model (ms per step, padding rows)", "",
                          "| bucket | " + " | ".join(f"depth {d}" if int(d) >= 0 else f"catch-up {-int(d)}" for d in depths)
                          + " |", "|---|" + "---|" * len(depths)]
                lines += [f"| {b} | " + " | ".join(f"{res['cost_ms'][b][d]:.3f}" for d in depths) + " |" for b in shown]
                lines.append("")
            per_k = res.get("cost_ms_per_1k_context")
            if per_k and any(per_k.values()):
                tiers = sorted(next(r for r in per_k.values() if r), key=int)
                lines += ["### start-up cost model: ms a step grows by per 1,000 tokens of the batch's context", "",
                          "| bucket | " + " | ".join(f"depth {d}" for d in tiers) + " |", "|---|" + "---|" * len(tiers)]
                lines += [f"| {b} | " + " | ".join(f"{per_k[b].get(d, 0.0):.4f}" for d in tiers) + " |"
                          for b in sorted(per_k, key=int) if per_k[b]]
                lines.append("")
            ch = res.get("change")
            if ch:
                lines += [f"### acceptance {ch['accept_lengths'][0]:g} then {ch['accept_lengths'][1]:g} at step "
                          f"{ch['changed_at_step']} (bs {ch['batch_size']})", "",
                          f"Settled depth after the change: {ch['settled_depth_after']}, reached "
                          f"{ch['steps_to_settled_depth']} steps after it (the chooser reads a round's verdicts one "
                          "step late under the overlap schedule).", ""]
        write_markdown(self.out, lines)
        self.save()
        self.plot()

    def plot(self) -> None:
        try:
            plt = pyplot()
        except ImportError:
            return
        shapes = self.results["shapes"]
        lengths = [f"{x:g}" for x in self.results["accept_lengths"]]
        if any(FAMILY == s for s in shapes):
            lengths = lengths + ["real"]
        fig, axes = plt.subplots(len(shapes), len(lengths) + 1, figsize=(4.2 * (len(lengths) + 1), 3.6 * len(shapes)),
                                 squeeze=False)
        for row, (shape, res) in zip(axes, shapes.items()):
            sizes = list(res.get("no_spec", {}))
            for ax, length in zip(row, lengths):
                if length not in res.get("spec", {}):
                    ax.axis("off")
                    continue
                for name, rows in res.get("spec", {}).get(length, {}).items():
                    ys = [rows[b]["decode_tok_s"] / res["no_spec"][b]["decode_tok_s"] for b in sizes if b in rows]
                    ax.plot(range(len(ys)), ys, marker="o", lw=2.5 if name == "adaptive" else 1,
                            color="black" if name == "adaptive" else None, label=name)
                ax.axhline(1.0, color="grey", ls=":")
                ax.set_xticks(range(len(sizes)), sizes)
                ax.set_xlabel("batch size")
                ax.set_ylabel("decode tok/s vs no spec")
                ax.set_title(f"{shape}, accept length {length}", fontsize=9)
                ax.legend(fontsize=7)
            ax = row[-1]
            ch = res.get("change")
            if not ch:
                ax.axis("off")
            if ch and ch["timeline"]:
                tl = ch["timeline"]
                steps = range(len(tl))
                ax.step(steps, [t["depth"] if t["depth"] is not None else 0 for t in tl], where="post",
                        color="tab:blue", label="depth")
                ax.set_ylabel("chosen depth", color="tab:blue")
                ax.set_xlabel("decode step")
                ax2 = ax.twinx()
                win = 8
                rate = []
                for i in range(len(tl)):
                    w = tl[max(0, i - win + 1):i + 1]
                    rate.append(sum(t["tokens"] for t in w) / max(sum(t["s"] for t in w), 1e-9))
                ax2.plot(steps, rate, color="tab:orange", lw=1)
                ax2.set_ylabel(f"tok/s ({win}-step window)", color="tab:orange")
                ax.axvline(ch["changed_at_step"], color="grey", ls=":")
                ax.set_title(f"{shape}: accept {ch['accept_lengths'][0]:g} then {ch['accept_lengths'][1]:g}, "
                             f"bs {ch['batch_size']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(self.out.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shape on the CPU (a smoke run of the code paths)")
    ap.add_argument("--shapes", default=None, help="comma list (default llama-3.1-8b,llama-3.2-1b; --cpu "
                    "llama-smoke)")
    ap.add_argument("--ckpt-dir", default="/tmp", help="random checkpoints <dir>/<shape>-random (written if missing)")
    ap.add_argument("--steps", type=int, default=3, help="the chain's depth (num_steps)")
    ap.add_argument("--accept-lengths", default="1.5,2,3")
    ap.add_argument("--batch-sizes", default=None, help="default 1,16,64,128,256 (--cpu: 1,2,4,8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (--cpu: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 32 (--cpu: 10)")
    ap.add_argument("--warm-rounds", type=int, default=16, help="new tokens of the untimed batch before each timed "
                    "one, at the same accept length, batch size and policy (0: none)")
    ap.add_argument("--catch-up-window", type=int, default=None, help="speculative_config.catch_up_window (default: "
                    "the config's)")
    ap.add_argument("--repeats", type=int, default=1, help="timed batches per point, every policy in turn at a "
                    "batch size; the one of median tok/s is kept (a host-bound step passes the host's run-to-run "
                    "noise straight on)")
    ap.add_argument("--change", default="3.0,1.2", help="accept length before and after the change")
    ap.add_argument("--change-bs", type=int, default=None, help="default 64 (--cpu: 4)")
    ap.add_argument("--change-steps", type=int, default=None, help="decode steps of the change run (default 120, "
                    "--cpu 60)")
    ap.add_argument("--default-gc", action="store_true", help="keep the interpreter's collector thresholds (not "
                    "the engine core's, deployments.engine.tune_gc_for_steps)")
    ap.add_argument("--tuning-cache-dir", default=None, help="EngineConfig.tuning_cache_dir (default: the engine's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", default=None, help="comma list in the order to run (default: adaptive, then "
                    "depth0..steps; adaptive_no_context: the chooser without the context's table)")
    ap.add_argument("--ab-context", action="store_true",
                    help="also time the chooser without the context's cost table (adaptive_no_context)")
    ap.add_argument("--report-only", action="store_true", help="re-render <out>.md/.png from <out>.json")
    ap.add_argument("--merge", action="store_true", help="add to <out>.json's shapes (the top stamp is this run's, "
                    "each shape keeps its own)")
    args = ap.parse_args()
    cpu = args.cpu
    defaults = {"shapes": "llama-smoke" if cpu else "llama-3.1-8b,llama-3.2-1b",
                "batch_sizes": "1,2,4,8" if cpu else "1,16,64,128,256", "prompt_len": 16 if cpu else 128,
                "new_tokens": 10 if cpu else 32, "change_bs": 4 if cpu else 64, "change_steps": 60 if cpu else 120}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    bench = Bench(args)
    if args.report_only:
        bench.results = json.loads(bench.out.with_suffix(".json").read_text())
        bench.report()
        return
    if args.merge and bench.out.with_suffix(".json").is_file():
        bench.results["shapes"] = json.loads(bench.out.with_suffix(".json").read_text())["shapes"]
    bench.run()


if __name__ == "__main__":
    main()
