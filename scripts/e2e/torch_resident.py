"""The in-process peer of gpufeed's device-memory tier: a PyTorch program holding the whole dataset in
its own device memory, gathering each batch's rows and converting them to fp32 (`x[idx].float()`).

    python3 scripts/e2e/torch_resident.py --file /var/tmp/gpufeed-read/npy/emb_fp16.npy \
        --batch-sizes 4096,1024 --orders none,full --epochs 8 --repeat 3 --jsonl out.jsonl

The .npy (fp16, [N, D]) is copied to the device once, chunk by chunk (not timed). Each run times
`--epochs` epochs back to back after one warm-up epoch: in order (`none`: consecutive rows, sliced)
or fully shuffled (`full`: a `torch.randperm` of the rows per epoch on the device, timed with the
epoch, then one fancy index per batch). Every batch is kept until the next is made, as a training
step would use it. One JSON line per run: GB/s of fp16 rows in (the rate gpufeed's benchmark
reports). A window shuffle has no counterpart here (it is a loader's compromise for reading from
storage); the line says so.
"""
import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", required=True)
    parser.add_argument("--batch-sizes", default="4096")
    parser.add_argument("--orders", default="none,full")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jsonl")
    args = parser.parse_args()

    import torch

    source = np.load(args.file, mmap_mode="r")
    rows, width = source.shape
    x = torch.empty((rows, width), dtype=torch.float16, device="cuda")
    chunk = max(1, (256 << 20) // (width * 2))
    for start in range(0, rows, chunk):
        x[start:start + chunk].copy_(torch.from_numpy(np.ascontiguousarray(source[start:start + chunk])))
    torch.cuda.synchronize()
    row_bytes = width * 2
    out = open(args.jsonl, "a") if args.jsonl else None

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line)
        if out:
            out.write(line + "\n")
            out.flush()

    def epoch(order: str, batch: int, generator: "torch.Generator") -> int:
        steps = rows // batch
        perm = torch.randperm(rows, device="cuda", generator=generator) if order == "full" else None
        held = None
        for step in range(steps):
            if perm is None:
                held = x[step * batch:(step + 1) * batch].float()
            else:
                held = x[perm[step * batch:(step + 1) * batch]].float()
        del held
        return steps * batch

    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for order in args.orders.split(","):
            if order == "window":
                emit({"loader": "torch-resident", "order": order, "batch_size": batch,
                      "skipped": "no window shuffle in the in-process peer (its full shuffle bounds it)"})
                continue
            for run in range(1, args.repeat + 1):
                generator = torch.Generator(device="cuda")
                generator.manual_seed(run)
                epoch(order, batch, generator)
                torch.cuda.synchronize()
                started = time.perf_counter()
                samples = sum(epoch(order, batch, generator) for _ in range(args.epochs))
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                emit({"loader": "torch-resident", "order": order, "run": run, "batch_size": batch,
                      "epochs": args.epochs, "seconds": seconds, "bytes_in": samples * row_bytes,
                      "gb_per_s_in": samples * row_bytes / seconds / 1e9,
                      "dataset_bytes": rows * row_bytes})


if __name__ == "__main__":
    main()
