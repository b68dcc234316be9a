#!/usr/bin/env python3
"""PyTorch DDP reference for train_bench: the same model, Adam, gloo, one process per replica (each with
cores / replicas threads: one on a 2-core machine with 2 replicas). Models: MLP widths ("784-512-512-10",
ReLU between Dense layers) or "cnn", the Keras simple MNIST convnet in NCHW (conv 32 3x3, relu, maxpool 2,
conv 64 3x3, relu, maxpool 2, flatten, dropout 0.5, dense 10) on (1, 28, 28) inputs.
Prints 'samples_per_sec N' (wall clock) and 'cpu_samples_per_sec N' (per CPU-second of all processes,
times the cores: less sensitive to other load on a shared machine). Needs python3-torch (Debian) or torch
from PyPI; never a build dependency.

  python3 tools/torch_ddp_bench.py --model cnn --replicas 2 --batch 64 --steps 300"""
import argparse, os, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, args, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(1, os.cpu_count() // args.replicas))
    dist.init_process_group("gloo", rank=rank, world_size=args.replicas)
    torch.manual_seed(rank)
    if args.model == "cnn":
        nn = torch.nn
        layers = [nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                  nn.Flatten(), nn.Dropout(0.5), nn.Linear(64 * 5 * 5, 10)]
        in_shape, classes = (1, 28, 28), 10
    else:
        dims = [int(d) for d in args.model.split("-")]
        layers = []
        for i in range(len(dims) - 1):
            layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
            if i + 2 < len(dims):
                layers.append(torch.nn.ReLU())
        in_shape, classes = (dims[0],), dims[-1]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    x, y = torch.rand(args.batch, *in_shape), torch.randint(0, classes, (args.batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    for _ in range(20):
        step()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    dist.barrier()
    out.put((rank, args.steps * args.batch * args.replicas / (time.perf_counter() - t0), time.process_time() - c0))
    dist.destroy_process_group()

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="784-512-512-10")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="per replica")
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args()
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(a, port, q), nprocs=a.replicas)
    results = sorted(q.get() for _ in range(a.replicas))
    print("samples_per_sec %.1f" % results[0][1])
    # Samples per CPU-second of all processes (all their threads), times the cores: what the wall-clock
    # rate would be on an otherwise idle machine if nothing waited (an upper bound; for shared machines).
    cpu = sum(r[2] for r in results)
    print("cpu_samples_per_sec %.1f" % (a.steps * a.batch * a.replicas / cpu * os.cpu_count()))
