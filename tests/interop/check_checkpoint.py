"""Open a longmoe checkpoint with Python's safetensors and check it against
its config.json: every documented tensor is there with its shape, all values
are finite, and each file's data section hashes to the checksum in its
metadata (lm_checksum64, docs/RELIABILITY.md). Usage: check_checkpoint.py CHECKPOINT_DIR"""
import json
import struct
import sys

import numpy as np
from safetensors.numpy import load_file



def checksum64(data):
    """FNV-1a over 64-bit little-endian words, then the tail bytes, then the length."""
    M, P, h = (1 << 64) - 1, 0x100000001B3, 0xCBF29CE484222325
    k = len(data) // 8 * 8
    words = np.frombuffer(data[:k], dtype="<u8")
    for w in words.tolist():
        h = ((h ^ w) * P) & M
    for c in data[k:]:
        h = ((h ^ c) * P) & M
    return ((h ^ len(data)) * P) & M


def check_checksum(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8:8 + n]).get("__metadata__", {})
    assert "longmoe.checksum" in meta, f"{path}: no checksum"
    assert meta["longmoe.checksum"] == "%016x" % checksum64(raw[8 + n:]), f"{path}: checksum mismatch"


ckpt = sys.argv[1]
check_checksum(f"{ckpt}/model.safetensors")
check_checksum(f"{ckpt}/trainer.safetensors")
cfg = json.load(open(f"{ckpt}/config.json"))
model = cfg["model"]
weights = load_file(f"{ckpt}/model.safetensors")
d, V = model["d_model"], model["vocab_size"]
assert weights["embed"].shape == (V, d), weights["embed"].shape
assert weights["final_norm"].shape == (d,)
layout = model["layout"] or "".join(
    "m" if (model["mla_every"] and (l + 1) % model["mla_every"] == 0)
    or (model["last_layer_mla"] and l == model["n_layers"] - 1) else "k"
    for l in range(model["n_layers"]))
for l, kind in enumerate(layout):
    if kind == "k":
        hk = cfg["kda"]["heads"] * cfg["kda"]["head_dim"]
        assert weights[f"layers.{l}.kda.W_q"].shape == (hk, d)
        assert weights[f"layers.{l}.kda.A_log"].shape == (cfg["kda"]["heads"],)
    else:
        assert f"layers.{l}.mla.W_o" in weights
    if l >= model["first_k_dense"]:
        n = cfg["moe"]["routed_experts"]
        assert weights[f"layers.{l}.moe.router"].shape == (n, d)
        assert weights[f"layers.{l}.moe.gate"].shape[0] == n
for name, w in weights.items():
    assert w.dtype == np.float32, name
    assert np.isfinite(w).all(), name
trainer = load_file(f"{ckpt}/trainer.safetensors")
assert "optim.muon_state" in trainer and "optim.adam_state" in trainer
print(f"ok: {len(weights)} tensors, {sum(w.size for w in weights.values())} parameters")
