#!/usr/bin/env python3
"""The PyTorch peers of the GPU operators of the model, timed on the same GPU
and shapes as bench/bench_cuda_linear.c and bench/bench_cuda_attention.c:

  matmul   torch.matmul in bf16 (fp32 accumulation inside cuBLAS), forward
           out = x . W^T and the backward's two products, at 32768 tokens and
           the k3-mini widths;
  sdpa     torch.nn.functional.scaled_dot_product_attention, causal, bf16,
           with the cuDNN and the flash backend, forward and forward+backward.

Before timing, each peer is checked to compute what ours computes (a small
case against a float64 reference of the same formula). With --ours FILE.json
(the benches' --out files) the output gains our times and, for the attention,
a side-by-side table: each of our kinds (flash, cudnn, cudnn-fast from
bench_cuda_attention) next to torch SDPA's cuDNN and flash backends, with the
speed ratio torch_ms / ours_ms (>= 1.0: ours at least as fast).

  python3 bench/ops_vs_torch.py --out peers.json [--ours a.json --ours b.json]
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def check_matmul():
    x = torch.randn(37, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    got = (x @ w.t()).double()
    want = x.double() @ w.double().t()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, f"torch.matmul disagrees with the float64 product: {err}"


def check_sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    q, k, v = (torch.randn(1, 2, 77, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(backend):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True).double()
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(64)
    mask = torch.ones(77, 77, device="cuda", dtype=torch.bool).tril()
    s = s.masked_fill(~mask, float("-inf"))
    want = torch.softmax(s, -1) @ v.double()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, f"SDPA {backend} disagrees with the float64 causal attention: {err}"


def bench_matmul(reps, tokens):
    shapes = [(1024, 1024), (1024, 4096), (4096, 1024), (1024, 32768), (512, 1024)]
    rows = []
    for ic, oc in shapes:
        x = torch.randn(tokens, ic, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(oc, ic, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, oc, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * tokens * ic * oc
        fwd = median_ms(lambda: x @ w.t(), reps)
        bwd = median_ms(lambda: (dy @ w, dy.t() @ x), reps)
        rows.append({"name": f"matmul {tokens}x{ic}->{oc}", "fwd_ms": fwd, "bwd_ms": bwd,
                     "fwd_tflops": flops / fwd / 1e9, "bwd_tflops": 2 * flops / bwd / 1e9})
        del x, w, dy
    return rows


def bench_sdpa(reps, shapes):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for B, T, H, D in shapes:
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        flops = 4.0 * B * H * T * T / 2 * D
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)

                    def step():
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        torch.autograd.grad(o, (q, k, v), do)

                    both = median_ms(step, reps)
            except RuntimeError as e:
                print(f"sdpa {name} at {(B, T, H, D)}: {e}", file=sys.stderr)
                continue
            rows.append({"name": f"attention {B},{T},{H},{D} {name}", "fwd_ms": fwd, "fwdbwd_ms": both,
                         "fwd_tflops": flops / fwd / 1e9, "fwdbwd_tflops": 3.5 * flops / both / 1e9})
        del q, k, v, do
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ours", action="append", default=[])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32768)
    a = ap.parse_args()
    torch.manual_seed(0)
    check_matmul()
    from torch.nn.attention import SDPBackend
    check_sdpa(SDPBackend.CUDNN_ATTENTION)
    check_sdpa(SDPBackend.FLASH_ATTENTION)
    peers = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "matmul": bench_matmul(a.reps, a.tokens),
             "sdpa": bench_sdpa(a.reps, [(1, 8192, 8, 128), (1, 32768, 8, 128), (8, 4096, 8, 128)])}
    with open(a.out, "w") as f:
        json.dump(peers, f, indent=1)
    print(f"torch {torch.__version__} on {peers['device']}")
    for r in peers["matmul"]:
        print(f"{r['name']:34s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.0f} TFLOP/s   "
              f"bwd {r['bwd_ms']:8.3f} ms {r['bwd_tflops']:6.0f} TFLOP/s")
    for r in peers["sdpa"]:
        print(f"{r['name']:34s} fwd {r['fwd_ms']:8.3f} ms   fwd+bwd {r['fwdbwd_ms']:8.3f} ms "
              f"({r['fwd_tflops']:.0f} / {r['fwdbwd_tflops']:.0f} TFLOP/s)")
    ours_attention = []
    for path in a.ours:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"ours: {path}: {e}", file=sys.stderr)
            continue
        rows = doc.get("results", []) if isinstance(doc, dict) else []
        if rows and all("kind" in r and "T" in r for r in rows):
            ours_attention += rows
        else:
            print(f"ours ({path}):", json.dumps(doc)[:1500])
    if ours_attention:
        peers["attention_side_by_side"] = attention_side_by_side(peers["sdpa"], ours_attention)
        with open(a.out, "w") as f:
            json.dump(peers, f, indent=1)


def attention_side_by_side(sdpa_rows, ours):
    """Print and return, per shape, torch SDPA (cudnn, flash) and each of our
    kinds with the ratios torch_ms / ours_ms (>= 1.0: ours at least as fast)."""
    torch_by = {}
    for r in sdpa_rows:
        _, shape, backend = r["name"].split(" ")
        torch_by[(shape, backend)] = r
    out = []
    shapes = []
    for r in ours:
        key = f"{r['B']},{r['T']},{r['H']},{r['D']}"
        if key not in shapes:
            shapes.append(key)
    print("\nattention, causal bf16 (B,T,H,D): ms, and speed vs torch SDPA = torch_ms / ours_ms")
    print(f"{'shape':18s} {'impl':18s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} "
          f"{'fwd vs cuDNN':>13s} {'f+b vs cuDNN':>13s} {'fwd vs flash':>13s} {'f+b vs flash':>13s}")
    for key in shapes:
        tc, tf = torch_by.get((key, "cudnn")), torch_by.get((key, "flash"))

        def ratio(t, field, ms):
            return t[field] / ms if t and ms > 0 else None

        def fmt(x):
            return f"{x:13.2f}" if x is not None else f"{'-':>13s}"

        for name, t in (("torch sdpa cudnn", tc), ("torch sdpa flash", tf)):
            if t:
                print(f"{key:18s} {name:18s} {t['fwd_ms']:9.3f} {t['fwdbwd_ms']:11.3f}")
        for r in ours:
            if f"{r['B']},{r['T']},{r['H']},{r['D']}" != key:
                continue
            fwd, fb = r["forward_ms"], r["forward_backward_ms"]
            row = {"shape": key, "kind": r["kind"], "fwd_ms": fwd, "fwdbwd_ms": fb,
                   "fwd_vs_torch_cudnn": ratio(tc, "fwd_ms", fwd), "fwdbwd_vs_torch_cudnn": ratio(tc, "fwdbwd_ms", fb),
                   "fwd_vs_torch_flash": ratio(tf, "fwd_ms", fwd), "fwdbwd_vs_torch_flash": ratio(tf, "fwdbwd_ms", fb)}
            out.append(row)
            print(f"{key:18s} {'ours ' + r['kind']:18s} {fwd:9.3f} {fb:11.3f} "
                  f"{fmt(row['fwd_vs_torch_cudnn'])} {fmt(row['fwdbwd_vs_torch_cudnn'])} "
                  f"{fmt(row['fwd_vs_torch_flash'])} {fmt(row['fwdbwd_vs_torch_flash'])}")
    return out


if __name__ == "__main__":
    main()
