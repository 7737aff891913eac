"""The Triton attention kernels on the CPU through Triton's interpreter, against the torch-native reference, for
every forward mode and both verify kernel families (the same check runs compiled on the GPU: tests/gpu)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("triton")


def test_triton_kernels_match_reference_in_interpreter(interpreter_checks):
    # tools/compile_kernels.py's workload (run once for the session): --min-chunk 64, so sequences of up to 150
    # positions span several KV splits (the last ones partly or wholly empty)
    out = interpreter_checks.stdout("tests.gpu.check_attention", "--device", "cpu", "--dtype", "float32", "--small",
                                    "--min-chunk", "64")
    lines = [ln for ln in out.splitlines() if ln.startswith("triton")]
    assert len(lines) == 24 and all(ln.endswith(" ok") for ln in lines), out


def test_round_draft_extend_takes_the_split_kv_launch():
    """A DRAFT_EXTEND of the same few tokens for every request (a speculative round's catch-up, or a short uniform
    prefill catch-up) runs the decode family's launch when verify does; a ragged or long one, EXTEND, and
    everything under verify_attention_mode "prefill" run the prefill launch."""
    import torch

    from attention.triton_backend import TritonBackend
    from workers.forward_batch import ForwardBatch
    from workers.kv_cache import KVCache, PageTable
    from workers.messages import ForwardMode

    kv = KVCache(1, 64, 16, 2, 16, torch.float32, "cpu")
    table = PageTable(2, 16, 16, "cpu")
    table.table.copy_(torch.arange(1, 33, dtype=torch.int32).view(2, 16))

    def launch(mode, new, verify_mode="decode"):
        be = TritonBackend(verify_attention_mode=verify_mode)
        fb = ForwardBatch.build(mode, torch.zeros(sum(new), dtype=torch.int64), [0, 1], [100, 200], new, kv, table)
        styles = []
        be._run = lambda q, layer, fb, decode_style: styles.append(decode_style)
        be.init_forward_metadata(fb)
        be.forward(torch.zeros(sum(new), 4, 16), None, None, None, fb)
        return styles[0]

    assert launch(ForwardMode.DRAFT_EXTEND, [4, 4]) is True
    assert launch(ForwardMode.DRAFT_EXTEND, [4, 4], verify_mode="prefill") is False
    assert launch(ForwardMode.DRAFT_EXTEND, [4, 9]) is False
    assert launch(ForwardMode.DRAFT_EXTEND, [40, 40]) is False
    assert launch(ForwardMode.EXTEND, [4, 4]) is False
    assert launch(ForwardMode.TARGET_VERIFY, [4, 4]) is True


PAGE_MAJOR_CHECK = """
import torch
from attention.base import AttentionLayerSpec
from attention.triton_backend import TritonBackend
from workers.forward_batch import ForwardBatch
from workers.messages import ForwardMode
from workers.kv_cache import KVCache, PageTable

torch.manual_seed(0)
page, kv_heads, dim, heads, bs, ctx, nd = 4, 2, 16, 4, 2, 37, 3
pages_per = -(-(ctx + nd) // page)
kv = KVCache(1, bs * pages_per + 1, page, kv_heads, dim, torch.float32, "cpu")
kv.k[0].normal_()
kv.v[0].normal_()
table = PageTable(bs, pages_per, page, "cpu")
table.table.copy_((torch.randperm(bs * pages_per) + 1).view(bs, pages_per).to(torch.int32))
fb = ForwardBatch.build(ForwardMode.TARGET_VERIFY, torch.zeros(bs * nd, dtype=torch.int64), list(range(bs)),
                        [ctx] * bs, [nd] * bs, kv, table)
q = torch.randn(bs * nd, heads, dim)
layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim ** -0.5)
be = TritonBackend()
be.min_chunk = 8
outs = {}
for name in ("token-major", "page-major"):
    if name == "page-major":  # the same values as [pages, kv heads, page size, dim]
        kv.k[0], kv.v[0] = (t.view(kv.num_pages, page, kv_heads, dim).permute(0, 2, 1, 3).contiguous()
                            for t in (kv.k[0], kv.v[0]))
    for style in ("decode", "prefill"):
        be.init_forward_metadata(fb)
        outs[name, style] = be._run(q, layer, fb, decode_style=style == "decode")
for style in ("decode", "prefill"):
    assert torch.equal(outs["token-major", style], outs["page-major", style]), style
assert outs["token-major", "decode"].abs().sum() > 0
print("layouts equal")
"""


def test_split_kv_kernel_reads_a_page_major_cache_as_the_token_major_one():
    """The kernel addresses K/V by (page, head, position in page) strides: a cache laid out [pages, kv heads, page
    size, dim] gives the very same outputs as the KVCache layout [slots, kv heads, dim] holding the same values."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", PAGE_MAJOR_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "layouts equal" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


MERGE_CHECK = """
import torch
import triton
from attention.triton_backend import _merge_splits

torch.manual_seed(0)
rows, heads, splits, dim = 3, 2, 6, 16
part_o = torch.randn(rows, heads, splits, dim)
part_lse = torch.randn(rows, heads, splits)
part_lse[:, :, 4:] = float("-inf")  # splits past the sequence: no output written (NaN here stands for garbage)
part_o[:, :, 4:] = float("nan")
part_lse[1, 0, 1] = float("-inf")  # a live split where this row saw nothing
part_o[1, 0, 1] = float("nan")
out = torch.empty(rows, heads, dim)
_merge_splits[(rows, heads)](part_o, part_lse, out, splits, *part_o.stride()[:3], *part_lse.stride()[:2],
                             out.stride(0), out.stride(1), HEAD_DIM=dim, SPLITS_P2=triton.next_power_of_2(splits))
w = torch.softmax(part_lse, -1).nan_to_num(0.0)
ref = (part_o.nan_to_num(0.0) * w.unsqueeze(-1)).sum(2)
assert torch.isfinite(out).all(), out
torch.testing.assert_close(out, ref)
print("merge ok")
"""


def test_merge_reads_only_the_outputs_of_live_splits():
    """A KV split with no visible position writes only its -inf log-sum-exp, not its partial output: the merge must
    neither read nor weigh that output (NaN garbage there leaves the result finite and exact)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", MERGE_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "merge ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


GRAPH_EXTEND_CHECK = """
import torch
from attention.base import AttentionLayerSpec
from attention.torch_native import TorchNativeBackend
from attention.triton_backend import TritonBackend
from workers.forward_batch import ForwardBatch
from workers.kv_cache import KVCache, PageTable
from workers.messages import ForwardMode

torch.manual_seed(0)
page, kv_heads, dim, heads, pages_per = 4, 2, 16, 8, 12
kv = KVCache(1, 3 * pages_per + 1, page, kv_heads, dim, torch.float32, "cpu")
kv.k[0].normal_()
kv.v[0].normal_()
table = PageTable(4, pages_per, page, "cpu")  # slot 3: the padding slot, its row all page 0
table.table[:3] = (torch.randperm(3 * pages_per) + 1).view(3, pages_per).to(torch.int32)
layer = AttentionLayerSpec(0, heads, kv_heads, dim, dim ** -0.5)
cases = [([(0, 7, 5), (1, 0, 3), (2, 13, 1)], 16, 4), ([(0, 7, 5), (1, 0, 3), (2, 13, 1)], 32, 8),
         ([(0, 7, 5), (1, 0, 3), (2, 13, 8)], 16, 4)]  # (slot, prefix, new tokens); the last: no padding tokens
for real, tb, rb in cases:
    t = sum(n for _, _, n in real)
    pad = rb - len(real)
    slots = [s for s, _, _ in real] + [3] * (pad + 1)
    ext = [n for _, _, n in real] + [tb - t] + [0] * pad
    seq = [p + n for _, p, n in real] + [tb - t] + [1] * pad
    q = torch.randn(tb, heads, dim)
    graph = ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(tb, dtype=torch.int64), torch.tensor(slots),
                               torch.tensor(seq), torch.tensor(ext), kv, table, max_extend=tb)
    eager = ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(t, dtype=torch.int64), slots[:len(real)],
                               seq[:len(real)], ext[:len(real)], kv, table)
    out = {}
    for name, be in (("triton", TritonBackend()), ("native", TorchNativeBackend())):
        for kind, fb in (("graph", graph), ("eager", eager)):
            be.init_forward_metadata(fb)
            out[name, kind] = be.forward_extend(q[:fb.num_tokens], layer, fb)[:t]
    assert torch.equal(out["triton", "graph"], out["triton", "eager"]), (real, tb, rb)
    torch.testing.assert_close(out["triton", "graph"], out["native", "eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["native", "graph"], out["native", "eager"], rtol=1e-5, atol=1e-5)
print("graph extends equal")
"""


def test_prefill_graph_shaped_extend_equals_the_eager_one():
    """A prefill graph's EXTEND (lengths on the device, the launch sized for the token bucket for every request, a
    padding request on the padding slot, empty requests): the real tokens' outputs are the eager launch's, bit for
    bit (the query blocks past a request's tokens do nothing), and the torch-native reference's."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", GRAPH_EXTEND_CHECK], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and "graph extends equal" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
