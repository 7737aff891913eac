"""The norms and residual adds inside the small-M linear kernels (``small_m_linear``: ``norm_eps``, ``add``) against
references, kernel by kernel and through a Llama model with its norm weights folded.

    python -m tests.gpu.check_fused_norms --device cuda --dtype bfloat16
    TRITON_INTERPRET=1 python -m tests.gpu.check_fused_norms --device cpu --dtype float32   # (tests/kernels)

Kernels: the GEMV at 1 and 2 rows, the tensor-core tiles with the rows or the weight on the left and the activated
one, each normalising its input (RMSNorm without a weight, the sums of squares from its own loads) and adding a
residual stream to its output (bit for bit the plain kernel's output plus the stream, rounded), with bias and ragged
N and K; ``linear`` through cuBLAS's path (F.linear) and a folded norm weight (``fold_norm_weight``) give the same.
Model: a 2-layer Qwen2-style model (q/k/v bias, random norm weights) folded (``fold_norms``) against the unfolded one
running its norms as kernels (in 16 bits: the folded one within twice the unfolded one's error of an fp32 copy), over
a prefill and 1-8-row steps (the GEMV at 1 row, the weight-left tiles and the activated gate/up at 3-4, the rows-left
ones at 5-8; at 2 rows, no kernel in the tables, the norm kernels with weights of one), counting the norm kernels each
forward runs. Under the interpreter only float32: its bf16 dot is not exact. Exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import copy

import torch

from workers import layers
from workers.kernels import small_m_linear as sml
from workers.kernels.norm_rope import rms_norm_reference, silu_and_mul

EPS = 1e-5


def randn(*shape, g, device, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)


def check_kernels(device: str, dtype: torch.dtype, g: torch.Generator) -> int:
    """Each kernel family with ``norm_eps`` / ``add`` against references; returns how many cases ran."""
    gemv1, gemv2 = sml.TileConfig(1, 8, 32, 2, 1), sml.TileConfig(2, 8, 32, 2, 1)
    dot16, left16 = sml.TileConfig(16, 16, 32, 4, 1), sml.TileConfig(16, 16, 32, 4, 1, weight_left=True)
    cases = [(cfg, m, n, k, bias) for cfg in (gemv1, gemv2, dot16, left16)
             for m, n, k, bias in ((1, 48, 96, False), (1, 44, 70, True), (2, 40, 70, True), (3, 48, 64, False),
                                   (16, 32, 96, True)) if m <= cfg.block_m]
    for cfg, m, n, k, bias in cases:
        x = randn(m, 2 * k, g=g, device=device, dtype=dtype, scale=3.0)[:, :k]  # rows of a wider tensor, rms ~3
        w = randn(n, k, g=g, device=device, dtype=dtype)
        b = randn(n, g=g, device=device, dtype=dtype) if bias else None
        add = randn(m, n, g=g, device=device, dtype=dtype)
        normed = rms_norm_reference(x, torch.ones(k, dtype=dtype, device=device), EPS)
        ref = torch.nn.functional.linear(normed.float(), w.float(), None if b is None else b.float())
        # 16-bit: the output's own rounding (~1e-2 of the largest); the reference rounds the normalised input
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
        got = sml.small_m_linear(x, w, b, cfg, norm_eps=EPS)
        assert got.dtype == dtype and torch.allclose(got.float(), ref, atol=tol, rtol=1e-4), (cfg, m, n, k)
        # the add: bit for bit the plain kernel's rounded output plus the stream, rounded once more
        plain = sml.small_m_linear(x, w, b, cfg)
        assert torch.equal(sml.small_m_linear(x, w, b, cfg, add=add), (plain.float() + add.float()).to(dtype)), (cfg, m)
        both = sml.small_m_linear(x, w, b, cfg, norm_eps=EPS, add=add)
        assert torch.equal(both, (got.float() + add.float()).to(dtype)), (cfg, m)
        for table in ({sml.row_bucket(m): cfg}, {}):  # the kernel, or the norm, F.linear and an add around it
            out = sml.linear(x, w, b, table, norm_eps=EPS, add=add)
            assert torch.allclose(out.float(), ref + add.float(), atol=tol, rtol=1e-4), (table, m, n, k)
        if cfg.weight_left:  # silu(gate) * up of the normalised input
            ref_act = silu_and_mul(torch.nn.functional.linear(normed, w, b)).float()
            got_act = sml.small_m_linear(x, w, b, cfg, activated=True, norm_eps=EPS)
            act_tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref_act.abs().max().item()
            assert torch.allclose(got_act.float(), ref_act, atol=act_tol, rtol=1e-4), (m, n, k)
        gu = randn(m, 2 * k, g=g, device=device, dtype=dtype)  # a down projection's gated input
        gated = sml.small_m_linear(gu, w, None, cfg, gated=True)
        assert torch.equal(sml.small_m_linear(gu, w, None, cfg, gated=True, add=add),
                           (gated.float() + add.float()).to(dtype))
    # a weight with the norm's weight folded in: the unweighted norm then gives what norm * gamma did
    x, w = randn(2, 64, g=g, device=device, dtype=dtype), randn(24, 64, g=g, device=device, dtype=dtype)
    gamma = (1 + randn(64, g=g, device=device, dtype=torch.float32)).to(dtype)
    ref = torch.nn.functional.linear(rms_norm_reference(x, gamma, EPS).float(), w.float())
    folded = w.clone()
    sml.fold_norm_weight(folded, gamma)
    assert torch.equal(gamma, torch.ones_like(gamma))
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    assert torch.allclose(sml.small_m_linear(x, folded, None, gemv2, norm_eps=EPS).float(), ref, atol=tol, rtol=1e-4)
    for bad in (dict(gated=True, norm_eps=EPS), dict(add=torch.zeros(2, 24, dtype=dtype, device=device))):
        try:
            sml.small_m_linear(randn(1, 128 if bad.get("gated") else 64, g=g, device=device, dtype=dtype), w, None,
                               gemv1, **bad)
            raise AssertionError(f"{bad} must be refused")
        except ValueError:
            pass
    return len(cases)


def check_model(device: str, dtype: torch.dtype, g: torch.Generator) -> int:
    """The folded 2-layer model against the unfolded one (module docstring); returns how many forwards ran."""
    from attention.torch_native import TorchNativeBackend
    from workers.forward_batch import ForwardBatch
    from workers.kv_cache import KVCache, PageTable
    from workers.messages import ForwardMode
    from workers.model_config import ModelConfig
    from workers.models.llama import LlamaForCausalLM

    cfg = ModelConfig(path="", architecture="Qwen2ForCausalLM", hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=50, rms_norm_eps=EPS,
                      rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                      attention_bias=True, qk_norm=False, checkpoint_dtype=dtype)
    model = LlamaForCausalLM(cfg, dtype, layers.SINGLE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name else
                    0.3 * torch.randn(p.shape, generator=g))
    model.to(device)
    tiles = {1: sml.TileConfig(1, 8, 32, 2, 1), 4: sml.TileConfig(16, 16, 32, 4, 1, weight_left=True),
             8: sml.TileConfig(16, 16, 32, 4, 1)}
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            proj.small_m.update(tiles)
        layer.mlp.gate_up_proj.small_m_act[4] = sml.TileConfig(16, 16, 32, 4, 1, weight_left=True)
    ref = copy.deepcopy(model)
    exact = copy.deepcopy(model).float()  # fp32 through cuBLAS: what both 16-bit models approximate
    for layer in exact.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):
            proj.small_m.clear()
        layer.mlp.gate_up_proj.small_m_act.clear()
    assert not model.layers[0].fuses_norms(1)  # not folded yet
    model.fold_norms()
    qkv = model.layers[0].self_attn.qkv_proj.weight.clone()
    model.fold_norms()  # once
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(model.layers[0].input_layernorm.weight, torch.ones(64, dtype=dtype, device=device))
    assert [model.layers[0].fuses_norms(r) for r in (1, 2, 3, 5, 16, 17)] == [True, False, True, True, False, False]
    assert not ref.layers[0].fuses_norms(1)
    page, pages_per = 4, 8
    state = []
    for kv_dtype in (dtype, dtype, torch.float32):
        kv = KVCache(cfg.num_layers, 2 * pages_per + 1, page, 2, 16, kv_dtype, device)
        table = PageTable(2, pages_per, page, device)
        table.table.copy_(torch.arange(1, 2 * pages_per + 1, dtype=torch.int32).view(2, pages_per))
        state.append((kv, table))
    norms, acts = [], []
    real_norm, real_act = layers.rms_norm, layers.activated_linear
    layers.rms_norm = lambda *a, **kw: norms.append(1) or real_norm(*a, **kw)
    layers.activated_linear = lambda *a, **kw: acts.append(1) or real_act(*a, **kw)
    lens, forwards = [0, 0], 0
    try:
        steps = [([0, 1], [5, 3]), ([0], [1]), ([0, 1], [1, 1]), ([1], [3]), ([0], [1]), ([0, 1], [2, 1])]
        for slots, new in steps:
            ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=g)
            seq = [lens[s] + n for s, n in zip(slots, new)]
            outs = []
            for net, (kv, table) in zip((model, ref, exact), state):
                mode = ForwardMode.EXTEND if max(new) > 1 else ForwardMode.DECODE
                fb = ForwardBatch.build(mode, ids, slots, seq, new, kv, table)
                fb.attn_backend = TorchNativeBackend()
                fb.attn_backend.init_forward_metadata(fb)
                norms.clear()
                acts.clear()
                with torch.no_grad():
                    outs.append(net(fb).float())
                if net is exact:
                    continue
                fused = len(ids) != 2
                assert len(norms) == (1 if net is model and fused else 1 + 2 * cfg.num_layers), (len(ids), norms)
                assert len(acts) == (cfg.num_layers if sml.row_bucket(len(ids)) == 4 else 0)
                forwards += 1
            if dtype == torch.float32:
                assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4), (slots, new)
            else:  # 16-bit: folding rounds differently, so the folded model may be no farther from fp32 than
                # the unfolded one is, give or take (twice its error, or 1% of the logits' range)
                err, err_ref = ((o - outs[2]).abs().max().item() for o in outs[:2])
                tol = max(2 * err_ref, 1e-2 * outs[2].abs().max().item())
                assert err <= tol, (slots, new, err, err_ref, tol)
            for s, n in zip(slots, new):
                lens[s] += n
        for a, b, c in zip(state[0][0].k, state[1][0].k, state[2][0].k):
            if dtype == torch.float32:
                assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
            else:
                err, err_ref = (a.float() - c).abs().max().item(), (b.float() - c).abs().max().item()
                assert err <= max(2 * err_ref, 1e-2 * c.abs().max().item()), (err, err_ref)
    finally:
        layers.rms_norm, layers.activated_linear = real_norm, real_act
    return forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(1)
    kernels = check_kernels(args.device, dtype, g)
    forwards = check_model(args.device, dtype, g)
    print(f"fused norms ok: {kernels} kernel cases, {forwards} model forwards ({args.device}, {args.dtype})")


if __name__ == "__main__":
    main()
