#!/usr/bin/env python3
"""The peer: fla-core's chunk_kda (Triton) on the shapes of bench_cuda_kda.

    python3 bench/kda_vs_fla.py [--ours ours.json] [--out fla.json] [--reps N]
                                [--shape B,T,H,D]... [--prior fla.json]... [--autotune-ms W,R]

Same inputs as ours: q, k, v and the raw gate input g (= our z) in bf16, the
gate fused in the kernel (use_gate_in_kernel=True with A_log [H] and dt_bias
[H*K] in fp32); bounded gate = safe_gate=True, lower_bound=-5, which computes
-5 * sigmoid(exp(A_log) * (g + dt_bias)) as ours; softplus gate = fla's
default -exp(A_log) * softplus(g + dt_bias). beta is bf16 for fla (fp32 for
ours; 1/128 of the bytes of q). Forward under no_grad; forward + backward via
torch.autograd.grad (no gradient accumulation). Median of --reps timed runs
(CUDA events) after 3 warm-ups (these include Triton's autotuning).
With --ours, prints the comparison table (medians, ratios, bandwidth).

--autotune-ms W,R sets the warm-up and measuring time (ms) of each candidate
in Triton's autotuning (Triton's default 25,100). A smaller budget lets all
three shapes finish in one call; every candidate is still timed over many
runs (fla's kernels take 0.01-2 ms each).

--shape (repeatable) times fla on those shapes only (default: the three of
SPEC §7). --prior (repeatable) merges fla results written earlier by --out,
on the same machine, into the table and into --out: the first shape's
autotuning can fill a whole call, and the other shapes then run in a second
one (Triton's cache of compiled kernels makes it short)."""
import argparse
import json
import statistics
import sys

import torch

SHAPES = [(1, 8192, 64, 128), (8, 4096, 16, 128), (1, 65536, 16, 128)]


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def shorten_autotuning(warmup_ms, rep_ms):
    """Triton's autotuner times each candidate with triton.testing.do_bench
    (looked up when it benchmarks): give it a shorter budget."""
    import triton.testing

    full = triton.testing.do_bench

    def do_bench(fn, warmup=25, rep=100, *args, **kwargs):
        return full(fn, warmup_ms, rep_ms, *args, **kwargs)

    triton.testing.do_bench = do_bench


def bench_fla(reps):
    from fla.ops.kda import chunk_kda

    results = []
    for (B, T, H, D) in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(B * T + H)
        dev, bf = "cuda", torch.bfloat16
        a = 3 ** 0.5 / D ** 0.5
        q = ((torch.rand(B, T, H, D, device=dev, generator=gen) * 2 - 1) * a).to(bf)
        k = ((torch.rand(B, T, H, D, device=dev, generator=gen) * 2 - 1) * a).to(bf)
        v = (torch.rand(B, T, H, D, device=dev, generator=gen) * 2 - 1).to(bf)
        g = ((torch.rand(B, T, H, D, device=dev, generator=gen) * 2 - 1) * 2).to(bf)
        beta = (0.05 + 0.9 * torch.rand(B, T, H, device=dev, generator=gen)).to(bf)
        A_log = torch.rand(H, device=dev, generator=gen) - 0.5
        dt_bias = torch.rand(H * D, device=dev, generator=gen) - 0.5
        do = (torch.rand(B, T, H, D, device=dev, generator=gen) * 2 - 1).to(bf)
        leaves = [t.requires_grad_(True) for t in (q, k, v, g, beta, A_log, dt_bias)]
        for gate in ("bounded", "softplus"):
            kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
            if gate == "bounded":
                kw.update(safe_gate=True, lower_bound=-5.0)

            def fwd():
                with torch.no_grad():
                    chunk_kda(q, k, v, g, beta, **kw)

            def fwd_bwd():
                o, _ = chunk_kda(q, k, v, g, beta, **kw)
                torch.autograd.grad(o, leaves, do)

            f = median_ms(fwd, reps)
            fb = median_ms(fwd_bwd, reps)
            print(f"fla ({B},{T},{H},{D}) {gate:8s} fwd {f:8.3f} ms  fwd+bwd {fb:8.3f} ms",
                  flush=True)
            results.append(dict(B=B, T=T, H=H, D=D, gate=gate, fwd_ms=f, fwd_bwd_ms=fb))
        del q, k, v, g, beta, do, leaves
        torch.cuda.empty_cache()
    return results


def table(ours, fla):
    key = lambda r: (r["B"], r["T"], r["H"], r["D"], r["gate"])
    peer = {key(r): r for r in fla}
    mine = {key(r): r for r in ours}
    print("\nKDA on", torch.cuda.get_device_name(0), "(median ms; ratio = fla / ours, >1: ours faster)")
    hdr = f"{'shape (B,T,H,D)':20s} {'gate':8s} {'ours fwd':>9s} {'fla fwd':>9s} {'ratio':>6s} " \
          f"{'ours f+b':>9s} {'fla f+b':>9s} {'ratio':>6s} {'fwd GB/s':>9s} {'%floor':>7s}"
    print(hdr)
    for k in sorted(mine):
        r, p = mine[k], peer.get(k)
        name = "({},{},{},{})".format(*k[:4])
        gbs = r["floor_fwd_bytes"] / (r["fwd_ms"] * 1e6)
        pf = f"{p['fwd_ms']:9.3f}" if p else f"{'-':>9s}"
        pfb = f"{p['fwd_bwd_ms']:9.3f}" if p else f"{'-':>9s}"
        rf = f"{p['fwd_ms'] / r['fwd_ms']:6.2f}" if p else f"{'-':>6s}"
        rfb = f"{p['fwd_bwd_ms'] / r['fwd_bwd_ms']:6.2f}" if p else f"{'-':>6s}"
        print(f"{name:20s} {k[4]:8s} {r['fwd_ms']:9.3f} {pf} {rf} {r['fwd_bwd_ms']:9.3f} {pfb} {rfb} "
              f"{gbs:9.0f} {100 * gbs / 4300:6.1f}%")
    for s in sorted({k[:4] for k in mine}):
        b, sp = mine.get(s + ("bounded",)), mine.get(s + ("softplus",))
        if b and sp:
            print("ours ({},{},{},{}) softplus/bounded: fwd {:.2f}x  fwd+bwd {:.2f}x".format(
                *s, sp["fwd_ms"] / b["fwd_ms"], sp["fwd_bwd_ms"] / b["fwd_bwd_ms"]))
    print("(%floor: memory-floor bytes over the time, against a 4.3 TB/s copy)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", help="bench_cuda_kda JSON for the comparison table")
    ap.add_argument("--out", help="write fla's timings as JSON")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--autotune-ms", help="W,R: Triton autotuning warm-up and timing budget (ms)")
    ap.add_argument("--shape", action="append", default=[],
                    help="B,T,H,D: time fla on this shape (repeatable; default the three)")
    ap.add_argument("--prior", action="append", default=[],
                    help="fla JSON written by --out in an earlier run (repeatable)")
    args = ap.parse_args()
    if args.shape:
        try:
            shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shape]
            if any(len(sh) != 4 or min(sh) < 1 for sh in shapes):
                raise ValueError
        except ValueError:
            ap.error(f"--shape wants four positive integers B,T,H,D (got {args.shape})")
        SHAPES[:] = shapes
    prior = []
    for path in args.prior:
        try:
            with open(path) as f:
                prior += json.load(f)["results"]
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--prior {path}: not an fla JSON written by --out ({type(e).__name__}: {e})")
    if args.autotune_ms:
        try:
            w, r = (int(x) for x in args.autotune_ms.split(","))
            if w < 1 or r < 1:
                raise ValueError
        except ValueError:
            ap.error(f"--autotune-ms wants two positive integers W,R (got {args.autotune_ms!r})")
        shorten_autotuning(w, r)
    try:
        fla = bench_fla(args.reps)
    except Exception as e:  # the table still shows our numbers
        print(f"fla benchmark failed: {type(e).__name__}: {e}", file=sys.stderr)
        fla = []
    measured = {(r["B"], r["T"], r["H"], r["D"], r["gate"]) for r in fla}
    fla += [r for r in prior if (r["B"], r["T"], r["H"], r["D"], r["gate"]) not in measured]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), results=fla), f, indent=1)
    if args.ours:
        with open(args.ours) as f:
            table(json.load(f)["results"], fla)


if __name__ == "__main__":
    main()
