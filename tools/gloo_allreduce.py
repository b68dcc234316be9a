#!/usr/bin/python3
"""Gloo's ring all-reduce (PyTorch's torch.distributed, backend gloo) over TCP loopback: the baseline for
allreduce_bench in the same run, timed as it times (back to back after a barrier, the slowest rank).
Prints rows like allreduce_bench: size_bytes time_us algbw busbw wrong.

  python3 tools/gloo_allreduce.py --ranks 2 --sizes 4K,64M --iters 20
Needs python3-torch (Debian) or torch from PyPI; a check of our figures, never a build dependency."""
import argparse, os, socket, time
import torch, torch.distributed as dist, torch.multiprocessing as mp


def size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def worker(rank, args, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    for nbytes in args.sizes:
        buf = torch.ones(nbytes // 4)
        expected = torch.arange(buf.numel()) % 64 * args.ranks + args.ranks * (args.ranks + 1) // 2
        wrong = 0
        for it in range(max(1, args.warmup)):  # checked
            buf.copy_(torch.arange(buf.numel()) % 64 + rank + 1)
            dist.all_reduce(buf)
            wrong += int((buf != expected).sum())
        # Timed as allreduce_bench and nccl-tests time: back to back after a barrier, the slowest rank.
        buf.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        for it in range(args.iters):
            dist.all_reduce(buf)
        t = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64)
        wrong += int((buf != 0).sum())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        w = torch.tensor([wrong], dtype=torch.float64)
        dist.all_reduce(w)
        if rank == 0:
            t = float(t)
            algbw = nbytes / t / 1e9
            busbw = algbw * 2 * (args.ranks - 1) / args.ranks
            print(f"gloo {nbytes:12d} {t * 1e6:12.1f} {algbw:10.3f} {busbw:10.3f} {int(w):8d}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="4K,64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    args.sizes = [size(s) for s in args.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print("# gloo size_bytes time_us algbw_GBps busbw_GBps wrong")
    mp.spawn(worker, args=(args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
