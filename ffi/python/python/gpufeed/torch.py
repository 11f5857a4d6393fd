"""PyTorch integration: an ``IterableDataset`` of dicts of tensors on the rank's GPU, checkpointable
with ``state_dict()`` / ``load_state_dict()`` (the torchdata ``StatefulDataLoader`` and
``torch.distributed.checkpoint`` ``Stateful`` convention). Batches come from the daemon already
formed, so no DataLoader worker processes are needed: iterate the dataset directly, or wrap it with
:func:`loader` (``batch_size=None``, ``num_workers=0``).

Rank and world size come from ``torch.distributed`` when it is initialised, else from the ``RANK`` and
``WORLD_SIZE`` environment variables (``torchrun`` sets both); the device is ``cuda:LOCAL_RANK`` when
CUDA is available, else the CPU.
"""

import os
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.utils.data

import gpufeed


def _rank_and_world() -> "tuple[int, int]":
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


class GpufeedDataset(torch.utils.data.IterableDataset):
    """One epoch per iteration of batches from the gpufeed daemon at ``socket``, as dicts of tensors.

    Each tensor aliases the daemon's slot (zero-copy); it is ready for work on the current CUDA
    stream, and the slot is reused once the tensors of the batch are gone and the work queued on that
    stream before then is done. Keep a tensor beyond the next few steps by cloning it.
    """

    def __init__(
        self,
        socket: str,
        dataset: str,
        batch_size: int,
        *,
        fields: Union[None, Sequence[str], Mapping[str, Optional[str]]] = None,
        shuffle: str = "none",
        window_shards: int = 4,
        seed: int = 0,
        epoch: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        device: Optional[str] = None,
        tail: str = "drop",
        on_corrupt: str = "fail",
        prefetch: int = 4,
    ):
        super().__init__()
        found_rank, found_world = _rank_and_world()
        self.socket = socket
        self.dataset = dataset
        self.batch_size = batch_size
        self.fields = fields
        self.shuffle = shuffle
        self.window_shards = window_shards
        self.seed = seed
        self.epoch = epoch
        self.rank = found_rank if rank is None else rank
        self.world_size = found_world if world_size is None else world_size
        self.device = device or _default_device()
        self.tail = tail
        self.on_corrupt = on_corrupt
        self.prefetch = prefetch
        self._stream: Optional[gpufeed.Stream] = None
        self._resume: Optional[Dict[str, Any]] = None

    def set_epoch(self, epoch: int) -> None:
        """Serves ``epoch`` next (a new order for shuffled streams)."""
        self.epoch = epoch
        self._resume = None

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        client = gpufeed.Client(self.socket)
        common = dict(fields=self.fields, device=self.device, rank=self.rank, world=self.world_size,
                      tail=self.tail, on_corrupt=self.on_corrupt, prefetch=self.prefetch)
        if self._resume is not None:
            stream = client.open_stream(self.dataset, self.batch_size, state=self._resume,
                                        **common)
        else:
            stream = client.open_stream(self.dataset, self.batch_size, shuffle=self.shuffle,
                                        window_shards=self.window_shards, seed=self.seed,
                                        epoch=self.epoch, **common)
        self._stream = stream
        if self.device.startswith("cuda"):
            device = torch.device(self.device)
            stream.set_cuda_stream(torch.cuda.current_stream(device).cuda_stream)
        try:
            for batch in stream:
                # torch.from_dlpack passes the current stream to __dlpack__: it waits for the batch
                # on the device, and the slot is released after the work queued on it.
                yield {name: torch.from_dlpack(batch[name]) for name in batch.keys()}
                del batch
            self._resume = None
            self.epoch += 1
        finally:
            self._stream = None
            stream.close()

    def state_dict(self) -> Dict[str, Any]:
        """Where the epoch stands: resumable at this or another world size."""
        if self._stream is not None:
            return {"epoch": self.epoch, "stream": self._stream.state_dict()}
        return {"epoch": self.epoch, "stream": self._resume}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from a :meth:`state_dict` at the next iteration."""
        self.epoch = state["epoch"]
        self._resume = state.get("stream")


def loader(dataset: GpufeedDataset) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` that adds nothing: batches are already formed, in the main
    process (``batch_size=None``, ``num_workers=0``)."""
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)
