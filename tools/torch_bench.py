#!/usr/bin/env python3
"""The same models as tools/gpu_bench.cpp in PyTorch eager, for a side-by-side figure.

    python3 tools/torch_bench.py [seconds per measurement, default 1.5]

The MLPs (dense layers with ReLU between them) and the Keras "simple MNIST convnet" ("cnn": NCHW, conv 32
3x3 -> ReLU -> max-pool 2 -> conv 64 3x3 -> ReLU -> max-pool 2 -> flatten -> dropout 0.5 -> linear 10),
softmax cross-entropy, fused Adam (lr 1e-3, eps 1e-7 as Keras), random data (8 batches cycled on the GPU),
FP32 matmuls and convolutions (TF32 off, as ringmaster), cuDNN autotuning on (PyTorch's fastest eager
convolutions). Two figures per model and batch: "async" never reads the loss back (PyTorch at its best);
"item" calls loss.item() every step, as a ringmaster replica reads its loss and hit count every step.
Lines starting with RESULT are read by tools/gpu-check.sh. Exits 77 when torch or a CUDA device is missing.
"""
import sys
import time


def build(torch, model):
    """The network and the shape of one sample."""
    nn = torch.nn
    if model == "cnn":
        net = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.5), nn.Linear(64 * 5 * 5, 10))
        return net, (1, 28, 28), 10
    dims = [int(d) for d in model.split("-")]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers), (dims[0],), dims[-1]


def bench(torch, model, batch, seconds, read_loss):
    nn = torch.nn
    net, sample, classes = build(torch, model)
    net = net.cuda().train()
    # fused=True: PyTorch's fastest eager Adam (one kernel for all tensors), as ringmaster's is fused.
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-7, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    xs = torch.rand(8, batch, *sample, device="cuda")
    ys = torch.randint(0, classes, (8, batch), device="cuda")

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(xs[i % 8]), ys[i % 8])
        loss.backward()
        opt.step()
        if read_loss:
            loss.item()

    for i in range(10):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while True:
        for _ in range(10):
            step(steps)
            steps += 1
        if time.perf_counter() - t0 >= seconds:
            break
    torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - t0)


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5
    try:
        import torch
    except ImportError as e:
        print(f"torch_bench: SKIPPED: {e}")
        return 77
    if not torch.cuda.is_available():
        print(f"torch_bench: SKIPPED: torch {torch.__version__} sees no CUDA device")
        return 77
    # Plain FP32 GEMMs and convolutions (cuDNN's default is TF32), as ringmaster's cuBLAS calls: the newer
    # switches where they exist (torch 2.9+, which refuses mixing them with the old ones), else the old ones.
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    print(f"torch_bench: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"{seconds:.1f} s per figure")
    print(f"{'model':16} {'batch':>6} {'async s/s':>14} {'item s/s':>14}")
    for model in ("784-512-512-10", "784-64-10", "cnn"):
        for batch in (128, 1024):
            a = bench(torch, model, batch, seconds, False)
            b = bench(torch, model, batch, seconds, True)
            print(f"{model:16} {batch:6d} {a:14.0f} {b:14.0f}")
            print(f"RESULT torch {model} {batch} {a:.0f} {b:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
