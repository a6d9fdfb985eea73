#!/usr/bin/env python3
"""The peer of record: the longmoe model in PyTorch (+ fla-core's chunk_kda on a GPU).

    python3 bench/model_vs_torch.py check --checkpoint DIR [--kda naive|recurrent|fla]
            [--batch B,T] [--seed S] [--longmoe build/bench_checkpoint_loss] [--device cpu|cuda]
    python3 bench/model_vs_torch.py bench --config configs/k3-mini.json --shape B,T
            [--kda fla|naive] [--compile] [--recompute] [--steps N] [--warmup N] [--out FILE]

One module per layer of src/model (docs/model.md, docs/peer.md). The module tree
spells longmoe's parameter names, so `state_dict()` keys are the tensor names of
model.safetensors (`layers.<l>.kda.W_q`, `attnres.query`, ...); each MoE layer's
balancing bias is the buffer `layers.<l>.moe.bias` (trainer.safetensors).

check: load a checkpoint (weights + frozen biases), draw a batch of random
tokens, compute the mean cross-entropy here in fp32, write the batch to a file
and run bench_checkpoint_loss (longmoe's CPU forward, fp32) on the same file,
and print both losses, their difference and the largest difference of the
per-token log-probabilities as JSON. Exit status 1 when they differ by more than
--tol.

bench: training steps on random tokens of shape B,T: bf16 autocast with fp32
master weights, fused AdamW, quantile balancing of the MoE biases after each
step, optional torch.compile and per-sublayer activation checkpointing; prints
JSON with tokens/s, MFU and peak memory.

KDA operator (--kda):
  naive      the chunked form of SPEC §2 in fp32 PyTorch, decays taken pairwise
             (e^{G_i - G_j} for j <= i only, so nothing overflows); CPU or GPU.
  recurrent  the token-by-token definition (fp32; slow; the oracle of `naive`).
  fla        fla.ops.kda.chunk_kda (Triton, GPU): the raw gate z goes in with
             use_gate_in_kernel=True, A_log [H] and dt_bias [H*K]; the bounded
             gate is safe_gate=True, lower_bound=g_min, which fla computes as
             lower_bound * sigmoid(exp(A_log) * (z + dt_bias)) -- longmoe's
             formula (src/ops/kda/kda_internal.h, kda_gate_value); the L2 norm of
             q and k runs in the kernel (use_qk_l2norm_in_kernel=True).
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

L2_EPS = 1e-6          # src/ops/linear/short_conv.c: y / sqrt(sum y^2 + 1e-6)
SOFTPLUS_G_FLOOR = -1e4  # src/ops/kda/kda_internal.h
H200_BF16_FLOPS = 989e12

# ---------------------------------------------------------------- config


DEFAULTS = {
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "mla_every": 4, "last_layer_mla": True,
              "layout": "", "first_k_dense": 1, "dense_ffn": 128, "tie_embeddings": False, "norm_eps": 1e-6},
    "kda": {"heads": 2, "head_dim": 32, "chunk": 64, "conv_width": 4, "gate": "bounded", "g_min": -5.0},
    "attention": {"kind": "mla", "heads": 2, "kv_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
                  "qk_head_dim": 32, "v_head_dim": 32, "rope_dims": 0},
    "moe": {"routed_experts": 8, "top_k": 2, "shared_experts": 1, "expert_ffn": 32, "shared_ffn": 64,
            "latent_dim": 0, "activation": "swiglu", "route_scale": 1.0, "balance": "quantile"},
    "residual": {"kind": "block_attnres", "block_sublayers": 4},
}


class Config:
    """The model sections of a longmoe config JSON with docs/config.md's defaults."""

    def __init__(self, path):
        raw = json.load(open(path))
        for sec, keys in DEFAULTS.items():
            given = raw.get(sec, {})
            for key, default in keys.items():
                setattr(self, f"{sec}_{key}", given.get(key, default))
        self.train = raw.get("train", {})
        if self.attention_rope_dims:
            raise SystemExit("model_vs_torch: rope_dims > 0 is not implemented here (the recipe's MLA is NoPE)")

    def mixer(self, l):
        """'kda' or 'mla' for layer l (0-based): lm_config_mixer."""
        if self.model_layout:
            return "mla" if self.model_layout[l] == "m" else "kda"
        if self.model_last_layer_mla and l == self.model_n_layers - 1:
            return "mla"
        if self.model_mla_every > 0 and (l + 1) % self.model_mla_every == 0:
            return "mla"
        return "kda"

    def is_moe(self, l):
        return l >= self.model_first_k_dense


# ---------------------------------------------------------------- small functions


def rms_norm(x, w, eps):
    """x * (mean x^2 + eps)^-1/2 * w with fp32 statistics; returns x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype) if w is not None else y.to(x.dtype)


def glu(a, u, activation):
    """SwiGLU silu(a) u, or SiTU-GLU 4 tanh(a/4) sigmoid(a) 25 tanh(u/25) (SPEC §4)."""
    if activation == "situ":
        return 4.0 * torch.tanh(0.25 * a) * torch.sigmoid(a) * 25.0 * torch.tanh(u / 25.0)
    return F.silu(a) * u


def param(*shape):
    return nn.Parameter(torch.zeros(*shape))


# ---------------------------------------------------------------- KDA operator


def kda_gate(z, A_log, dt_bias, gate, g_min):
    """g [B,T,H,K] (fp32) from z [B,T,H,K]: kda_gate_value of src/ops/kda/kda_internal.h."""
    H, K = z.shape[-2], z.shape[-1]
    u = z.float() + dt_bias.float().view(H, K)
    eA = torch.exp(A_log.float()).view(H, 1)
    if gate == "bounded":
        return g_min * torch.sigmoid(eA * u)
    return torch.clamp(-eA * F.softplus(u), min=SOFTPLUS_G_FLOOR)


def kda_recurrent(q, k, v, g, beta, scale):
    """The definition, token by token. q, k, g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H]; fp32."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)                       # S = Diag(e^g) S
        kS = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - kS)              # beta (v - S^T k)
        S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))  # o = scale S^T q
    return torch.stack(out, 1)


def kda_chunk_naive(q, k, v, g, beta, scale, chunk):
    """The chunked form of SPEC §2 in fp32, every decay factor taken pairwise
    (e^{G_i - G_j}, j <= i) or from a chunk's end, so no exponent is positive.
    Same shapes as kda_recurrent."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))  # [B,H,T,...]
    S = q.new_zeros(B, H, K, V)
    out = []
    for c0 in range(0, T, chunk):
        qc, kc, vc, bc = q[:, :, c0:c0 + chunk], k[:, :, c0:c0 + chunk], v[:, :, c0:c0 + chunk], beta[:, :, c0:c0 + chunk]
        G = torch.cumsum(g[:, :, c0:c0 + chunk], 2)                          # inclusive cumsum
        L = G.shape[2]
        diff = G.unsqueeze(3) - G.unsqueeze(2)                               # [B,H,L,L,K]: G_i - G_j
        lower = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device))
        strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device), -1)
        E = torch.exp(torch.where(lower[..., None], diff, torch.full_like(diff, -math.inf)))
        # Akk[i,j] = beta_i sum_d k_id k_jd e^{G_id - G_jd}, j < i
        Akk = torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, E) * strict * bc.unsqueeze(-1)
        # M = (I + Akk)^-1 Diag(beta); W = M (K e^G); U = M V
        I = torch.eye(L, device=q.device).expand_as(Akk)
        eG = torch.exp(G)
        W = torch.linalg.solve_triangular(I + Akk, bc.unsqueeze(-1) * kc * eG, upper=False, unitriangular=True)
        U = torch.linalg.solve_triangular(I + Akk, bc.unsqueeze(-1) * vc, upper=False, unitriangular=True)
        Vp = U - W @ S                                                        # V' = U - W S
        Aqk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, E)               # j <= i
        out.append(scale * ((qc * eG) @ S + Aqk @ Vp))
        Gc = G[:, :, -1:]                                                     # G_C
        S = torch.exp(Gc).transpose(-1, -2) * S + (kc * torch.exp(Gc - G)).transpose(-1, -2) @ Vp
    return torch.cat(out, 2).transpose(1, 2)


# ---------------------------------------------------------------- layers


class KDA(nn.Module):
    """src/model/kda_layer.c: projections, causal depthwise conv + SiLU (+ L2 norm
    of q and k), beta = sigmoid(W_beta x), the bounded gate, the operator, head
    RMSNorm with o_norm, output gate sigmoid(W_g x), W_o."""

    def __init__(self, cfg, impl):
        super().__init__()
        d, H, K, W = cfg.model_d_model, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_width
        self.H, self.K, self.W, self.impl, self.cfg = H, K, W, impl, cfg
        for name in ("W_q", "W_k", "W_v", "W_z"):
            setattr(self, name, param(H * K, d))
        for name in ("conv_q", "conv_k", "conv_v"):
            setattr(self, name, param(H * K, W))
        self.W_beta = param(H, d)
        self.A_log = param(H)
        self.dt_bias = param(H * K)
        self.W_g = param(H * K, d)
        self.o_norm = param(K)
        self.W_o = param(d, H * K)

    def conv_silu(self, x, w):
        # out[t,c] = sum_i w[c,i] x[t-(W-1)+i, c]: conv1d over the left-padded sequence
        xt = F.pad(x.transpose(1, 2), (self.W - 1, 0))
        return F.silu(F.conv1d(xt, w.to(x.dtype).unsqueeze(1), groups=w.shape[0]).transpose(1, 2))

    def forward(self, x):
        B, T, _ = x.shape
        H, K, cfg = self.H, self.K, self.cfg
        q = self.conv_silu(F.linear(x, self.W_q), self.conv_q).view(B, T, H, K)
        k = self.conv_silu(F.linear(x, self.W_k), self.conv_k).view(B, T, H, K)
        v = self.conv_silu(F.linear(x, self.W_v), self.conv_v).view(B, T, H, K)
        z = F.linear(x, self.W_z).view(B, T, H, K)
        with torch.autocast(x.device.type, enabled=False):
            beta = torch.sigmoid(F.linear(x.float(), self.W_beta.float()))  # fp32
        scale = K ** -0.5
        if self.impl == "fla":
            from fla.ops.kda import chunk_kda
            bounded = cfg.kda_gate == "bounded"
            o, _ = chunk_kda(q, k, v, z, beta.to(q.dtype), scale=scale, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, safe_gate=bounded,
                             lower_bound=float(cfg.kda_g_min) if bounded else None,
                             A_log=self.A_log, dt_bias=self.dt_bias, chunk_size=cfg.kda_chunk)
        else:
            qf = q.float()
            kf = k.float()
            qf = qf * torch.rsqrt(qf.pow(2).sum(-1, keepdim=True) + L2_EPS)
            kf = kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + L2_EPS)
            g = kda_gate(z, self.A_log, self.dt_bias, cfg.kda_gate, cfg.kda_g_min)
            if self.impl == "recurrent":
                o = kda_recurrent(qf, kf, v.float(), g, beta, scale)
            else:
                o = kda_chunk_naive(qf, kf, v.float(), g, beta, scale, cfg.kda_chunk)
        o = rms_norm(o, self.o_norm, cfg.model_norm_eps)                   # head RMSNorm
        gated = torch.sigmoid(F.linear(x, self.W_g).float()).view(B, T, H, K) * o.float()
        return F.linear(gated.reshape(B, T, H * K).to(x.dtype), self.W_o)


class MLA(nn.Module):
    """src/model/mla.c, NoPE: q = W_uq RMSNorm(W_dq x); c = RMSNorm(W_dkv x);
    k = W_uk c, v = W_uv c; causal softmax attention (torch SDPA, scale Dk^-1/2);
    y = W_o(sigmoid(W_g x) o). GQA: W_q, W_k, W_v."""

    def __init__(self, cfg):
        super().__init__()
        d, H, Dk, Dv = cfg.model_d_model, cfg.attention_heads, cfg.attention_qk_head_dim, cfg.attention_v_head_dim
        self.cfg, self.H, self.Dk, self.Dv = cfg, H, Dk, Dv
        self.mla = cfg.attention_kind == "mla"
        if self.mla:
            ql, kl = cfg.attention_q_lora_rank, cfg.attention_kv_lora_rank
            self.W_dq, self.q_norm, self.W_uq = param(ql, d), param(ql), param(H * Dk, ql)
            self.W_dkv, self.kv_norm = param(kl, d), param(kl)
            self.W_uk, self.W_uv = param(H * Dk, kl), param(H * Dv, kl)
            self.Hkv = H
        else:
            self.Hkv = cfg.attention_kv_heads
            self.W_q, self.W_k, self.W_v = param(H * Dk, d), param(self.Hkv * Dk, d), param(self.Hkv * Dv, d)
        self.W_g = param(H * Dv, d)
        self.W_o = param(d, H * Dv)

    def forward(self, x):
        B, T, _ = x.shape
        H, Dk, Dv, eps = self.H, self.Dk, self.Dv, self.cfg.model_norm_eps
        if self.mla:
            q = F.linear(rms_norm(F.linear(x, self.W_dq), self.q_norm, eps), self.W_uq)
            c = rms_norm(F.linear(x, self.W_dkv), self.kv_norm, eps)
            k, v = F.linear(c, self.W_uk), F.linear(c, self.W_uv)
        else:
            q, k, v = F.linear(x, self.W_q), F.linear(x, self.W_k), F.linear(x, self.W_v)
        q = q.view(B, T, H, Dk).transpose(1, 2)
        k = k.view(B, T, self.Hkv, Dk).transpose(1, 2)
        v = v.view(B, T, self.Hkv, Dv).transpose(1, 2)
        if self.Hkv != H:  # query head h reads kv head h / (H / Hkv)
            k = k.repeat_interleave(H // self.Hkv, 1)
            v = v.repeat_interleave(H // self.Hkv, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=Dk ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, H * Dv)
        gated = torch.sigmoid(F.linear(x, self.W_g).float()) * o.float()
        return F.linear(gated.to(x.dtype), self.W_o)


class DenseFFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg.model_d_model, cfg.model_dense_ffn
        self.act = cfg.moe_activation
        self.W_gate, self.W_up, self.W_down = param(f, d), param(f, d), param(d, f)

    def forward(self, x):
        return F.linear(glu(F.linear(x, self.W_gate), F.linear(x, self.W_up), self.act), self.W_down)


class MoE(nn.Module):
    """src/ops/moe/moe.c: s = sigmoid(W_r x) in fp32; T_i = top-k of s + b (b
    only selects); p = route_scale s / sum_T s; routed GLU experts (in the
    latent when latent_dim > 0: W_up_lat RMSNorm(sum p E(W_down_lat x)));
    shared experts at full width. Experts run grouped by expert: one
    torch._grouped_mm per weight on a GPU in bf16 (`grouped`), else a loop."""

    def __init__(self, cfg):
        super().__init__()
        d, n, f = cfg.model_d_model, cfg.moe_routed_experts, cfg.moe_expert_ffn
        dl, ns, fs = cfg.moe_latent_dim, cfg.moe_shared_experts, cfg.moe_shared_ffn
        de = dl if dl else d
        self.cfg, self.n, self.k, self.dl, self.ns = cfg, n, cfg.moe_top_k, dl, ns
        self.router = param(n, d)
        self.gate, self.up, self.down = param(n, f, de), param(n, f, de), param(n, de, f)
        if dl:
            self.lat_down, self.lat_norm, self.lat_up = param(dl, d), param(dl), param(d, dl)
        if ns:
            self.shared_gate, self.shared_up, self.shared_down = param(ns, fs, d), param(ns, fs, d), param(ns, d, fs)
        self.register_buffer("bias", torch.zeros(n))
        self.grouped = False
        self.last_scores = None  # s [m, n] of the last forward (for the balancing)

    def experts_grouped(self, xg, offs):
        # xg [m*k, de] sorted by expert; offs [n] int32 cumulative row ends
        wt = torch.bfloat16
        xg = xg.to(wt)
        a = torch._grouped_mm(xg, self.gate.to(wt).transpose(1, 2), offs=offs)
        u = torch._grouped_mm(xg, self.up.to(wt).transpose(1, 2), offs=offs)
        h = glu(a.float(), u.float(), self.cfg.moe_activation).to(wt)
        return torch._grouped_mm(h, self.down.to(wt).transpose(1, 2), offs=offs)

    def experts_loop(self, xg, counts):
        outs, o = [], 0
        for j, c in enumerate(counts.tolist()):
            if c:
                xj = xg[o:o + c]
                outs.append(F.linear(glu(F.linear(xj, self.gate[j]), F.linear(xj, self.up[j]), self.cfg.moe_activation),
                                     self.down[j]))
            o += c
        return torch.cat(outs, 0)

    def forward(self, x):
        B, T, d = x.shape
        m, n, k = B * T, self.n, self.k
        xf = x.reshape(m, d)
        with torch.autocast(x.device.type, enabled=False):
            s = torch.sigmoid(F.linear(xf.float(), self.router.float()))     # router in fp32
            self.last_scores = s.detach()
            sel = torch.topk(s.detach() + self.bias, k, dim=-1).indices        # b only selects
            p = s.gather(1, sel)
            p = p * (self.cfg.moe_route_scale / p.sum(-1, keepdim=True))
        xe = F.linear(xf, self.lat_down) if self.dl else xf
        flat = sel.reshape(-1)                                                 # slot g = i*k + t
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(n, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        xg = xe[order // k]
        if self.grouped:
            yg = self.experts_grouped(xg, torch.cumsum(counts, 0).to(torch.int32))
        else:
            yg = self.experts_loop(xg, counts)
        # back to slot order, weighted sum over each token's k slots
        y_slots = torch.empty_like(yg).index_copy_(0, order, yg).view(m, k, -1)
        z = (y_slots.float() * p.unsqueeze(-1)).sum(1)
        if self.dl:
            y = F.linear(rms_norm(z, self.lat_norm, self.cfg.model_norm_eps).to(xe.dtype), self.lat_up)
        else:
            y = z.to(xe.dtype)
        for e in range(self.ns):
            y = y + F.linear(glu(F.linear(xf, self.shared_gate[e]), F.linear(xf, self.shared_up[e]),
                                 self.cfg.moe_activation), self.shared_down[e])
        return y.view(B, T, d)


class Layer(nn.Module):
    def __init__(self, cfg, l, impl):
        super().__init__()
        d = cfg.model_d_model
        self.mixer_norm, self.ffn_norm = param(d), param(d)
        self.kind = cfg.mixer(l)
        if self.kind == "kda":
            self.kda = KDA(cfg, impl)
        else:
            self.mla = MLA(cfg)
        if cfg.is_moe(l):
            self.moe = MoE(cfg)
        else:
            self.ffn = DenseFFN(cfg)


class AttnResParams(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n = 2 * cfg.model_n_layers + 1
        self.query, self.key_norm = param(n, cfg.model_d_model), param(n, cfg.model_d_model)


class Model(nn.Module):
    """Embedding, 2L pre-norm sublayers joined by the residual of the config
    (standard, Block or Full AttnRes), final AttnRes + RMSNorm, LM head, mean
    cross-entropy computed `ce_chunk` rows at a time (each chunk's logits are
    recomputed in the backward: no [B*T, V] logits are kept)."""

    def __init__(self, cfg, impl="naive"):
        super().__init__()
        d, V = cfg.model_d_model, cfg.model_vocab_size
        self.cfg = cfg
        self.embed = param(V, d)
        self.layers = nn.ModuleList(Layer(cfg, l, impl) for l in range(cfg.model_n_layers))
        self.residual = cfg.residual_kind
        if self.residual != "standard":
            self.attnres = AttnResParams(cfg)
        self.final_norm = param(d)
        if not cfg.model_tie_embeddings:
            self.lm_head = param(V, d)
        self.recompute = False
        self.ce_chunk = 8192

    def head(self):
        return self.embed if self.cfg.model_tie_embeddings else self.lm_head

    def attnres_mix(self, sources, l):
        """h = sum_i softmax_i(r_i (w_l g_l) . v_i) v_i, r_i = RMS(v_i)^-1 (docs/attnres.md)."""
        if len(sources) == 1:
            return sources[0]
        Vs = torch.stack(sources, 0)                                            # [S, B, T, d] fp32
        u = self.attnres.query[l] * self.attnres.key_norm[l]
        r = torch.rsqrt(Vs.pow(2).mean(-1) + self.cfg.model_norm_eps)
        alpha = torch.softmax(r * (Vs @ u.float()), 0)
        return (alpha.unsqueeze(-1) * Vs).sum(0)

    def sublayer(self, layer, idx, h):
        x = rms_norm(h, layer.mixer_norm if idx % 2 == 0 else layer.ffn_norm, self.cfg.model_norm_eps)
        if torch.is_autocast_enabled():
            x = x.to(torch.bfloat16)  # the products run in bf16 (the only autocast dtype used here)
        if idx % 2 == 0:
            y = layer.kda(x) if layer.kind == "kda" else layer.mla(x)
        else:
            y = layer.moe(x) if hasattr(layer, "moe") else layer.ffn(x)
        return y.float()

    def hidden(self, tokens):
        """Final normalised hidden states [B,T,d] (fp32)."""
        e = F.embedding(tokens, self.embed).float()
        L2 = 2 * self.cfg.model_n_layers
        S = {"standard": L2, "block_attnres": self.cfg.residual_block_sublayers, "full_attnres": 1}[self.residual]
        blocks, partial = [], None                  # completed block sums; the open block's sum
        for idx in range(L2):
            if self.residual == "standard":
                h = e if partial is None else e + partial
            else:
                h = self.attnres_mix([e] + blocks + ([partial] if partial is not None else []), idx)
            layer = self.layers[idx // 2]
            if self.recompute and torch.is_grad_enabled():
                y = activation_checkpoint(self.sublayer, layer, idx, h, use_reentrant=False)
            else:
                y = self.sublayer(layer, idx, h)
            partial = y if partial is None else partial + y
            if (idx + 1) % S == 0 and self.residual != "standard":
                blocks.append(partial)
                partial = None
        if self.residual == "standard":
            hf = e + partial
        else:
            if partial is not None:
                blocks.append(partial)               # the last, shorter block closes
            hf = self.attnres_mix([e] + blocks, L2)
        return rms_norm(hf, self.final_norm, self.cfg.model_norm_eps)

    def loss(self, tokens, targets):
        hn = self.hidden(tokens).reshape(-1, self.cfg.model_d_model)
        t = targets.reshape(-1)
        W = self.head()
        total = hn.new_zeros(())
        for r0 in range(0, hn.shape[0], self.ce_chunk):
            rows = slice(r0, r0 + self.ce_chunk)
            if torch.is_grad_enabled():
                total = total + activation_checkpoint(chunk_ce_sum, hn[rows], W, t[rows], use_reentrant=False)
            else:
                total = total + chunk_ce_sum(hn[rows], W, t[rows])
        return total / hn.shape[0]

    def token_logprobs(self, tokens, targets):
        hn = self.hidden(tokens)
        logits = F.linear(hn, self.head()).float()
        return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunk_ce_sum(hn, W, t):
    """Sum of the cross-entropy of a chunk of rows; log-sum-exp in fp32."""
    logits = F.linear(hn.to(torch.bfloat16) if torch.is_autocast_enabled() else hn, W)
    return F.cross_entropy(logits.float(), t, reduction="sum")


# ---------------------------------------------------------------- weights


def load_checkpoint(model, ckpt):
    """Weights of model.safetensors and the biases of trainer.safetensors."""
    from safetensors.torch import load_file
    w = load_file(os.path.join(ckpt, "model.safetensors"))
    tr = load_file(os.path.join(ckpt, "trainer.safetensors"))
    sd = model.state_dict()
    missing = [n for n in sd if n not in w and not (n.endswith(".moe.bias") and n in tr)]
    extra = [n for n in w if n not in sd]
    if missing or extra:
        raise SystemExit(f"model_vs_torch: names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in sd.items():
        src = w[name] if name in w else tr[name]
        if tuple(src.shape) != tuple(t.shape):
            raise SystemExit(f"model_vs_torch: {name}: checkpoint shape {tuple(src.shape)}, model {tuple(t.shape)}")
        with torch.no_grad():
            t.copy_(src.to(t.dtype))


def init_random(model, seed):
    """docs/model.md's initialisation (the shape of it; not longmoe's random stream)."""
    g = torch.Generator().manual_seed(seed)
    L = model.cfg.model_n_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("norm") or leaf in ("key_norm", "final_norm"):
                p.fill_(1.0)
            elif leaf in ("query", "A_log"):
                p.zero_()
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=g) - 3.0)
            elif leaf.startswith("conv_"):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif leaf == "embed":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                std = 1.0 / math.sqrt(p.shape[-1])
                if leaf in ("W_o", "down", "W_down", "lat_up", "shared_down"):
                    std /= math.sqrt(2 * L)
                p.copy_(torch.randn(p.shape, generator=g) * std)


# ---------------------------------------------------------------- quantile balancing


@torch.no_grad()
def quantile_balance(moe):
    """SPEC §4 steps 2-5 on the last forward's scores, exact quantiles (the
    `exact` estimator): alpha_i = (k+1)-th largest s_i + b; r_ij = alpha_i - s_ij;
    b_j = the ceil(m k / n)-th smallest r_:j; b -= mean(b)."""
    s = moe.last_scores
    if s is None:
        return
    m, n, k = s.shape[0], moe.n, moe.k
    alpha = torch.topk(s + moe.bias, k + 1, dim=-1).values[:, k:k + 1]
    r = alpha - s
    q = min(m, max(1, math.ceil(m * k / n)))
    b = torch.kthvalue(r, q, dim=0).values
    moe.bias.copy_(b - b.mean())


# ---------------------------------------------------------------- FLOPs


def kda_chunk_flops_per_token(H, D, C):
    """Forward FLOPs per token of the chunked KDA operator's matrix products
    (SPEC §2, K = V = D, chunk C), per chunk of C tokens and head: Akk, Aqk,
    W = M(K e^G), U = M V, Aqk V' (C x C x D each: 5 * 2 C^2 D), W S, Q S and
    the state update (C x D x D each: 3 * 2 C D^2), the triangular inverse
    (C^3 / 3 multiply-adds). Divided by C: per token."""
    return H * (10.0 * C * D + 6.0 * D * D + 2.0 * C * C / 3.0)


def training_flops_per_token(model, T):
    """6 N_active + causal attention + KDA operator, forward + backward = 3x
    forward for the last two. N_active: every parameter a token passes except
    the embedding lookup (routed experts counted k/n; the LM head once)."""
    cfg = model.cfg
    n_active = 0.0
    for name, p in model.named_parameters():
        if name == "embed" and not cfg.model_tie_embeddings:
            continue
        frac = cfg.moe_top_k / cfg.moe_routed_experts if name.split(".")[-1] in ("gate", "up", "down") and ".moe." in name else 1.0
        n_active += p.numel() * frac
    attn = kda = 0.0
    for l in range(cfg.model_n_layers):
        if cfg.mixer(l) == "mla":
            # QK^T and PV: 2 (Dk + Dv) H per key, (T + 1) / 2 keys per query on average
            attn += 3 * 2 * cfg.attention_heads * (cfg.attention_qk_head_dim + cfg.attention_v_head_dim) * (T + 1) / 2
        else:
            kda += 3 * kda_chunk_flops_per_token(cfg.kda_heads, cfg.kda_head_dim, cfg.kda_chunk)
    return 6 * n_active + attn + kda, n_active


# ---------------------------------------------------------------- modes


def parse_shape(s):
    B, T = (int(x) for x in s.split(","))
    return B, T


def resolve_checkpoint(path):
    """A checkpoint directory, or a run directory's latest checkpoint."""
    if os.path.exists(os.path.join(path, "latest")) and not os.path.exists(os.path.join(path, "model.safetensors")):
        return os.path.join(path, open(os.path.join(path, "latest")).read().strip())
    return path


def load_model(ckpt, kda, device="cpu"):
    model = Model(Config(os.path.join(ckpt, "config.json")), kda).to(device)
    load_checkpoint(model, ckpt)
    return model


def random_batch(cfg, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    V = cfg.model_vocab_size
    return (torch.randint(0, V, (B, T), dtype=torch.int32, generator=g),
            torch.randint(0, V, (B, T), dtype=torch.int32, generator=g))


@torch.no_grad()
def torch_loss(model, tokens, targets, device="cpu"):
    """(mean cross-entropy, per-token log-probabilities [B*T]) of the peer."""
    tok, tgt = tokens.long().to(device), targets.long().to(device)
    return model.loss(tok, tgt).item(), model.token_logprobs(tok, tgt).cpu().reshape(-1)


def longmoe_loss(binary, ckpt, tokens, targets):
    """(loss, log-probabilities [B*T]) of bench_checkpoint_loss on the same batch."""
    B, T = tokens.shape
    with tempfile.TemporaryDirectory() as tmp:
        tok_path, lp_path = os.path.join(tmp, "batch.i32"), os.path.join(tmp, "logp.f32")
        with open(tok_path, "wb") as f:
            f.write(struct.pack(f"<{2 * B * T}i", *(tokens.reshape(-1).tolist() + targets.reshape(-1).tolist())))
        out = subprocess.run([binary, ckpt, tok_path, str(B), str(T), lp_path], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"model_vs_torch: {binary} failed: {out.stderr.strip()}")
        ref = torch.tensor(struct.unpack(f"<{B * T}f", open(lp_path, "rb").read()))
    return json.loads(out.stdout)["loss"], ref


def cmd_check(args):
    ckpt = resolve_checkpoint(args.checkpoint)
    model = load_model(ckpt, args.kda, args.device)
    B, T = parse_shape(args.batch)
    tokens, targets = random_batch(model.cfg, B, T, args.seed)
    loss, logp = torch_loss(model, tokens, targets, args.device)
    result = {"checkpoint": ckpt, "kda": args.kda, "B": B, "T": T, "loss_torch": loss}
    if args.longmoe:
        ours, ref = longmoe_loss(args.longmoe, ckpt, tokens, targets)
        result["loss_longmoe"] = ours
        result["abs_diff"] = abs(loss - ours)
        result["rel_diff"] = result["abs_diff"] / abs(ours)
        result["max_logprob_diff"] = (logp.double() - ref.double()).abs().max().item()
        result["ok"] = result["abs_diff"] <= args.tol
    print(json.dumps(result))
    return 0 if result.get("ok", True) else 1


def cmd_bench(args):
    """bench_steps, with an out-of-memory recorded as a result."""
    try:
        return bench_steps(args)
    except torch.cuda.OutOfMemoryError:
        B, T = parse_shape(args.shape)
        res = {"config": args.config, "B": B, "T": T, "kda": args.kda, "compile": args.compile,
               "recompute": args.recompute, "experts": args.experts, "optimizer": args.optimizer,
               "error": "out of memory"}
        print(json.dumps(res))
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(res) + "\n")
        return 1


def bench_steps(args):
    cfg = Config(args.config)
    dev = torch.device(args.device)
    model = Model(cfg, args.kda).to(dev)
    init_random(model, args.seed)
    model.recompute = args.recompute
    model.ce_chunk = args.ce_chunk
    for mod in model.modules():
        if isinstance(mod, MoE):
            mod.grouped = args.experts == "grouped"
    B, T = parse_shape(args.shape)
    V = cfg.model_vocab_size
    fused = dev.type == "cuda"
    opt = None
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)

    def opt_zero():
        for p in model.parameters():
            p.grad = None
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not args.fp32)
    loss_fn = torch.compile(model.loss) if args.compile else model.loss
    moes = [mod for mod in model.modules() if isinstance(mod, MoE)]
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    def step():
        tok = torch.randint(0, V, (B, T + 1), device=dev, generator=gen)
        with amp:
            loss = loss_fn(tok[:, :-1], tok[:, 1:])
        loss.backward()
        if opt is not None:
            opt.step()
        opt_zero()
        if cfg.moe_balance == "quantile":
            for mod in moes:
                quantile_balance(mod)
        return loss

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t_start = time.perf_counter()
    for i in range(args.warmup):
        step()
        sync()
        # the first steps compile (Triton autotuning, torch.compile): say how long each took
        print(f"warm-up step {i + 1}/{args.warmup}: {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    flops_tok, n_active = training_flops_per_token(model, T)
    toks = B * T / dt
    res = {"config": args.config, "B": B, "T": T, "kda": args.kda, "compile": args.compile,
           "recompute": args.recompute, "experts": args.experts, "optimizer": args.optimizer, "device": torch.cuda.get_device_name() if
           dev.type == "cuda" else "cpu", "torch": torch.__version__, "step_s": dt, "tokens_per_s": toks,
           "n_active": n_active, "flops_per_token": flops_tok, "mfu": toks * flops_tok / H200_BF16_FLOPS,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else None,
           "loss_last": loss.item()}
    text = json.dumps(res)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def cmd_compare(args):
    """Table of bench_cuda_model results (--ours) and peer results (--peer), same
    config and shape; every MFU with the peer's FLOPs per token."""
    load = lambda paths: [json.load(open(p)) for p in paths if os.path.exists(p)]
    ours, peers = load(args.ours), load(args.peer)
    print("| shape | who | variant | tokens/s | MFU | peak GiB | longmoe / this |")
    print("|---|---|---|---|---|---|---|")
    for o in ours:
        same = [p for p in peers if (p["B"], p["T"]) == (o["B"], o["T"])]
        fpt = same[0]["flops_per_token"] if same else None
        mfu = f"{100 * o['tokens_per_s'] * fpt / H200_BF16_FLOPS:.1f}%" if fpt else "-"
        rc = {0: "off", 1: "on", 2: "channel", 3: "token"}.get(o["recompute"], o["recompute"])
        print(f"| {o['B']}x{o['T']} | longmoe | recompute {rc} | {o['tokens_per_s']:.0f} | {mfu} | "
              f"{o['device_gib']:.1f} (in use) | 1 |")
        for p in same:
            var = (f"kda {p['kda']}, {'compiled' if p['compile'] else 'eager'}, "
                   f"recompute {int(p['recompute'])}, experts {p['experts']}, optimizer {p['optimizer']}")
            if p.get("error"):
                print(f"| {o['B']}x{o['T']} | peer | {var} | - | - | - | {p['error']} |")
                continue
            print(f"| {o['B']}x{o['T']} | peer | {var} | {p['tokens_per_s']:.0f} | {100 * p['mfu']:.1f}% | "
                  f"{p['peak_mem_gib'] or 0:.1f} | {o['tokens_per_s'] / p['tokens_per_s']:.2f} |")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("check", help="loss of a checkpoint here and in longmoe")
    c.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: its latest)")
    c.add_argument("--kda", choices=["naive", "recurrent", "fla"], default="naive")
    c.add_argument("--batch", default="2,128", help="B,T of the random batch")
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--longmoe", default="build-cpu/bench_checkpoint_loss",
                   help="bench_checkpoint_loss executable ('' : print the loss here only)")
    c.add_argument("--device", default="cpu")
    c.add_argument("--tol", type=float, default=1e-4, help="largest accepted |loss difference|")
    b = sub.add_parser("bench", help="training steps: tokens/s, MFU, peak memory")
    b.add_argument("--config", required=True)
    b.add_argument("--shape", default="8,4096", help="B,T")
    b.add_argument("--kda", choices=["naive", "recurrent", "fla"], default="fla")
    b.add_argument("--experts", choices=["grouped", "loop"], default="grouped")
    b.add_argument("--compile", action="store_true")
    b.add_argument("--recompute", action="store_true", help="activation checkpointing per sublayer")
    b.add_argument("--optimizer", choices=["adamw", "none"], default="adamw",
                   help="none: forward + backward only (as bench_cuda_model times longmoe)")
    b.add_argument("--fp32", action="store_true", help="no bf16 autocast (CPU runs)")
    b.add_argument("--ce-chunk", type=int, default=8192, help="rows of logits at a time")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--lr", type=float, default=3e-4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--autotune-ms", help="W,R: Triton autotuning warm-up and timing budget per candidate (ms)")
    b.add_argument("--out")
    cp = sub.add_parser("compare", help="table of longmoe and peer bench JSON files")
    cp.add_argument("--ours", nargs="*", default=[], help="bench_cuda_model --out files")
    cp.add_argument("--peer", nargs="*", default=[], help="model_vs_torch.py bench --out files")
    args = ap.parse_args()
    if getattr(args, "autotune_ms", None):
        try:
            w, r = (int(x) for x in args.autotune_ms.split(","))
            if w < 1 or r < 1:
                raise ValueError
        except ValueError:
            ap.error(f"--autotune-ms wants two positive integers W,R (got {args.autotune_ms!r})")
        from kda_vs_fla import shorten_autotuning  # the one copy, beside this file

        shorten_autotuning(w, r)
    return {"check": cmd_check, "bench": cmd_bench, "compare": cmd_compare}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
