"""Train the shipped tiny model family on the CPython standard library (on a GPU, through `device`, in minutes):

1. a byte-level BPE tokenizer (vocab 8192) on the stdlib .py files of the running interpreter;
2. a Llama target (~19M parameters, context 2048, trained on 1024-token windows);
3. a standalone 2-layer draft, distilled from the target's next-token distribution;
4. an EAGLE-3 head on the target's layer (2, L/2, L-3) features, distilled from the target, with training-time test
   (the head's own output features fed back for the later draft steps, attention masked as at inference).
Draft and head are distilled on a mix of data windows and the target's own greedy continuations of data prompts,
the sequences they are judged against at inference.

    python3 -m tools.train_tiny --out /tmp/family [--minutes-target 4 --minutes-draft 1.5 --minutes-eagle 2]

Deterministic seeds; data order from a seeded generator. Writes HF-format directories target/, draft/, eagle3/ and
train_log.json (losses, timings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deployments.make_tiny import CHAT_TEMPLATE, SPECIAL_TOKENS


def stdlib_files() -> list[Path]:
    lib = Path(os.__file__).parent
    return sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def build_tokenizer(files: list[Path], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                   unk_token="<unk>", pad_token="<|end_of_text|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_corpus(tok, files: list[Path]) -> torch.Tensor:
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator, device):
    while True:
        starts = torch.randint(0, data.numel() - seq - 2, (batch,), generator=gen)
        yield torch.stack([data[s : s + seq + 1] for s in starts]).to(device, non_blocking=True)


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))) + peak * 0.02


def train_loop(name: str, params, loss_fn, minutes: float, est_steps: int, peak_lr: float, log: dict) -> None:
    """Train until the time budget is spent (cosine schedule over the estimated step count)."""
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1, fused=torch.cuda.is_available())
    t0, step, losses = time.time(), 0, []
    while time.time() - t0 < minutes * 60 and step < est_steps:
        if step == 10:
            t10 = time.time()
        if step == 60:  # fit the cosine schedule to the time budget from the measured (warm) step time
            per_step = (time.time() - t10) / 50
            est_steps = min(est_steps, int(60 + (minutes * 60 - (time.time() - t0)) / per_step))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, est_steps, peak_lr)
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0:
            losses.append((step, round(loss.item(), 4)))
            print(f"[{name}] step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
        step += 1
    log[name] = {"steps": step, "seconds": round(time.time() - t0, 1), "loss_curve": losses,
                 "final_loss": losses[-1][1] if losses else None}


def llama(vocab, hidden, layers, heads, kv_heads, inter, max_pos, tok, tie=False):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, rope_theta=10000.0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


# ---- EAGLE-3 head, training form (same parameter names and math as workers/models/eagle.py) -----------------------
class RMS(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Eagle3Train(nn.Module):
    def __init__(self, hidden, heads, kv_heads, inter, draft_vocab, eps, theta, max_pos):
        super().__init__()
        h, d = hidden, hidden // heads
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.fc = nn.Linear(3 * h, h, bias=False)
        mid = nn.Module()
        mid.self_attn = nn.Module()
        mid.self_attn.q_proj = nn.Linear(2 * h, heads * d, bias=False)
        mid.self_attn.k_proj = nn.Linear(2 * h, kv_heads * d, bias=False)
        mid.self_attn.v_proj = nn.Linear(2 * h, kv_heads * d, bias=False)
        mid.self_attn.o_proj = nn.Linear(heads * d, h, bias=False)
        mid.mlp = nn.Module()
        mid.mlp.gate_proj = nn.Linear(h, inter, bias=False)
        mid.mlp.up_proj = nn.Linear(h, inter, bias=False)
        mid.mlp.down_proj = nn.Linear(inter, h, bias=False)
        mid.input_layernorm, mid.hidden_norm, mid.post_attention_layernorm = RMS(h, eps), RMS(h, eps), RMS(h, eps)
        self.midlayer = mid
        self.norm = RMS(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        fr = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        self.register_buffer("cos", fr.cos(), persistent=False)
        self.register_buffer("sin", fr.sin(), persistent=False)

    def rope(self, x, pos):  # x [B, T, H, d]
        x1, x2 = x.float().chunk(2, -1)
        c, s = self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)

    def qkv(self, embeds, hidden, pos):
        m = self.midlayer
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], -1)
        b, t, _ = x.shape
        q = self.rope(m.self_attn.q_proj(x).view(b, t, self.heads, self.d), pos)
        k = self.rope(m.self_attn.k_proj(x).view(b, t, self.kv_heads, self.d), pos)
        v = m.self_attn.v_proj(x).view(b, t, self.kv_heads, self.d)
        return q, k, v

    def finish(self, attn, hidden):
        m = self.midlayer
        b, t = attn.shape[:2]
        x = m.self_attn.o_proj(attn.reshape(b, t, -1))
        residual = x + hidden
        x = m.post_attention_layernorm(residual)
        x = m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))
        feat = x + residual
        return self.lm_head(self.norm(feat)), feat

    def unrolled(self, embeds, first_hidden, steps: int):
        """Training-time test: step k at position p sees step-1 keys before p-k+2 and step-i keys at p-k+i
        (i = 2..k), as a depth-k draft node sees the prefix and its own ancestors at inference."""
        b, t, _ = embeds.shape
        dev = embeds.device
        pos = torch.arange(t, device=dev).expand(b, t)
        keys, vals, outs = [], [], []
        hidden = first_hidden
        ar = torch.arange(t, device=dev)
        for k in range(1, steps + 1):
            q, kk, vv = self.qkv(embeds, hidden, pos)  # position p uses token p+1's embedding (shifted by caller)
            keys.append(kk)
            vals.append(vv)
            masks = []
            for i in range(1, k + 1):
                if i == 1:
                    masks.append(ar[None, :] <= ar[:, None] - (k - 1))  # step-1 keys at j <= p-k+1
                else:
                    masks.append(ar[None, :] == ar[:, None] - (k - i))  # step-i key at p-k+i
            mask = torch.cat(masks, 1)  # [T, k*T]
            kcat = torch.cat(keys, 1).transpose(1, 2)
            vcat = torch.cat(vals, 1).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), kcat, vcat, attn_mask=mask, enable_gqa=True)
            logits, feat = self.finish(attn.transpose(1, 2), hidden)
            outs.append(logits)
            hidden = torch.cat([feat[:, :1], feat[:, :-1]], 1)  # next step at p takes this step's feature at p-1
        return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--minutes-target", type=float, default=4.0)
    ap.add_argument("--minutes-draft", type=float, default=1.5)
    ap.add_argument("--minutes-eagle", type=float, default=2.0)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--eagle-ttt-steps", type=int, default=3)
    ap.add_argument("--target-max-steps", type=int, default=400, help="~6 epochs: more only memorises the stdlib")
    ap.add_argument("--self-distill-batches", type=int, default=8, help="x256 greedy continuations of the target")
    ap.add_argument("--max-files", type=int, default=0, help="debug: use only the first N files")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "args": vars(args)}
    t0 = time.time()
    files = stdlib_files()[: args.max_files or None]
    tok = build_tokenizer(files, args.vocab)
    data = encode_corpus(tok, files)
    log["data"] = {"files": len(files), "tokens": data.numel(), "python": sys.version.split()[0],
                   "tokenizer_seconds": round(time.time() - t0, 1)}
    print(log["data"], flush=True)
    gen = torch.Generator().manual_seed(1234)
    stream = batches(data, args.batch, args.seq, gen, dev)
    heads, kv = args.hidden // 64, 2

    # ---- target
    target = llama(args.vocab, args.hidden, args.layers, heads, kv, int(args.hidden * 8 / 3 // 64 * 64), 2048, tok).to(dev)
    log["target_params"] = sum(p.numel() for p in target.parameters())

    def target_loss():
        b = next(stream)
        with amp:
            return target(input_ids=b[:, :-1], labels=b[:, :-1].clone(), use_cache=False).loss

    train_loop("target", list(target.parameters()), target_loss, args.minutes_target, args.target_max_steps, 2e-3, log)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    # ---- the target's own greedy continuations: drafts are judged against exactly these at inference
    t_gen = time.time()
    gen_rows = []
    with torch.no_grad(), amp:
        for _ in range(args.self_distill_batches):
            starts = torch.randint(0, data.numel() - 64, (256,), generator=gen)
            prompts = torch.stack([data[s : s + 64] for s in starts]).to(dev)
            out_ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.seq - 64,
                                      do_sample=False, pad_token_id=tok.eos_token_id)
            gen_rows.append(out_ids[:, : args.seq + 1].cpu())
    generated = torch.cat(gen_rows) if gen_rows else None
    log["self_distill"] = {"sequences": 0 if generated is None else generated.shape[0],
                           "seconds": round(time.time() - t_gen, 1)}
    print(log["self_distill"], flush=True)

    def distill_batch():
        """Half data windows, half target greedy continuations (padded to the window by the data stream)."""
        b = next(stream)
        if generated is None:
            return b
        idx = torch.randint(0, generated.shape[0], (b.shape[0] // 2,), generator=gen)
        g = generated[idx].to(dev)
        b[: g.shape[0], : g.shape[1]] = g
        return b

    # ---- standalone draft, distilled
    draft = llama(args.vocab, 256, 2, 4, 2, 768, 2048, tok).to(dev)
    log["draft_params"] = sum(p.numel() for p in draft.parameters())

    def draft_loss():
        b = distill_batch()[:, :-1]
        with amp:
            with torch.no_grad():
                t_logp = torch.log_softmax(target(input_ids=b, use_cache=False).logits.float(), -1)
            d_logp = torch.log_softmax(draft(input_ids=b, use_cache=False).logits.float(), -1)
        return F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean") / b.shape[1]

    train_loop("draft", list(draft.parameters()), draft_loss, args.minutes_draft, 20000, 2e-3, log)

    # ---- EAGLE-3 head: draft vocabulary = most frequent tokens; targets from the target's distribution
    counts = torch.bincount(data, minlength=args.vocab)
    keep = torch.sort(torch.topk(counts, args.draft_vocab).indices).values
    t2d = torch.zeros(args.vocab, dtype=torch.bool)
    t2d[keep] = True
    L = args.layers
    aux_ids = (2, L // 2, L - 3)
    head = Eagle3Train(args.hidden, heads, kv, int(args.hidden * 8 / 3 // 64 * 64), args.draft_vocab, 1e-5,
                       10000.0, 2048).to(dev)
    embed = target.get_input_embeddings()
    keep_dev = keep.to(dev)

    def eagle_loss():
        b = distill_batch()  # [B, S+1]
        ids = b[:, :-1]
        with torch.no_grad(), amp:
            o = target(input_ids=ids, output_hidden_states=True, use_cache=False)
            # HF hidden_states[i] is the input of layer i (after embeddings for i=0): the residual stream we capture
            feats = torch.cat([o.hidden_states[i] for i in aux_ids], -1)
            t_logp = torch.log_softmax(o.logits.float(), -1)[..., keep_dev]  # target over the draft vocab
        # pair (token p+1, feature p) predicts the target's distribution at p+1
        with amp:
            emb = embed(b[:, 1:]).detach()
            outs = head.unrolled(emb, head.fc(feats), args.eagle_ttt_steps)
            labels = torch.softmax(torch.cat([t_logp[:, 1:], t_logp[:, -1:]], 1), -1)
            loss = 0.0
            for k, logits in enumerate(outs):
                lp = torch.log_softmax(logits.float(), -1)
                loss = loss + (0.8 ** k) * -(labels[:, k:] * lp[:, k:]).sum(-1).mean()
        return loss

    train_loop("eagle3", list(head.parameters()), eagle_loss, args.minutes_eagle, 20000, 2e-3, log)

    # ---- save (bf16, safetensors shards <= 15 MB)
    from safetensors.torch import save_file

    tok.save_pretrained(out / "target")
    target.to(torch.bfloat16).save_pretrained(out / "target", max_shard_size="15MB")
    tok.save_pretrained(out / "draft")
    draft.to(torch.bfloat16).save_pretrained(out / "draft", max_shard_size="15MB")
    (out / "eagle3").mkdir(exist_ok=True)
    sd = {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in head.state_dict().items()}
    sd["d2t"] = (keep - torch.arange(args.draft_vocab)).to(torch.int64)
    sd["t2d"] = t2d
    save_file(sd, str(out / "eagle3" / "model.safetensors"))
    tcfg = json.loads((out / "target" / "config.json").read_text())
    hcfg = {k: tcfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                                 "vocab_size", "rms_norm_eps", "max_position_embeddings", "bos_token_id",
                                 "eos_token_id") if k in tcfg}
    hcfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                head_dim=args.hidden // heads, draft_vocab_size=args.draft_vocab, torch_dtype="bfloat16",
                rope_theta=10000.0, tie_word_embeddings=False,
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_ids)})
    (out / "eagle3" / "config.json").write_text(json.dumps(hcfg, indent=2))
    tok.save_pretrained(out / "eagle3")
    log["total_seconds"] = round(time.time() - t0, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=2))
    print(json.dumps({k: v for k, v in log.items() if k != "args"}, indent=1)[:3000], flush=True)


if __name__ == "__main__":
    main()
