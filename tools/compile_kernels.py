"""Compile every Triton kernel launch of a CPU run for an H100 (sm_90), here, without a GPU.

Triton's interpreter runs a kernel's body as Python over NumPy: it checks what a kernel computes, but not what only
the compiler rejects (a loop-carried variable that changes type, a shape the layout pass refuses, a register or
shared-memory budget), and those would otherwise first show on a scarce GPU. This tool runs a workload under the
interpreter, records each launch (kernel, argument types, constexpr values, num_warps / num_stages), then compiles
each distinct one through Triton's own compiler and ptxas for ``--arch`` (PDL on where a kernel has it, as in the
CUDA graphs; aligned pointers and integers divisible by 16 specialized as the GPU's launches specialize them), and
reports each one's registers and stack bytes per thread (``cuobjdump -res-usage``; a STACK line lists the launches
that spill). Those are what this machine's Triton makes of the kernels: another Triton version
(the GPU machine's) allocates registers differently, so a spill here is a lead to check there, not a verdict.

    python3 -m tools.compile_kernels                     # the default workloads, report on stdout
    python3 -m tools.compile_kernels --json out.json

Workloads: the interpreter checks of every kernel family (``tests/kernels/test_*.py``: norms, RoPE, KV store,
sampling, metadata, verdict, small-M linears, all-reduce) and ``tests/gpu/check_attention.py --small`` (the split-KV
attention in every forward mode), run; then the launches of
the models' own shapes, recorded without running (``model_shapes``: the interpreter would take hours), since a
constexpr combination only those reach (an H100's split count, a head size of 128) is what the small checks miss.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (module run as ``__main__``, its arguments): each kernel family's interpreter check, then the attention check
WORKLOADS = (
    *((f"tests.kernels.test_{family}", []) for family in ("norm_rope", "rng", "argmax", "top_filter", "metadata",
                                                         "verdict", "small_m_linear", "all_reduce",
                                                         "sparse_mla")),
    ("tests.gpu.check_attention", ["--device", "cpu", "--dtype", "bfloat16", "--small", "--min-chunk", "64"]),
    ("tests.gpu.check_attention", ["--device", "cpu", "--dtype", "float32", "--small", "--min-chunk", "64"]),
)
KERNEL_MODULES = ("workers.kernels.launch", "workers.kernels.norm_rope", "workers.kernels.rng",
                  "workers.kernels.argmax", "workers.kernels.top_filter", "workers.kernels.metadata",
                  "workers.kernels.verdict", "workers.kernels.small_m_linear", "workers.kernels.all_reduce",
                  "workers.kernels.sparse_mla", "attention.triton_backend")  # every kernel is here
LAUNCH_OPTIONS = ("num_warps", "num_stages")
# constexprs a launch takes from ``_INTERPRETER`` (the indexer's ROUND: e4m3 rounding in arithmetic, and no inline
# assembly), compiled at the GPU's value: the recorded launches ran under the interpreter
DEVICE_CONSTEXPRS = {"ROUND": False}
# ``model_shapes`` runs these modules' kernels only as launches (their outputs feed nothing there); the rest (the
# forward batch's metadata kernels) run
LAUNCH_ONLY_MODULES = ("attention.triton_backend", "workers.kernels.small_m_linear", "workers.kernels.sparse_mla")


def describe(value):
    """A launch argument as the compiler sees it: a tensor by its element type and whether its address is 16-byte
    aligned, scalars by value."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"value": repr(value)}


def model_shapes() -> None:
    """Launch (the recorder does not run them) the attention and small-M linear kernels at the Llama-3.1-8B and
    Llama-3.2-1B shapes as an H100 engine would: decode at batch 1 / 8 / 64, chain and tree verify, a round's
    draft-extend, a ragged prefill; every small-M tile candidate at 1 / 2 / 4 / 16 rows, plain, gated and
    activated (and at 1 and 4 rows of one shape, normalising the input and adding to the output)."""
    import torch

    from attention.base import AttentionLayerSpec
    from attention.triton_backend import TritonBackend
    from workers.forward_batch import ForwardBatch
    from workers.kernels import small_m_linear as sml
    from workers.kv_cache import KVCache, PageTable
    from workers.messages import ForwardMode

    page, capacity = 16, 8192
    for heads, kv_heads, dim in ((32, 8, 128), (32, 8, 64)):
        layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim ** -0.5)
        kv = KVCache(1, 8, page, kv_heads, dim, torch.bfloat16, "cpu")
        for mode, batch, new, tree in ((ForwardMode.DECODE, 1, 1, False), (ForwardMode.DECODE, 8, 1, False),
                                       (ForwardMode.DECODE, 64, 1, False), (ForwardMode.TARGET_VERIFY, 1, 4, False),
                                       (ForwardMode.TARGET_VERIFY, 4, 8, True), (ForwardMode.DRAFT_EXTEND, 1, 3, False),
                                       (ForwardMode.EXTEND, 2, 0, False)):
            extend = [new] * batch if new else [300, 17][:batch]
            table = PageTable(batch, capacity // page, page, "cpu")
            seq = [1000 + e for e in extend]
            mask = torch.ones(batch, new, new, dtype=torch.bool).tril() if tree else None
            fb = ForwardBatch.build(mode, torch.zeros(sum(extend), dtype=torch.int64), list(range(batch)), seq,
                                    extend, kv, table, tree_mask=mask)
            backend = TritonBackend()
            backend._num_sms = 132  # an H100's split counts
            backend.init_forward_metadata(fb)
            backend.forward(torch.empty(sum(extend), heads, dim, dtype=torch.bfloat16), None, None, layer, fb)
    for n, k in ((6144, 4096), (4096, 4096), (3072, 2048)):
        weight = torch.empty(n, k, dtype=torch.bfloat16)
        for rows in (1, 2, 4, 16):
            for cfg in filter(None, sml.candidates(rows)):
                x = torch.empty(rows, k, dtype=torch.bfloat16)
                sml.small_m_linear(x, weight, None, cfg)
                if (n, k) == (6144, 4096) and rows in (1, 4):  # the norm in q/k/v or gate/up, the add in o or down
                    add = torch.empty(rows, n, dtype=torch.bfloat16)
                    sml.small_m_linear(x, weight, None, cfg, norm_eps=1e-5)
                    sml.small_m_linear(x, weight, None, cfg, add=add)
                    if cfg.weight_left:
                        sml.small_m_linear(x, weight, None, cfg, activated=True, norm_eps=1e-5)
                    else:
                        sml.small_m_linear(torch.empty(rows, 2 * k, dtype=torch.bfloat16), weight, None, cfg,
                                           gated=True, add=add)
                if not cfg.weight_left:
                    sml.small_m_linear(torch.empty(rows, 2 * k, dtype=torch.bfloat16), weight, None, cfg, gated=True)
                else:
                    sml.small_m_linear(x, weight, None, cfg, activated=True)
    sparse_shapes()


def sparse_shapes() -> None:
    """The sparse attention kernels at DeepSeek-V3.2's shapes (indexer 64 heads x 128 over bf16 and FP8 keys,
    top-k 2048, MLA 128 heads, latent 512 + rope 64, bf16) for decode and a 5-row verify, as an H100 launches them."""
    import torch

    from workers.kernels import sparse_mla as sm

    page, pages, topk = 64, 4, 2048
    keys = torch.empty(pages * page, 128, dtype=torch.bfloat16)
    packed = torch.empty(pages, page * 132, dtype=torch.uint8)
    cache = torch.empty(pages * page, 576, dtype=torch.bfloat16)
    table = torch.zeros(1, 2048, dtype=torch.int32)  # a 128k context's page table row
    for rows in (1, 5, 40):
        req, ln = torch.zeros(rows, dtype=torch.int32), torch.full((rows,), 1000, dtype=torch.int32)
        q, w = torch.empty(rows, 64, 128, dtype=torch.bfloat16), torch.empty(rows, 64)
        scores = torch.empty(rows, 4096)
        per_req = 1 if rows == 1 else 5  # verify rows: 1 + 4 drafts of one request read its keys once
        for k, fp8 in ((keys, False), (packed, True)):
            sm.indexer_scores(q, w, k, table, req, ln, page, fp8=fp8, num_splits=8, out=scores)
            sm.indexer_scores(q, w, k, table, req, ln, page, fp8=fp8, tree_bits=torch.zeros(rows, dtype=torch.int64),
                              tree_len=4, rows_per_req=per_req, num_splits=8, out=scores)
            sm.indexer_topk(q, w, k, table, req, ln, page, topk, fp8=fp8, rows_per_req=per_req, num_splits=8,
                            topk_splits=1)
            sm.indexer_topk(q, w, k, table, req, ln, page, topk, fp8=fp8, rows_per_req=per_req, num_splits=8,
                            topk_splits=16)
        sm.topk_slots(scores, table, req, ln, page, topk)
        sm.topk_slots(scores, table, req, ln, page, topk, num_splits=1)
        long_scores = torch.empty(rows, 8 * topk)  # rows long enough for the sampled threshold's paths
        for method in ("ordered", "sampled"):
            sm.topk_slots(long_scores, table, req, ln, page, topk, method=method)
        slots = torch.zeros(rows, topk, dtype=torch.int32)
        ql, qr = torch.empty(rows, 128, 512, dtype=torch.bfloat16), torch.empty(rows, 128, 64, dtype=torch.bfloat16)
        for splits in (1, 16):
            sm.sparse_mla(ql, qr, cache, slots, 0.1, num_splits=splits)
            # the transposed dots (heads on the MMA's N side), the tiles the bench's sweep tries
            sm.sparse_mla(ql, qr, cache, slots, 0.1, num_splits=splits, block_h=16, block_n=64, heads_n=True)
            sm.sparse_mla(ql, qr, cache, slots, 0.1, num_splits=splits, block_h=32, block_n=64, lat_split=2,
                          heads_n=True)


def record(workloads, out_path: str, outcomes_path: str | None = None) -> None:
    """Run each workload in this process under the interpreter, then launch ``model_shapes`` without running its
    kernels, recording every launch into ``out_path``. With ``outcomes_path``, each workload's stdout and how it
    ended (its exit code, or the error it raised) go there as JSON and a failing workload does not stop the others
    (the test suite reads its checks' verdicts from it, so that each check runs once)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "record under TRITON_INTERPRET=1"
    import contextlib
    import io
    import traceback

    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    outcomes: dict[str, dict] = {}
    original = InterpretedFunction.run
    execute = True

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        names = self.arg_names
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        entry = {
            "module": fn.__module__, "name": fn.__qualname__,
            "args": {k: describe(v) for k, v in bound.items()},
            "options": {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs},
        }
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        if execute or fn.__module__ not in LAUNCH_ONLY_MODULES:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    InterpretedFunction.run = run
    argv = sys.argv
    try:
        for module, args in workloads:
            sys.argv = [module, *args]
            out, ended = io.StringIO(), {"exit": 0, "error": None}
            try:
                with contextlib.redirect_stdout(out):
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:  # a check's own verdict (bf16 attention is not exact under the interpreter)
                ended["exit"] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                if outcomes_path is None:
                    raise
                ended.update(exit=1, error=traceback.format_exc()[-4000:])
            outcomes[" ".join([module, *args])] = {"stdout": out.getvalue(), **ended}
            if outcomes_path is None:
                sys.stdout.write(out.getvalue())
        execute = False
        model_shapes()
    finally:
        sys.argv = argv
        InterpretedFunction.run = original
    Path(out_path).write_text(json.dumps(list(seen.values())))
    if outcomes_path is not None:
        Path(outcomes_path).write_text(json.dumps(outcomes))


def signature_of(kernel, entry: dict, pdl: bool) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attributes) for ``triton.compile`` from a recorded launch; parameters left at their
    defaults take them, ``PDL`` is on when asked, and ``DEVICE_CONSTEXPRS`` take the GPU's values. A 16-byte
    aligned tensor and an integer divisible by 16 are marked so, as Triton's launches specialize them on the GPU:
    without it a kernel's loads do not vectorize and its register count reads far above the GPU's."""
    divisible = [["tt.divisibility", 16]]
    dtypes = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int8": "i8",
              "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1"}
    defaults = inspect.signature(kernel.fn).parameters
    sig, const, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        arg = entry["args"].get(name)
        if param.is_constexpr:
            value = arg["value"] if arg is not None else defaults[name].default
            if name == "PDL" and pdl:
                value = True
            value = DEVICE_CONSTEXPRS.get(name, value)
            sig[name] = "constexpr"
            const[(i,)] = value
        elif arg is None:
            raise ValueError(f"{entry['name']}: no value for {name}")
        elif "tensor" in arg:
            sig[name] = "*" + dtypes[arg["tensor"]]
            if arg.get("aligned"):
                attrs[(i,)] = divisible
        elif arg["value"] is None:
            sig[name] = "constexpr"
            const[(i,)] = None
        elif isinstance(arg["value"], bool):
            sig[name] = "i1"
        elif isinstance(arg["value"], int):
            sig[name] = "i64" if abs(arg["value"]) >= 2 ** 31 else "i32"
            if arg["value"] % 16 == 0:
                attrs[(i,)] = divisible
        else:
            sig[name] = "fp32"
    return sig, const, attrs


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes per thread (register spills, local arrays) of a compiled kernel, from
    ``cuobjdump -res-usage`` (Triton's own copy); empty where that tool is missing."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(found[1]), "stack_bytes": int(found[2])} if found else {}


def compile_all(entries: list[dict], arch: int, pdl: bool) -> list[dict]:
    """Compile each distinct recorded launch (no interpreter); one result each: the kernel, ok or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results, done = [], set()
    for e in entries:
        kernel = getattr(importlib.import_module(e["module"]), e["name"])
        t0 = time.perf_counter()
        try:
            sig, const, attrs = signature_of(kernel, e, pdl)
            key = (e["module"], e["name"], json.dumps(sig), repr(sorted(const.items())), repr(sorted(attrs)),
                   repr(e["options"]))
            if key in done:  # launches differing only in scalar values compile to the same kernel
                continue
            done.add(key)
            compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=target,
                                      options=dict(e["options"]))
            res = {"ok": True, "shared_bytes": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
                   **resource_usage(compiled.asm["cubin"])}
        except Exception as exc:  # noqa: BLE001 - reported per launch
            res = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
        constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
        res.update(kernel=f"{e['module']}.{e['name']}", seconds=round(time.perf_counter() - t0, 2),
                   constexprs={k: DEVICE_CONSTEXPRS.get(k, v["value"]) for k, v in e["args"].items()
                               if k in constexpr_names})
        results.append(res)
    return results


def kernels_in(modules: tuple[str, ...]) -> set[str]:
    """Every Triton kernel (a ``@triton.jit`` function no other one calls) defined in ``modules``."""
    from triton.runtime.jit import JITFunction

    fns = {}
    for m in modules:
        mod = importlib.import_module(m)
        fns.update({f"{m}.{n}": f for n, f in vars(mod).items() if isinstance(f, JITFunction) and f.__module__ == m})
    sources = {k: inspect.getsource(f.fn) for k, f in fns.items()}
    called = {k for k, f in fns.items()
              if any(f"{f.fn.__name__}(" in src for other, src in sources.items() if other != k)}
    return set(fns) - called


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    ap.add_argument("--no-pdl", action="store_true", help="compile as launched on the CPU (PDL off)")
    ap.add_argument("--json")
    ap.add_argument("--record-only", metavar="PATH", help=argparse.SUPPRESS)  # the interpreter half
    ap.add_argument("--outcomes", metavar="PATH", help=argparse.SUPPRESS)  # with --record-only: the checks' verdicts
    ap.add_argument("--launches", metavar="PATH", help="compile the launches a --record-only run recorded there")
    args = ap.parse_args()
    if args.record_only:
        record(WORKLOADS, args.record_only, args.outcomes)
        return 0
    if args.launches:
        entries = json.loads(Path(args.launches).read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            launches = os.path.join(tmp, "launches.json")
            env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
            rec = subprocess.run([sys.executable, "-m", "tools.compile_kernels", "--record-only", launches],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
            if rec.returncode != 0:
                print(rec.stdout[-3000:], rec.stderr[-3000:], sep="\n")
                print("recording the launches failed")
                return 1
            entries = json.loads(Path(launches).read_text())
    results = compile_all(entries, args.arch, pdl=not args.no_pdl)
    missing = sorted(kernels_in(KERNEL_MODULES) - {r["kernel"] for r in results})
    for r in results:
        usage = f" regs {r['registers']} stack {r['stack_bytes']}" if "registers" in r else ""
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['kernel']} {r['seconds']}s{usage} {r['constexprs']}"
              + ("" if r["ok"] else f"\n     {r['error']}"))
    failed = [r for r in results if not r["ok"]]
    spilled = [r for r in results if r.get("stack_bytes")]
    print(f"SUMMARY: {len(results) - len(failed)} compiled for sm_{args.arch}, {len(failed)} FAIL; "
          f"kernels never launched: {', '.join(missing) or 'none'}")
    print(f"STACK: {len(spilled)} compiled launches use stack (register spills): "
          + ("; ".join(f"{r['kernel']} {r['stack_bytes']} B {r['constexprs']}" for r in spilled) or "none"))
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "results": results, "never_launched": missing},
                                              indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
