#!/usr/bin/env python3
"""PyTorch DDP reference for train_bench: the same MLP, Adam, gloo, one process per replica.
Prints 'samples_per_sec N'. Needs python3-torch (Debian) or torch from PyPI; never a build dependency."""
import argparse, os, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, args, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(1, os.cpu_count() // args.replicas))
    dist.init_process_group("gloo", rank=rank, world_size=args.replicas)
    dims = [int(d) for d in args.model.split("-")]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    x, y = torch.rand(args.batch, dims[0]), torch.randint(0, dims[-1], (args.batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    for _ in range(20):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    if rank == 0:
        out.put(args.steps * args.batch * args.replicas / (time.perf_counter() - t0))
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
    print("samples_per_sec %.1f" % q.get())
