#!/usr/bin/env python3
"""How precisely can the chunked KDA carry its fp32 state with bf16 tensor-core operands?

A CPU study (numpy) of the chunked forward of SPEC §2 "Chunked form", the part that decides
the final state:

    W = M (K e^G),  U = M V,  V' = U - W S,  S <- Diag(e^{G_C}) S + Kd^T V'

M = (I + Akk)^{-1} Diag(beta) and Kd = K e^{G_C - G} are computed exactly (float64) per chunk
of 64; the products then run in three ways, every product accumulating in fp32:

  kernels        as the CUDA kernels do: M rounded to bf16 for W and U; W, U, Kd stored in
                 bf16; S rounded to bf16 for W S; V' rounded to bf16 for Kd^T V'
  precise-state  M carried as two bf16 parts (M = hi + lo) for U (two products: V is a bf16
                 input); U and Kd stored in fp32; W and W S as in kernels; the state update
                 Kd^T V' with both operands in two parts, taken as hi*hi + hi*lo + lo*hi
                 (three products instead of one)
  split-all      every bf16 operand of every product in two parts (the best this scheme gives)

It prints the relative error ||S_T - S_T(exact)|| / ||S_T(exact)|| of the final state
(q, k, v rounded to bf16 first, k unit-norm, beta in (0.05, 0.95), the bounded gate in
[-5, 0] or the softplus gate). What it leaves out: the rounding inside the triangular inverse (fp32 in the kernels).
"""
import argparse

import numpy as np


def bf16(x):
    """Round to the nearest bf16 (ties to even), returned as float64."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def f32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def split(x):
    hi = bf16(x)
    return hi, bf16(x - hi)


def product(a, b, kind):
    """a @ b on tensor cores with fp32 accumulation: bf16 operands ("bf16"), or each operand
    in two bf16 parts and three products ("split")."""
    if kind == "split":
        (ah, al), (bh, bl) = split(a), split(b)
        return f32(ah @ bh + ah @ bl + al @ bh)
    return f32(bf16(a) @ bf16(b))


def chunk_terms(k, v, beta, g):
    """Per chunk of 64 (float64): M, K e^G, V, Kd, e^{G_C}."""
    T, D = k.shape
    out = []
    for t0 in range(0, T, 64):
        kc, vc, bc, gc = k[t0:t0 + 64], v[t0:t0 + 64], beta[t0:t0 + 64], g[t0:t0 + 64]
        n = kc.shape[0]
        G = np.cumsum(gc, axis=0)
        keg, kemg = kc * np.exp(G), kc * np.exp(-G)
        akk = np.tril(bc[:, None] * (keg @ kemg.T), -1)
        m = np.linalg.solve(np.eye(n) + akk, np.diag(bc))
        out.append((m, keg, vc, kc * np.exp(G[-1] - G), np.exp(G[-1])))
    return out


def run(terms, D, mode):
    S = np.zeros((D, D))
    for m, keg, vc, kd, gC in terms:
        if mode == "exact":
            w, u = m @ keg, m @ vc
            vn = u - w @ S
            S = gC[:, None] * S + kd.T @ vn
            continue
        if mode == "kernels":
            w, u, kd = bf16(product(m, keg, "bf16")), bf16(product(m, vc, "bf16")), bf16(kd)
        elif mode == "precise-state":
            mh, ml = split(m)
            w = bf16(product(m, keg, "bf16"))
            u, kd = f32(mh @ vc + ml @ vc), f32(kd)
        else:  # split-all
            w, u, kd = f32(product(m, keg, "split")), f32(product(m, vc, "split")), f32(kd)
        vn = f32(u - product(w, S, "split" if mode == "split-all" else "bf16"))
        upd = product(kd.T, vn, "bf16" if mode == "kernels" else "split")
        S = f32(gC[:, None] * S + upd)
    return S


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--T", type=int, nargs="+", default=[200, 1024, 8192])
    ap.add_argument("--gate", choices=("bounded", "softplus"), default="bounded",
                    help="bounded: g = -5 sigmoid(z - 2); softplus: g = -softplus(z - 2)")
    args = ap.parse_args()
    modes = ("kernels", "precise-state", "split-all")
    print(f"final-state relative error, D = {args.D}, {args.gate} gate, "
          f"max over {args.seeds} seeds")
    print(f"{'T':>6s} " + " ".join(f"{m:>14s}" for m in modes))
    for T in args.T:
        worst = dict.fromkeys(modes, 0.0)
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            k = rng.standard_normal((T, args.D))
            k /= np.linalg.norm(k, axis=1, keepdims=True)
            v = bf16(rng.standard_normal((T, args.D)))
            k = bf16(k)
            beta = rng.uniform(0.05, 0.95, T)
            z = rng.standard_normal((T, args.D)) * 2.0
            if args.gate == "bounded":
                g = -5.0 / (1.0 + np.exp(-(z - 2.0)))  # in [-5, 0], mostly mild decay
            else:
                g = -np.logaddexp(0.0, z - 2.0)  # unbounded below
            terms = chunk_terms(k, v, beta, g)
            ref = run(terms, args.D, "exact")
            for m in modes:
                err = np.linalg.norm(run(terms, args.D, m) - ref) / np.linalg.norm(ref)
                worst[m] = max(worst[m], err)
        print(f"{T:6d} " + " ".join(f"{worst[m]:14.2e}" for m in modes))


if __name__ == "__main__":
    main()
