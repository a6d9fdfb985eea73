#!/usr/bin/env python3
"""How precisely can the chunked KDA carry its fp32 state with bf16 tensor-core operands?

A CPU study (numpy) of the chunked forward of SPEC §2 "Chunked form", the part that decides
the final state:

    W = M (K e^G),  U = M V,  V' = U - W S,  S <- Diag(e^{G_C}) S + Kd^T V'

M = (I + Akk)^{-1} Diag(beta) and Kd = K e^{G_C - G} are computed exactly (float64) per chunk
of 64; the products then run in these ways, every product accumulating in fp32 ("split": each
operand as two bf16 parts, x = hi + lo, and the product as hi*hi + hi*lo + lo*hi):

  kernels        the CUDA kernels' fast path: M rounded to bf16 for W and U; W, U, Kd stored
                 in bf16; S rounded to bf16 for W S; V' rounded to bf16 for Kd^T V'
  split-update   U = Mh V + Ml V (two products; V is a bf16 input); U and Kd kept to about 16
                 bits (hi + lo); the update Kd^T V' split; W and W S as in kernels
  precise        the kernels' precise path (asked for with ht): as split-update, and also
                 W = M (K e^G) split (three products) and kept as hi + lo, and W S split
  split-all      every operand of every product split

It prints the relative error ||S_T - S_T(exact)|| / ||S_T(exact)|| of the final state
(q, k, v rounded to bf16 first, k unit-norm, beta = sigmoid(N(0,1)), an initial state h0 of
scale --h0) for a gate regime: none (g = 0, no decay), mild (g = -0.05 sigmoid(z)),
bounded (g = -5 sigmoid(z - 2): strong decay) or softplus (g = -softplus(z - 2)), z ~ 2 N(0,1).
What it leaves out: the rounding inside the triangular inverse (fp32 in the kernels) and in
the diagonal blocks of Akk.
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


def run(terms, D, mode, S0):
    S = S0.copy()
    for m, keg, vc, kd, gC in terms:
        if mode == "exact":
            w, u = m @ keg, m @ vc
            vn = u - w @ S
            S = gC[:, None] * S + kd.T @ vn
            continue
        if mode == "kernels":
            w, u, kdq = bf16(product(m, keg, "bf16")), bf16(product(m, vc, "bf16")), bf16(kd)
        else:
            mh, ml = split(m)
            u, kdq = f32(mh @ vc + ml @ vc), f32(kd)
            w = f32(product(m, keg, "split")) if mode in ("precise", "split-all") else \
                bf16(product(m, keg, "bf16"))
        ws = product(w, S, "split" if mode in ("precise", "split-all") else "bf16")
        vn = f32(u - ws)
        upd = product(kdq.T, vn, "bf16" if mode == "kernels" else "split")
        S = f32(gC[:, None] * S + upd)
    return S


GATES = {
    "none": lambda z: np.zeros_like(z),
    "mild": lambda z: -0.05 / (1.0 + np.exp(-z)),
    "bounded": lambda z: -5.0 / (1.0 + np.exp(-(z - 2.0))),
    "softplus": lambda z: -np.logaddexp(0.0, z - 2.0),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--T", type=int, nargs="+", default=[1, 150, 1024])
    ap.add_argument("--gate", choices=tuple(GATES), nargs="+", default=list(GATES))
    ap.add_argument("--h0", type=float, default=0.3, help="scale of the initial state (0: none)")
    args = ap.parse_args()
    modes = ("kernels", "split-update", "precise", "split-all")
    print(f"final-state relative error, D = {args.D}, h0 scale {args.h0}, "
          f"max over {args.seeds} seeds")
    print(f"{'gate':>9s} {'T':>6s} " + " ".join(f"{m:>13s}" for m in modes))
    for gate in args.gate:
        for T in args.T:
            worst = dict.fromkeys(modes, 0.0)
            for seed in range(args.seeds):
                rng = np.random.default_rng(seed)
                k = rng.standard_normal((T, args.D))
                k /= np.linalg.norm(k, axis=1, keepdims=True)
                k = bf16(k)
                v = bf16(rng.standard_normal((T, args.D)))
                beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(T)))
                g = GATES[gate](rng.standard_normal((T, args.D)) * 2.0)
                S0 = args.h0 * rng.standard_normal((args.D, args.D))
                terms = chunk_terms(k, v, beta, g)
                ref = run(terms, args.D, "exact", S0)
                for m in modes:
                    err = np.linalg.norm(run(terms, args.D, m, S0) - ref) / np.linalg.norm(ref)
                    worst[m] = max(worst[m], err)
            print(f"{gate:>9s} {T:6d} " + " ".join(f"{worst[m]:13.2e}" for m in modes))


if __name__ == "__main__":
    main()
