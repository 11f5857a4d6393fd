"""The Python consumer's rate: one epoch of a stream, each field taken into PyTorch with
torch.from_dlpack (zero-copy), no other work (or, with --touch, a sum of each batch). As the Rust
consumer does, PyTorch's CUDA context is made first and the timer starts before the client connects.
Prints one JSON line: seconds (from before connecting to the epoch's end, the device synchronised),
iterate seconds (from the first batch requested), open seconds, bytes, batches, microseconds per
batch."""

import argparse
import json
import time

t_process = time.perf_counter()

import torch  # noqa: E402

import gpufeed  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--socket", required=True)
parser.add_argument("--dataset", required=True)
parser.add_argument("--batch-size", type=int, required=True)
parser.add_argument("--device", default="cuda:0")
parser.add_argument("--dtype", default="f32")
parser.add_argument("--field", default="emb")
parser.add_argument("--prefetch", type=int, default=4)
parser.add_argument("--touch", action="store_true",
                    help="sum every batch on the GPU (queued on the consumer's stream), so that the "
                         "timer also covers reading the data")
args = parser.parse_args()

device = torch.device(args.device)
# The CUDA context first (as a training process has it before its loader starts).
torch.zeros((), device=device)
cuda_stream = torch.cuda.current_stream(device)
torch.cuda.synchronize(device)
t_connect = time.perf_counter()
client = gpufeed.Client(args.socket)
stream = client.open_stream(args.dataset, args.batch_size, device=args.device,
                            fields={args.field: args.dtype}, prefetch=args.prefetch)
stream.set_cuda_stream(cuda_stream.cuda_stream)
t_first = time.perf_counter()
batches = 0
nbytes = 0
total = torch.zeros((), dtype=torch.float64, device=device)
for batch in stream:
    tensor = torch.from_dlpack(batch[args.field])
    nbytes += tensor.numel() * tensor.element_size()
    batches += 1
    if args.touch:
        total += tensor.sum(dtype=torch.float64)
    del tensor, batch
torch.cuda.current_stream(device).synchronize()
t_end = time.perf_counter()
print(json.dumps({
    "loader": "gpufeed-python-touch" if args.touch else "gpufeed-python",
    "batch_size": args.batch_size, "batches": batches, "bytes": nbytes,
    "open_seconds": t_first - t_connect, "checksum": float(total.item()),
    "seconds": t_end - t_connect, "iterate_seconds": t_end - t_first,
    "process_seconds": t_end - t_process,
    "us_per_batch": (t_end - t_connect) / max(batches, 1) * 1e6,
}))
