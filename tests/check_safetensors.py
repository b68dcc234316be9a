#!/usr/bin/env python3
"""Checks a saved ringmaster cnn from the outside: loads the weights with the real `safetensors` package,
runs the cnn's forward pass in numpy (Keras layouts: conv2d kernel (kh, kw, cin, cout), dense kernel
(in, out), channels-last flatten order (h, w, c)) on the first N test images read from the IDX files, and
compares accuracy and loss with the launcher's --report-json.

    ringmaster-mnist --model cnn --epochs 1 --limit-train 2048 --limit-test 1000 --save w.safetensors \\
                     --report-json run.json
    python3 tests/check_safetensors.py --weights w.safetensors --report run.json --limit-test 1000

With --checkpoint FILE (the run's last checkpoint, --checkpoint-dir) it also checks that file from the
outside: its weights are the saved ones bit for bit, Adam's moments are there in the same shapes, and its
checksum is what actors/checkpoint.hpp says: CRC-32 (zlib) of the header without "checksum" as compact
JSON with sorted keys, then of the data.

Exit status 0 when the numbers agree (at most one prediction in 1000 may differ: float64 here, float32
there), 1 otherwise. tests/CMakeLists.txt runs it in a venv that has safetensors and numpy.
"""
import argparse
import gzip
import json
import os
import struct
import sys
import zlib

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

# The cnn of kernels/model.hpp: conv 32 3x3 + relu, maxpool 2, conv 64 3x3 + relu, maxpool 2, flatten,
# dropout 0.5 (identity when evaluating), dense 10. Names and shapes as saved.
CNN = [
    {"type": "conv2d", "filters": 32, "kernel": [3, 3], "activation": "relu"},
    {"type": "max_pool2d", "size": [2, 2]},
    {"type": "conv2d", "filters": 64, "kernel": [3, 3], "activation": "relu"},
    {"type": "max_pool2d", "size": [2, 2]},
    {"type": "flatten"}, {"type": "dropout", "rate": 0.5}, {"type": "dense", "units": 10},
]
EXPECTED = {
    "conv2d_0/kernel": (3, 3, 1, 32), "conv2d_0/bias": (32,),
    "conv2d_1/kernel": (3, 3, 32, 64), "conv2d_1/bias": (64,),
    "dense_0/kernel": (1600, 10), "dense_0/bias": (10,),
}


def read_idx(path, dims):
    """An IDX file (gzip or raw) as a numpy array; checks the magic and the size."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    if magic != 0x800 + dims:
        raise SystemExit(f"{path}: magic {magic:#x}, expected {0x800 + dims:#x}")
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    body = data[4 + 4 * dims:]
    if len(body) != int(np.prod(shape)):
        raise SystemExit(f"{path}: {len(body)} bytes of data for shape {shape}")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def find(data_dir, name):
    for candidate in (name, name + ".gz"):
        path = os.path.join(data_dir, candidate)
        if os.path.exists(path):
            return path
    raise SystemExit(f"{data_dir}: neither {name} nor {name}.gz")


def pair(v, default):
    v = default if v is None else v
    return (v, v) if isinstance(v, int) else tuple(v)


def conv2d(x, kernel, bias, stride, same):
    """x (N, H, W, C), kernel (KH, KW, C, F) -> (N, OH, OW, F), TensorFlow's 'valid' or 'same' padding."""
    kh, kw = kernel.shape[:2]
    sh, sw = stride
    if same:
        n, h, w, c = x.shape
        oh, ow = -(-h // sh), -(-w // sw)
        ph, pw = max((oh - 1) * sh + kh - h, 0), max((ow - 1) * sw + kw - w, 0)
        x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))[:, ::sh, ::sw]  # (N, OH, OW, C, KH, KW)
    return np.einsum("nhwcij,ijcf->nhwf", win, kernel, optimize=True) + bias


def max_pool2d(x, size, stride):
    """Windows of `size` every `stride`, 'valid' (a last partial window is dropped)."""
    win = np.lib.stride_tricks.sliding_window_view(x, size, axis=(1, 2))[:, ::stride[0], ::stride[1]]
    return win.max(axis=(4, 5))


def activation(x, name):
    if name in (None, "linear"):
        return x
    if name == "relu":
        return np.maximum(x, 0)
    raise SystemExit(f"activation {name!r} is not known to this check")


def forward(layers, t, images):
    """The model's forward pass when evaluating, from its description and its saved tensors."""
    x = images[..., np.newaxis]  # (N, H, W, 1): channels-last
    seen = {}
    for spec in layers:
        kind = spec["type"]
        name = f"{kind}_{seen.get(kind, 0)}"
        seen[kind] = seen.get(kind, 0) + 1
        if kind == "conv2d":
            x = conv2d(x, t[name + "/kernel"], t[name + "/bias"], pair(spec.get("stride"), 1),
                       spec.get("padding", "valid") == "same")
            x = activation(x, spec.get("activation"))
        elif kind == "max_pool2d":
            size = pair(spec.get("size"), 2)
            x = max_pool2d(x, size, pair(spec.get("stride"), size) if spec.get("stride") else size)
        elif kind == "flatten":
            x = x.reshape(x.shape[0], -1)  # (h, w, c) order
        elif kind == "dense":
            x = activation(x.reshape(x.shape[0], -1) @ t[name + "/kernel"] + t[name + "/bias"], spec.get("activation"))
        elif kind == "relu":
            x = np.maximum(x, 0)
        elif kind == "dropout":
            pass  # identity when evaluating
        else:
            raise SystemExit(f"layer type {kind!r} is not known to this check")
    return x


def check_checkpoint(path, weights):
    """What is wrong with the checkpoint at `path` whose weights should be `weights` (a list; empty: ok)."""
    tensors = load_file(path)
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
    problems = []
    if meta.get("format") != "ringmaster-checkpoint" or meta.get("layout") != "keras":
        problems.append(f"metadata {sorted(meta)} lacks format=ringmaster-checkpoint, layout=keras")
    for name, w in weights.items():
        if name not in tensors or tensors[name].dtype != w.dtype or tensors[name].tobytes() != w.tobytes():
            problems.append(f"{name} is not the saved weights bit for bit")
        for prefix in ("optimizer/m/", "optimizer/v/"):
            if prefix + name not in tensors or tensors[prefix + name].shape != w.shape:
                problems.append(f"no {prefix + name} of shape {w.shape}")
    if len(tensors) != 3 * len(weights):
        problems.append(f"{len(tensors)} tensors, expected {3 * len(weights)}")
    if meta.get("step") != str(int(meta.get("steps_per_epoch", "-1")) * int(meta.get("epochs", "-1"))):
        problems.append(f"step {meta.get('step')} is not the run's last")
    with open(path, "rb") as f:
        raw = f.read()
    n, = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    stored = header["__metadata__"].pop("checksum", "")
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    crc = "crc32:%08x" % zlib.crc32(raw[8 + n:], zlib.crc32(text))
    if stored != crc:
        problems.append(f"checksum {stored!r} in the file, {crc} computed here")
    print(f"check_safetensors: checkpoint {path}: {len(tensors)} tensors, step {meta.get('step')}, {crc}: "
          + ("; ".join(problems) if problems else "ok"))
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--limit-test", type=int, default=0, help="the launcher's --limit-test (0: all)")
    ap.add_argument("--checkpoint", help="the run's last checkpoint, to check as well")
    a = ap.parse_args()

    tensors = load_file(a.weights)
    with safe_open(a.weights, framework="numpy") as f:
        meta = f.metadata() or {}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if shapes != EXPECTED:
        raise SystemExit(f"{a.weights}: tensors {shapes}, expected the cnn's {EXPECTED}")
    if any(v.dtype != np.float32 for v in tensors.values()):
        raise SystemExit(f"{a.weights}: tensors are not all float32")
    if meta.get("layout") != "keras":
        raise SystemExit(f"{a.weights}: metadata {meta} lacks layout=keras")
    t = {k: v.astype(np.float64) for k, v in tensors.items()}

    with open(a.report) as f:
        report = json.load(f)
    images = read_idx(find(a.data, "t10k-images-idx3-ubyte"), 3)
    labels = read_idx(find(a.data, "t10k-labels-idx1-ubyte"), 1).astype(np.int64)
    if a.limit_test:
        images, labels = images[:a.limit_test], labels[:a.limit_test]
    # As the loader scales them: float32(byte) * float32(1/255).
    x = (images.astype(np.float32) * np.float32(1.0 / 255.0)).astype(np.float64)

    # The layers as the file's metadata describes them (kernels/safetensors.hpp; the cnn, as the tensors'
    # names and shapes said above, with relu as a layer or as a convolution's activation), else the cnn's.
    layers = CNN
    if "model" in meta:
        desc = json.loads(meta["model"])
        layers = desc["layers"] if isinstance(desc, dict) else desc
    logits = forward(layers, t, x)
    pred = logits.argmax(axis=1)
    correct = int((pred == labels).sum())
    shifted = logits - logits.max(axis=1, keepdims=True)
    loss = float(np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(len(labels)), labels]))

    n = len(labels)
    theirs = report["test_accuracy"] * n
    allowed = max(1, n // 1000)
    print(f"check_safetensors: numpy forward pass over {n} test images: accuracy {correct / n:.4f} "
          f"({correct} right), loss {loss:.5f}; the launcher reported accuracy {report['test_accuracy']:.4f}, "
          f"loss {report['test_loss']:.5f}")
    ok = True
    if abs(correct - theirs) > allowed + 1e-6:
        print(f"check_safetensors: MISMATCH: {correct} right here, {theirs:.1f} in the report "
              f"(at most {allowed} may differ)")
        ok = False
    if not abs(loss - report["test_loss"]) <= 1e-3 * max(1.0, abs(loss)):
        print(f"check_safetensors: MISMATCH: loss {loss:.6f} here, {report['test_loss']:.6f} in the report")
        ok = False
    if a.checkpoint and check_checkpoint(a.checkpoint, tensors):
        ok = False
    if report["test_accuracy"] < 0.3:
        print("check_safetensors: the run itself did not learn (test accuracy below 0.3)")
        ok = False
    print("check_safetensors: ok" if ok else "check_safetensors: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
