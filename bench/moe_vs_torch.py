#!/usr/bin/env python3
"""The PyTorch peer of the MoE layer (docs/moe.md "The PyTorch peer").

The layer of include/longmoe/moe.h written with torch ops and torch._grouped_mm,
forward and backward by autograd, and quantile balancing's histogram update
(SPEC §4, src/ops/balance/balance.c) in torch ops on the device:

    python3 bench/moe_vs_torch.py --check --longmoe build-cpu/longmoe
        small shapes on the CPU against `longmoe op moe --backward` (y, dx and
        every parameter gradient) and `longmoe op route --bias-update quantile`
        (the balancing update of b)
    python3 bench/moe_vs_torch.py [--tokens M]... [--reps N] [--out torch.json]
                                  [--ours ours.json]... [--no-compile] [--unfused]
        the k3-mini MoE layer on the GPU (default 32768 and 65536 tokens), eager
        and torch.compile: medians of forward and forward+backward+balancing (ms,
        CUDA events), the routed products' TFLOP/s, the grouped products alone;
        --ours takes bench_cuda_moe's --out files and prints the ratios (its fastest kind, then each kind).

Precision as in longmoe's GPU layer: the router W_r x, sigmoid, top-k, the
weights p, the latent RMSNorm (statistics and weight) and the weighted sum in
fp32; every other product has bf16 operands (copies of fp32 master weights,
made once outside the timed step, as bench_cuda_moe uploads its bf16 copy
once) with fp32 accumulation. Every GPU run starts by checking the grouped
path against a loop over experts with plain matmuls on a small shape."""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import torch

BF = torch.bfloat16
NAMES = ["router", "gate", "up", "down", "lat_down", "lat_norm", "lat_up",
         "shared_gate", "shared_up", "shared_down"]
FP32_NAMES = {"router", "lat_norm"}  # read in fp32 (the master) by longmoe too


class Config:
    def __init__(self, d, n, k, f, d_lat=0, n_shared=0, f_s=0, act="situ", route_scale=1.0,
                 eps=1e-6, bins=1000):
        self.d, self.n, self.k, self.f = d, n, k, f
        self.d_lat, self.n_shared, self.f_s = d_lat, n_shared, f_s
        self.act, self.route_scale, self.eps, self.bins = act, route_scale, eps, bins

    @property
    def de(self):
        return self.d_lat if self.d_lat > 0 else self.d

    def shapes(self):
        d, n, f, de, dl, ns, fs = self.d, self.n, self.f, self.de, self.d_lat, self.n_shared, self.f_s
        s = {"router": (n, d), "gate": (n, f, de), "up": (n, f, de), "down": (n, de, f)}
        if dl:
            s.update(lat_down=(dl, d), lat_norm=(dl,), lat_up=(d, dl))
        if ns:
            s.update(shared_gate=(ns, fs, d), shared_up=(ns, fs, d), shared_down=(ns, d, fs))
        return s


K3_MINI = dict(d=1024, n=128, k=8, f=512, d_lat=512, n_shared=1, f_s=1024, act="situ")


def init_params(cfg, gen, device, scale=0.03):
    p = {}
    for name, shape in cfg.shapes().items():
        p[name] = scale * torch.randn(shape, generator=gen, dtype=torch.float32).to(device)
    if "lat_norm" in p:
        p["lat_norm"] = 1.0 + 0.1 * torch.randn(cfg.d_lat, generator=gen).to(device)
    return p


def operands(master, dtype, fused):
    """The layer's operands: fp32 router and norm weight, the rest in dtype.
    fused: gate and up as one [n, 2f, d_e] weight (a in rows 0..f-1 of each
    expert, u in rows f..2f-1), one grouped product instead of two."""
    ops = {}
    for name, w in master.items():
        ops[name] = w.detach().clone() if name in FP32_NAMES else w.detach().to(dtype)
    if fused:
        ops["gate_up"] = torch.cat([ops.pop("gate"), ops.pop("up")], dim=1).contiguous()
    for w in ops.values():
        w.requires_grad_(True)
    return ops


def split_grads(grads, cfg):
    """Gradients named as longmoe's outputs (dgate and dup from the fused weight)."""
    out = {}
    for name, g in grads.items():
        if name == "gate_up":
            out["gate"], out["up"] = g[:, :cfg.f], g[:, cfg.f:]
        else:
            out[name] = g
    return out


def act_fn(kind, a, u):
    """moe.h: SwiGLU silu(a) u; SiTU-GLU 4 tanh(a/4) sigmoid(a) 25 tanh(u/25). fp32."""
    if kind == "situ":
        return 4.0 * torch.tanh(0.25 * a) * torch.sigmoid(a) * 25.0 * torch.tanh(u / 25.0)
    return torch.nn.functional.silu(a) * u


def grouped_loop(xg, w, offs):
    """Reference grouped product: rows offs[j-1]..offs[j]-1 times w[j]^T, one
    plain matmul per expert (reads offs on the host)."""
    out = xg.new_zeros(xg.shape[0], w.shape[1])
    ends = offs.tolist()
    start = 0
    for j, end in enumerate(ends):
        if end > start:
            out[start:end] = xg[start:end] @ w[j].transpose(0, 1)
        start = end
    return out


def grouped_torch(xg, w, offs):
    """torch._grouped_mm: xg [rows, K] by w [n, N, K] per group -> [rows, N]."""
    return torch._grouped_mm(xg, w.transpose(-2, -1), offs=offs)


def routed_products(xg, ws, down, offs, f, douts=None):
    """The routed experts' products alone, as the layer runs them: xg by the
    gate/up weights (ws: [gate_up] fused, or [gate, up]), then the first f
    columns (the gate's output standing for the hidden h) by down. With douts
    (the gradients of those outputs) also the backward's products, each input
    gradient dA = dC W and weight gradient dW_j = dC_j^T A_j, the layouts
    autograd uses for torch._grouped_mm. Returns the outputs (forward) or
    the gradients [dxg, dws..., ddown]."""
    outs = [grouped_torch(xg, w, offs) for w in ws]
    h = outs[0][:, :f].contiguous() if len(ws) == 1 else outs[0]
    outs.append(grouped_torch(h, down, offs))
    if douts is None:
        return outs
    dxg = None
    grads = []
    for w, do in zip(ws, douts):
        part = torch._grouped_mm(do, w, offs=offs)
        dxg = part if dxg is None else dxg + part
        grads.append(torch._grouped_mm(do.transpose(0, 1), xg, offs=offs))
    ddown = torch._grouped_mm(douts[-1].transpose(0, 1), h, offs=offs)
    dh = torch._grouped_mm(douts[-1], down, offs=offs)
    return [dxg, dh] + grads + [ddown]


def route(x, ops, b, cfg):
    """fp32 router. Returns s [m,n], the k+1 largest s + b (values, indices:
    the first k are the selection, the (k+1)-th is alpha, the balancing
    threshold) and p [m,k] (autograd reaches W_r through p only)."""
    s = torch.sigmoid(x @ ops["router"].transpose(0, 1))
    kk = cfg.k + 1 if cfg.k < cfg.n else cfg.k
    with torch.no_grad():
        val, idx = torch.topk(s + b, kk, dim=1, sorted=True)
    sel = torch.gather(s, 1, idx[:, :cfg.k])
    p = cfg.route_scale * sel / sel.sum(dim=1, keepdim=True)
    return s, val, idx, p


def group(topk, cfg, align):
    """Stable sort of the m k (token, slot) pairs by expert, each expert's rows
    padded to a multiple of align (static capacity m k + n (align - 1), so
    the shapes do not depend on the routing). Returns, per (token, slot) in
    slot order i k + t, its padded row; the padded end offsets [n] (int32,
    for grouped_mm); the loads [n]; the number of row slots."""
    m = topk.shape[0]
    n, k = cfg.n, cfg.k
    flat = topk[:, :k].reshape(-1)
    order = torch.argsort(flat, stable=True)                       # grouped row -> slot
    load = torch.zeros(n, dtype=torch.int64, device=flat.device)
    load.scatter_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(load, 0)
    padded = (load + align - 1) // align * align
    pends = torch.cumsum(padded, 0)
    pstarts = pends - padded
    e_sorted = flat[order]
    rank = torch.arange(m * k, device=flat.device) - (ends - load)[e_sorted]
    row_of_slot = torch.empty_like(order)
    row_of_slot[order] = pstarts[e_sorted] + rank
    return row_of_slot, pends.to(torch.int32), load, m * k + n * (align - 1)


def rms_norm(z, w, eps):
    return z * torch.rsqrt(z.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def glu_dense(xb, wg, wu, wd, kind, dtype):
    a = (xb @ wg.transpose(0, 1)).float()
    u = (xb @ wu.transpose(0, 1)).float()
    h = act_fn(kind, a, u).to(dtype)
    return (h @ wd.transpose(0, 1)).float()


def moe_forward(x, b, ops, cfg, gemm, align, dtype):
    """y [m,d] fp32 from x [m,d] fp32. Also returns s (for balancing), the
    (k+1) largest s + b and the loads. gemm: grouped_torch or grouped_loop."""
    m = x.shape[0]
    k, de = cfg.k, cfg.de
    s, val, idx, p = route(x, ops, b, cfg)
    row_of_slot, offs, load, rows = group(idx, cfg, align)
    xb = x.to(dtype)
    xe = xb @ ops["lat_down"].transpose(0, 1) if cfg.d_lat else xb
    # expert inputs in grouped rows; padding rows are zero
    src = torch.arange(m, device=x.device).repeat_interleave(k)
    xg = xe.new_zeros(rows, de).index_copy(0, row_of_slot, xe[src])
    if "gate_up" in ops:
        au = gemm(xg, ops["gate_up"], offs).float()
        a, u = au[:, :cfg.f], au[:, cfg.f:]
    else:
        a = gemm(xg, ops["gate"], offs).float()
        u = gemm(xg, ops["up"], offs).float()
    h = act_fn(cfg.act, a, u).to(dtype)
    eo = gemm(h, ops["down"], offs)
    # weighted sum in fp32, in slot order
    z = (eo[row_of_slot].float().view(m, k, de) * p.unsqueeze(-1)).sum(dim=1)
    if cfg.d_lat:
        zn = rms_norm(z, ops["lat_norm"], cfg.eps).to(dtype)
        y = (zn @ ops["lat_up"].transpose(0, 1)).float()
    else:
        y = z
    for e in range(cfg.n_shared):
        y = y + glu_dense(xb, ops["shared_gate"][e], ops["shared_up"][e], ops["shared_down"][e],
                          cfg.act, dtype)
    return y, s, val, load


@torch.no_grad()
def balance_update(s, val, b, cfg):
    """SPEC §4 steps 2-5 with the K3 histogram (balance.c): alpha_i = the
    (k+1)-th largest s_i + b; per expert j a histogram of r_ij = alpha_i - s_ij
    over B bins on [min b - 1, max b + 1]; b_j = the m k / n quantile by the
    K3 interpolation; then centred. Returns the new b (fp32) and the counts."""
    m, n, k, B = s.shape[0], cfg.n, cfg.k, cfg.bins
    alpha = val[:, k]
    bmin, bmax = b.min(), b.max()
    lo = bmin - 1.0
    width = (bmax - bmin + 2.0) / B
    inv = 1.0 / width
    xb = (alpha.unsqueeze(1) - s - lo) * inv
    # as the C loop: x < 0 -> bin 0, x >= B -> bin B-1, else (int)x
    bins = torch.where(xb < 0, 0.0, torch.where(xb >= B, B - 1.0, torch.floor(xb))).to(torch.int64)
    key = bins + B * torch.arange(n, device=s.device)
    counts = torch.zeros(n * B, dtype=torch.int64, device=s.device)
    counts.scatter_add_(0, key.reshape(-1), torch.ones_like(key).reshape(-1))
    counts = counts.view(n, B)
    q = m * k / n
    cum = torch.cumsum(counts, dim=1)
    ell = torch.argmax((cum >= math.ceil(q)).to(torch.int32), dim=1)   # first bin reaching ceil(q)
    h = counts.gather(1, ell.unsqueeze(1)).squeeze(1).double()
    before = cum.gather(1, ell.unsqueeze(1)).squeeze(1).double() - h
    frac = ((q - before) / h).clamp(0.0, 1.0)
    new = (lo.double() + (ell.double() + frac) * width.double()).float()
    mean = (new.double().sum() / n).float()
    return new - mean, counts


def reference_results(x, b, dy, master, cfg, gemm, align, dtype, fused):
    ops = operands(master, dtype, fused)
    xx = x.detach().clone().requires_grad_(True)
    y, s, val, load = moe_forward(xx, b, ops, cfg, gemm, align, dtype)
    names = list(ops)
    grads = torch.autograd.grad(y, [xx] + [ops[nm] for nm in names], dy)
    g = split_grads(dict(zip(names, grads[1:])), cfg)
    return y.detach(), grads[0], g, s.detach(), val, load


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ the check

def run_longmoe(exe, args):
    r = subprocess.run([exe] + args, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{exe} {' '.join(args)} failed:\n{r.stdout}{r.stderr}")


def check_case(exe, tmp, cfg, m, seed, have_grouped):
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    master = init_params(cfg, gen, "cpu", scale=0.2)
    x = torch.randn(m, cfg.d, generator=gen)
    dy = torch.randn(m, cfg.d, generator=gen)
    b = 0.05 * torch.randn(cfg.n, generator=gen)
    inp, out, rin, rout = (os.path.join(tmp, f) for f in ("in.st", "out.st", "rin.st", "rout.st"))
    save_file(dict(x=x, dy=dy, b=b, **master), inp,
              metadata={"top_k": str(cfg.k), "act": cfg.act, "route_scale": repr(cfg.route_scale),
                        "eps": repr(cfg.eps)})
    run_longmoe(exe, ["op", "moe", "--in", inp, "--out", out, "--backward"])
    lm = load_file(out)
    tag = (f"m {m} d {cfg.d} n {cfg.n} k {cfg.k} f {cfg.f} lat {cfg.d_lat} shared {cfg.n_shared}x{cfg.f_s} "
           f"{cfg.act} scale {cfg.route_scale}")
    worst = {}
    paths = [("loop", grouped_loop, 1, torch.float32, False), ("loop", grouped_loop, 8, torch.float32, True),
             ("loop", grouped_loop, 8, BF, True)]
    if have_grouped:
        paths += [("grouped", grouped_torch, 8, torch.float32, False), ("grouped", grouped_torch, 8, BF, True)]
    for gname, gemm, align, dtype, fused in paths:
        y, dx, g, s, val, load = reference_results(x, b, dy, master, cfg, gemm, align, dtype, fused)
        # routing: the same experts (the selection is a set; torch.topk's order of exact ties is free)
        _, _, idx, _ = route(x, {"router": master["router"]}, b, cfg)
        same = (idx[:, :cfg.k].sort(1).values == lm["topk"].long().sort(1).values).all().item()
        if not same:
            sys.exit(f"FAIL {tag}: the chosen experts differ from longmoe's")
        if not torch.equal(load, lm["load"].long()):
            sys.exit(f"FAIL {tag}: loads differ")
        errs = {"y": rel_err(y, lm["y"]), "dx": rel_err(dx, lm["dx"])}
        for name in master:
            errs["d" + name] = rel_err(g[name], lm["d" + name])
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        bad = {kname: e for kname, e in errs.items() if not e < tol}
        label = f"{gname} align {align} {'fused' if fused else 'gate,up'} {str(dtype)[6:]}"
        print(f"  {label:34s} max rel err {max(errs.values()):.2e} (tol {tol:g})"
              f"  worst {max(errs, key=errs.get)}")
        if bad:
            sys.exit(f"FAIL {tag} [{label}]: {bad}")
        worst[label] = max(errs.values())
    # balancing: one quantile update of b on longmoe's scores, against `op route`
    s = lm["s"]
    save_file(dict(s=s, b=b), rin)
    run_longmoe(exe, ["op", "route", "--in", rin, "--out", rout, "--k", str(cfg.k),
                      "--bias-update", "quantile", "--bins", str(cfg.bins)])
    ref_b = load_file(rout)["b"]
    val, _ = torch.topk(s + b, cfg.k + 1, dim=1)
    new_b, counts = balance_update(s, val, b, cfg)
    db = (new_b - ref_b).abs().max().item()
    print(f"  balancing update of b: max |b_torch - b_longmoe| = {db:.2e}"
          f" (bin width {(b.max() - b.min() + 2).item() / cfg.bins:.1e})")
    if not db <= 1e-6:
        sys.exit(f"FAIL {tag}: balancing update differs by {db}")
    if counts.sum().item() != m * cfg.n:
        sys.exit(f"FAIL {tag}: the histograms do not count every token once per expert")
    print(f"ok {tag}")
    return worst


def grouped_available(device):
    try:
        xg = torch.randn(32, 16, device=device).to(BF)
        w = torch.randn(2, 8, 16, device=device).to(BF)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        ref = grouped_loop(xg.float(), w.float(), offs)
        return rel_err(grouped_torch(xg, w, offs).float(), ref) < 1e-2
    except (RuntimeError, NotImplementedError) as e:
        print(f"torch._grouped_mm is not available on {device}: {str(e).splitlines()[0]}")
        return False


def check(exe):
    torch.manual_seed(0)
    have = grouped_available("cpu")
    print(f"torch {torch.__version__}; grouped_mm on the CPU: {'yes' if have else 'no (loop path only)'}")
    cases = [
        (Config(48, 8, 3, 32, d_lat=24, n_shared=1, f_s=40, act="situ", route_scale=2.5), 67),
        (Config(48, 8, 3, 32, d_lat=24, n_shared=1, f_s=40, act="swiglu"), 67),
        (Config(40, 16, 4, 24, act="situ"), 129),
        (Config(32, 8, 2, 16, n_shared=2, f_s=16, act="swiglu", route_scale=1.5), 1),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (cfg, m) in enumerate(cases):
            check_case(exe, tmp, cfg, m, seed + 1, have)
    print("check passed: y, dx and every parameter gradient equal longmoe's (fp32 operands 2e-5, "
          "bf16 operands 2e-2 relative), the routing and loads identical, the balancing update of b "
          "within 1e-6")


# ------------------------------------------------------------------ GPU timing

def median_ms(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def gpu_selfcheck(align):
    """The grouped path against the loop of plain matmuls, forward and
    backward, on a small shape with the k3-mini structure (bf16, both)."""
    cfg = Config(128, 16, 4, 64, d_lat=64, n_shared=1, f_s=128, act="situ")
    gen = torch.Generator().manual_seed(7)
    master = init_params(cfg, gen, "cuda", scale=0.1)
    x = torch.randn(517, cfg.d, generator=gen).cuda()
    dy = torch.randn(517, cfg.d, generator=gen).cuda()
    b = torch.zeros(cfg.n, device="cuda")
    errs = {}
    for fused in (False, True):
        ref = reference_results(x, b, dy, master, cfg, grouped_loop, align, BF, fused)
        got = reference_results(x, b, dy, master, cfg, grouped_torch, align, BF, fused)
        e = {"y": rel_err(got[0], ref[0]), "dx": rel_err(got[1], ref[1])}
        e.update({"d" + nm: rel_err(got[2][nm], ref[2][nm]) for nm in master})
        errs["fused" if fused else "gate,up"] = max(e.values())
        if not max(e.values()) < 1e-2:
            sys.exit(f"FAIL: grouped path differs from the loop path ({'fused' if fused else 'unfused'}): {e}")
    print(f"grouped_mm path = loop path on the GPU (max rel err {max(errs.values()):.1e})")
    return errs


def bench_shape(m, reps, compile_, fused, align, freeze_bias, cfg=None, device="cuda"):
    cfg = cfg or Config(**K3_MINI)
    gen = torch.Generator().manual_seed(1)
    master = init_params(cfg, gen, device)
    master["lat_norm"] = torch.ones(cfg.d_lat, device=device)
    ops = operands(master, BF, fused)
    names = list(ops)
    x = torch.randn(m, cfg.d, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(m, cfg.d, generator=gen).to(device)
    state = {"b": torch.zeros(cfg.n, device=device)}

    def fwd(x, b):
        return moe_forward(x, b, ops, cfg, grouped_torch, align, BF)

    bal = balance_update
    if compile_:
        fwd = torch.compile(fwd)
        bal = torch.compile(balance_update)

    def forward_only():
        fwd(x, state["b"])

    def step():
        y, s, val, load = fwd(x, state["b"])
        torch.autograd.grad(y, [x] + [ops[nm] for nm in names], dy)
        new_b, _ = bal(s.detach(), val, state["b"], cfg)
        if not freeze_bias:
            state["b"] = new_b
        return load

    warm = 5 if compile_ else 3
    t_fwd = median_ms(forward_only, reps, warm)
    t_all = median_ms(step, reps, warm)
    load = step()
    # the routed products alone on this step's routing (forward, then forward+backward)
    with torch.no_grad():
        s, val, idx, p = route(x, ops, state["b"], cfg)
        row_of_slot, offs, _, rows = group(idx, cfg, align)
        xe = x.to(BF) @ ops["lat_down"].transpose(0, 1)
        src = torch.arange(m, device=device).repeat_interleave(cfg.k)
        xg0 = xe.new_zeros(rows, cfg.de).index_copy(0, row_of_slot, xe[src])
    ws = [ops["gate_up"]] if fused else [ops["gate"], ops["up"]]
    with torch.no_grad():
        t_gemm = median_ms(lambda: routed_products(xg0, ws, ops["down"], offs, cfg.f), reps)
        douts = [torch.randn_like(o) for o in routed_products(xg0, ws, ops["down"], offs, cfg.f)]
        t_gemm_all = median_ms(lambda: routed_products(xg0, ws, ops["down"], offs, cfg.f, douts), reps)
    flops = 6.0 * m * cfg.k * cfg.f * cfg.de
    res = dict(tokens=m, compile=compile_, fused_gate_up=fused, align=align, bias_updated=not freeze_bias,
               reps=reps, forward_ms=t_fwd, forward_backward_ms=t_all,
               grouped_gemm_tflops_forward=flops / t_fwd / 1e9,
               grouped_gemm_tflops_forward_backward=3 * flops / t_all / 1e9,
               grouped_only_forward_ms=t_gemm, grouped_only_forward_backward_ms=t_gemm_all,
               grouped_only_tflops_forward=flops / t_gemm / 1e9,
               grouped_only_tflops_forward_backward=3 * flops / t_gemm_all / 1e9,
               busiest_expert_rows=int(load.max().item()), mean_expert_rows=m * cfg.k // cfg.n)
    print(f"  {m:6d} tokens {'compiled' if compile_ else 'eager   '}: forward {t_fwd:8.3f} ms   "
          f"fwd+bwd+balance {t_all:8.3f} ms   routed products {res['grouped_gemm_tflops_forward_backward']:6.1f} "
          f"TFLOP/s over the layer, {res['grouped_only_tflops_forward_backward']:6.1f} alone "
          f"(busiest expert {res['busiest_expert_rows']} rows, mean {res['mean_expert_rows']})")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with longmoe on the CPU and exit")
    ap.add_argument("--longmoe", default="build-cpu/longmoe", help="the longmoe program (for --check)")
    ap.add_argument("--tokens", type=int, action="append", help="token counts (default 32768 65536)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--ours", action="append", default=[], help="bench_cuda_moe --out files")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--unfused", action="store_true", help="gate and up as two grouped products only")
    ap.add_argument("--align", type=int, default=8, help="pad each expert's rows to a multiple (default 8)")
    ap.add_argument("--freeze-bias", action="store_true",
                    help="compute the balancing update but keep routing with b = 0 (as bench_cuda_moe)")
    args = ap.parse_args()
    if args.check:
        check(args.longmoe)
        return
    if not torch.cuda.is_available():
        sys.exit("timing needs a CUDA GPU (use --check on the CPU)")
    if args.align < 1 or args.reps < 1:
        sys.exit("--align and --reps must be >= 1")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 router stays fp32
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    selfcheck = gpu_selfcheck(args.align)
    tokens = args.tokens or [32768, 65536]
    results = []
    for m in tokens:
        for compile_ in ([False] if args.no_compile else [False, True]):
            for fused in ([False] if args.unfused else [False, True]):
                results.append(bench_shape(m, args.reps, compile_, fused, args.align, args.freeze_bias))
    ours = []
    for path in args.ours:
        with open(path) as f:
            ours.append(json.load(f))
    if ours:
        print("\nratio = best torch / longmoe (> 1: longmoe faster; the issue asks >= 1.5 fwd+bwd)")
        for o in ours:
            mine = [r for r in results if r["tokens"] == o["tokens"]]
            if not mine:
                print(f"  {o['tokens']} tokens: no torch run at this size")
                continue
            bf = min(r["forward_ms"] for r in mine)
            ba = min(r["forward_backward_ms"] for r in mine)
            # the top level is bench_cuda_moe's fastest kind ("kind"; older files have one kind, unnamed)
            print(f"  {o['tokens']:6d} tokens ({o.get('kind', 'longmoe')}): forward {bf:.3f} / "
                  f"{o['forward_ms']:.3f} = {bf / o['forward_ms']:.2f}x   fwd+bwd {ba:.3f} / "
                  f"{o['forward_backward_ms']:.3f} = {ba / o['forward_backward_ms']:.2f}x")
            for name, k in o.get("kinds", {}).items():
                print(f"      {name:8s} forward {k['forward_ms']:8.3f} ms ({bf / k['forward_ms']:.2f}x)   "
                      f"fwd+bwd {k['forward_backward_ms']:8.3f} ms ({ba / k['forward_backward_ms']:.2f}x)")
            for r in mine:
                r["ratio_forward_vs_ours"] = r["forward_ms"] / o["forward_ms"]
                r["ratio_forward_backward_vs_ours"] = r["forward_backward_ms"] / o["forward_backward_ms"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "moe_vs_torch", "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "config": K3_MINI,
                       "selfcheck_max_rel_err": selfcheck, "results": results, "ours": ours}, f, indent=1)


if __name__ == "__main__":
    main()
