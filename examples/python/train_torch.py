"""Trains a small classifier on gpufeed batches: on one GPU, under torchrun, or on the CPU.

    # once: a synthetic dataset (features x: fp16 [N, 64], labels y: int32 [N]) under a data root
    python examples/python/train_torch.py make-data /data/gpufeed-toy
    gpufeed serve --data-root /data --socket /tmp/gpufeed.sock --device auto &
    # one GPU
    python examples/python/train_torch.py train --socket /tmp/gpufeed.sock --dataset gpufeed-toy
    # two ranks (two GPUs, or two ranks on one GPU with --same-gpu)
    torchrun --nproc-per-node 2 examples/python/train_torch.py train --socket /tmp/gpufeed.sock \\
        --dataset gpufeed-toy
    # no GPU: batches in host memory (a daemon started with --device cpu serves them; so does a
    # GPU daemon), the model on the CPU; torchrun works here too
    python examples/python/train_torch.py train --socket /tmp/gpufeed.sock --dataset gpufeed-toy \\
        --device cpu

Each rank reads its own part of every step (rank and world size from torch.distributed), the
features arrive as fp32 on the rank's GPU (or in host memory with --device cpu) without a copy, and a
checkpoint of the data position is written with the model every --checkpoint-every steps (resume
with --resume).
"""

import argparse
import os
import pathlib
import subprocess
import tempfile

import numpy as np


def make_data(out: pathlib.Path, samples: int, gpufeed: str) -> None:
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((10, 64)).astype(np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    x = (centers[y] + 0.5 * rng.standard_normal((samples, 64))).astype(np.float16)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/x.npy", x)
        np.save(f"{tmp}/y.npy", y)
        subprocess.run([gpufeed, "pack", "--out", str(out), "--field", f"x={tmp}/x.npy",
                        "--field", f"y={tmp}/y.npy", "--samples-per-shard", str(samples // 8)],
                       check=True)


def train(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gpufeed.torch import GpufeedDataset

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_cpu = args.device == "cpu"
    gpu = 0 if args.same_gpu else local_rank
    if not on_cpu:
        torch.cuda.set_device(gpu)
    if world > 1:
        # gloo on the CPU and when several ranks share one GPU (NCCL refuses that), NCCL otherwise.
        dist.init_process_group("gloo" if on_cpu or args.same_gpu else "nccl")
    rank = dist.get_rank() if world > 1 else 0
    device = torch.device("cpu" if on_cpu else f"cuda:{gpu}")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10)).to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=None if on_cpu or args.same_gpu else [gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The daemon places the batches: "cpu" asks for host memory, which any daemon serves.
    data = GpufeedDataset(args.socket, args.dataset, args.batch_size,
                          fields={"x": "f32", "y": None}, shuffle="window", window_shards=2,
                          seed=1, device=str(device))
    if args.resume and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        data.load_state_dict(state["data"])
    step = 0
    for epoch in range(args.epochs):
        for batch in data:
            logits = model(batch["x"])
            loss = F.cross_entropy(logits, batch["y"].long())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.checkpoint_every == 0 and rank == 0:
                torch.save({"model": model.state_dict(), "data": data.state_dict()}, args.checkpoint)
            if step % 20 == 0 and rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            accuracy = (logits.argmax(1) == batch["y"].long()).float().mean().item()
            print(f"epoch {epoch} done: last batch accuracy {accuracy:.3f}", flush=True)
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-data")
    make.add_argument("out", type=pathlib.Path)
    make.add_argument("--samples", type=int, default=65536)
    make.add_argument("--gpufeed", default="gpufeed")
    run = sub.add_parser("train")
    run.add_argument("--socket", required=True)
    run.add_argument("--dataset", required=True)
    run.add_argument("--batch-size", type=int, default=512)
    run.add_argument("--epochs", type=int, default=3)
    run.add_argument("--checkpoint", default="/tmp/gpufeed-train-ckpt.pt")
    run.add_argument("--checkpoint-every", type=int, default=50)
    run.add_argument("--resume", action="store_true")
    run.add_argument("--same-gpu", action="store_true",
                     help="put every rank on GPU 0 (a machine with one GPU)")
    run.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                     help="cuda: each rank on its GPU (cuda:LOCAL_RANK); cpu: batches in host "
                          "memory and the model on the CPU, no GPU needed")
    args = parser.parse_args()
    if args.command == "make-data":
        make_data(args.out, args.samples, args.gpufeed)
    else:
        train(args)


if __name__ == "__main__":
    main()
