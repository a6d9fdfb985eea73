"""The PyTorch peer (bench/model_vs_torch.py) computes longmoe's loss on longmoe's weights.

Usage: check_torch_peer.py BUILD_DIR   (BUILD_DIR holds longmoe and bench_checkpoint_loss)

Trains short runs of four configurations with `longmoe train` (the tiny preset
at one stage, and three variants that between them reach every branch of the
peer: softplus gate, GQA, LatentMoE, SiTU-GLU, two shared experts, tied
embeddings, Full / standard / Block AttnRes with a block that is not a multiple
of a layer, chunk 16 and 32, conv width 3, route scale 2.5, the sign balancer),
then on random batches whose T is not a multiple of the KDA chunk:

- test_the_peer_loss_equals_longmoe_loss: for --kda naive (chunked) and
  recurrent, |loss_torch - loss_longmoe| <= 1e-5 and every token's
  log-probability agrees to 1e-4 (both sides fp32 on the CPU);
- test_the_check_sees_the_balancing_bias: zeroing the peer's balancing biases
  (routing by s alone) moves its loss away from longmoe's by more than 1e-4,
  so the comparison above does exercise the routing;
- test_naive_chunked_kda_equals_the_recurrence: the peer's two KDA operators
  agree to 1e-5 on random inputs with both gates.

Needs torch, safetensors and numpy; without torch it prints "skipped" and exits 0.
Prints "N passed, M failed" and exits 1 on a failure."""
import json
import os
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("skipped: torch is not installed (the PyTorch peer check)")
    sys.exit(0)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
import model_vs_torch as peer  # noqa: E402

TRAIN = {"steps": 12, "ckpt_every": 12, "log_every": 4, "data": "copy"}
CONFIGS = {
    "tiny": None,  # configs/tiny.json at seq_len 128, batch 8, without its stages
    "a": {"model": {"vocab_size": 256, "d_model": 48, "n_layers": 5, "layout": "kmkkm", "first_k_dense": 2,
                    "dense_ffn": 80, "tie_embeddings": True},
          "kda": {"heads": 3, "head_dim": 16, "chunk": 16, "conv_width": 3, "gate": "softplus"},
          "attention": {"kind": "gqa", "heads": 4, "kv_heads": 2, "qk_head_dim": 12, "v_head_dim": 20},
          "moe": {"routed_experts": 6, "top_k": 3, "shared_experts": 2, "expert_ffn": 24, "shared_ffn": 20,
                  "latent_dim": 32, "activation": "situ", "route_scale": 2.5},
          "residual": {"kind": "full_attnres"}, "train": dict(TRAIN, seq_len=64, batch_size=4)},
    "b": {"model": {"vocab_size": 256, "d_model": 48, "n_layers": 5, "mla_every": 2, "first_k_dense": 2,
                    "dense_ffn": 80},
          "kda": {"heads": 2, "head_dim": 24, "chunk": 32, "g_min": -3.5},
          "attention": {"kind": "mla", "heads": 3, "q_lora_rank": 20, "kv_lora_rank": 12, "qk_head_dim": 16,
                        "v_head_dim": 8},
          "moe": {"routed_experts": 6, "top_k": 3, "shared_experts": 0, "expert_ffn": 24},
          "residual": {"kind": "standard"}, "train": dict(TRAIN, seq_len=64, batch_size=4)},
}
CONFIGS["c"] = json.loads(json.dumps(CONFIGS["b"]))
CONFIGS["c"]["residual"] = {"kind": "block_attnres", "block_sublayers": 3}
CONFIGS["c"]["moe"]["balance"] = "sign"

passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}")


def train(build, tmp, name):
    if CONFIGS[name] is None:
        cfg = json.load(open(os.path.join(HERE, "..", "..", "configs", "tiny.json")))
        cfg["train"].pop("stages")
        cfg["train"].update(TRAIN, seq_len=128, batch_size=8)
    else:
        cfg = CONFIGS[name]
    path, out = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, name)
    json.dump(cfg, open(path, "w"))
    subprocess.run([os.path.join(build, "longmoe"), "train", "--quiet", "--config", path, "--out", out], check=True,
                   stdout=subprocess.DEVNULL)
    return peer.resolve_checkpoint(out)


def test_the_peer_loss_equals_longmoe_loss(build, ckpts):
    binary = os.path.join(build, "bench_checkpoint_loss")
    for name, ckpt in ckpts.items():
        for kda in ("naive", "recurrent"):
            model = peer.load_model(ckpt, kda)
            for seed, (B, T) in enumerate([(2, 70), (1, 131)]):
                tokens, targets = peer.random_batch(model.cfg, B, T, seed)
                loss, logp = peer.torch_loss(model, tokens, targets)
                ref_loss, ref_logp = peer.longmoe_loss(binary, ckpt, tokens, targets)
                dl = abs(loss - ref_loss)
                dp = (logp.double() - ref_logp.double()).abs().max().item()
                print(f"{name} kda={kda} B,T={B},{T}: torch {loss:.7f} longmoe {ref_loss:.7f} |d| {dl:.2e} "
                      f"max |d logp| {dp:.2e}")
                check(dl <= 1e-5, f"{name} {kda} {B},{T}: loss differs by {dl:.3g}")
                check(dp <= 1e-4, f"{name} {kda} {B},{T}: a log-probability differs by {dp:.3g}")


def test_the_check_sees_the_balancing_bias(build, ckpts):
    binary = os.path.join(build, "bench_checkpoint_loss")
    ckpt = ckpts["tiny"]
    model = peer.load_model(ckpt, "naive")
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, peer.MoE):
                check(mod.bias.abs().max().item() > 0, "a trained balancing bias is nonzero")
                mod.bias.zero_()
    tokens, targets = peer.random_batch(model.cfg, 2, 70, 0)
    loss, _ = peer.torch_loss(model, tokens, targets)
    ref_loss, _ = peer.longmoe_loss(binary, ckpt, tokens, targets)
    print(f"tiny, biases zeroed in the peer: torch {loss:.7f} longmoe {ref_loss:.7f}")
    check(abs(loss - ref_loss) > 1e-4, f"zeroed biases changed the loss by only {abs(loss - ref_loss):.3g}")


def test_naive_chunked_kda_equals_the_recurrence():
    g = torch.Generator().manual_seed(7)
    B, T, H, K = 2, 83, 3, 16
    for gate, chunk in (("bounded", 16), ("softplus", 32)):
        r = lambda *s: torch.randn(*s, generator=g)
        q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
        k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
        v, z = r(B, T, H, K), r(B, T, H, K)
        beta = torch.sigmoid(r(B, T, H))
        gt = peer.kda_gate(z, r(H), r(H * K) - 1.0, gate, -5.0)
        o_rec = peer.kda_recurrent(q, k, v, gt, beta, K ** -0.5)
        o_chk = peer.kda_chunk_naive(q, k, v, gt, beta, K ** -0.5, chunk)
        d = (o_rec - o_chk).abs().max().item()
        print(f"kda {gate} chunk {chunk}: max |recurrent - chunked| {d:.2e}")
        check(d <= 1e-5, f"{gate}: the chunked KDA differs from the recurrence by {d:.3g}")


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build-cpu"
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {name: train(build, tmp, name) for name in CONFIGS}
        test_the_peer_loss_equals_longmoe_loss(build, ckpts)
        test_the_check_sees_the_balancing_bias(build, ckpts)
    test_naive_chunked_kda_equals_the_recurrence()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
