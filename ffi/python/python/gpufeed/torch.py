"""PyTorch integration: an ``IterableDataset`` of dicts of tensors on the rank's GPU, checkpointable
with ``state_dict()`` / ``load_state_dict()`` (the torchdata ``StatefulDataLoader`` and
``torch.distributed.checkpoint`` ``Stateful`` convention). Batches come from the daemon already
formed, so no DataLoader worker processes are needed: iterate the dataset directly, or wrap it with
:func:`loader` (``batch_size=None``, ``num_workers=0``).

Rank and world size are read each time the dataset is iterated (so a dataset made before
``torch.distributed.init_process_group`` sees the group): from ``torch.distributed`` when it is
initialised, else from the ``RANK`` and ``WORLD_SIZE`` environment variables (``torchrun`` sets both),
unless given. The device is ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU.
"""

import os
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.utils.data

import gpufeed
from gpufeed._dtypes import normalize_fields


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

    ``dataset`` is a dataset's name, or a mixture's sources: ``[("web", 0.7), ("code", 0.3)]``
    (see ``open_stream(sources=...)``; on a CUDA device its batches are assembled on the host and
    uploaded, at a few GB/s rather than the GPU pipeline's rate).
    ``socket`` None: ``$GPUFEED_SOCKET`` (see :class:`gpufeed.Client`). ``fields`` takes dtypes as
    gpufeed names (``"f32"``), NumPy or PyTorch names (``"float32"``) or types (``torch.float32``).
    ``rank`` and ``world_size`` None: read from ``torch.distributed`` or the environment each time the
    dataset is iterated. Iterate it in the main process (``num_workers=0``): the batches are formed
    by the daemon already, and a worker process would read the whole epoch again.

    After each batch, :attr:`step` is its step in the epoch and :attr:`replaced` its samples that
    were zero-filled because their block was corrupt (``on_corrupt="replace"``).

    ``open_ahead``: when that share of an epoch's batches is left, the next epoch's stream is opened
    (on a connection of its own), so that its first batches are ready when the next iteration starts
    instead of waiting for the daemon to open and fill it (0: never). The next iteration uses it if
    it asks for that epoch with the same settings (``set_epoch(epoch + 1)`` or nothing), else closes
    it; :meth:`close` closes it too.
    """

    def __init__(
        self,
        socket: Optional[str],
        dataset: Union[str, Sequence[Tuple[str, float]]],
        batch_size: int,
        *,
        fields: Union[None, Sequence[str], Mapping[str, Any]] = None,
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
        open_ahead: float = 0.3,
    ):
        super().__init__()
        if not 0.0 <= open_ahead < 1.0:
            raise ValueError(f"open_ahead must be at least 0 and below 1, not {open_ahead!r}")
        self.open_ahead = open_ahead
        # The next epoch's stream opened ahead: (the settings it was opened with, client, stream).
        self._ahead: Optional[tuple] = None
        self.socket = socket
        # A mixture's sources as a tuple of (name, weight) pairs (hashable: a key of the caches).
        self.dataset = dataset if isinstance(dataset, str) else tuple(
            (str(name), float(weight)) for name, weight in dataset)
        self.batch_size = batch_size
        # Dtypes as gpufeed's names: an unknown one fails here, naming its field.
        self.fields = normalize_fields(fields)
        self.shuffle = shuffle
        self.window_shards = window_shards
        self.seed = seed
        self.epoch = epoch
        self._rank = rank
        self._world_size = world_size
        self.device = device or _default_device()
        self.tail = tail
        self.on_corrupt = on_corrupt
        self.prefetch = prefetch
        #: The step in its epoch of the last batch yielded (None before the first).
        self.step: Optional[int] = None
        #: Samples of the last batch yielded that were zero-filled for a corrupt block.
        self.replaced: int = 0
        self._stream: Optional[gpufeed.Stream] = None
        self._resume: Optional[Dict[str, Any]] = None
        # Samples per epoch of each dataset name streamed (for __len__): a property of the dataset,
        # the same in every epoch and order.
        self._epoch_samples: Dict[Any, int] = {}

    def _source(self, dataset: Union[str, Tuple[Tuple[str, float], ...], None] = None) -> Dict[str, Any]:
        """``open_stream``'s arguments naming what is read: the dataset, or a mixture's sources."""
        dataset = self.dataset if dataset is None else dataset
        if isinstance(dataset, str):
            return dict(dataset=dataset)
        return dict(sources=list(dataset))

    @property
    def rank(self) -> int:
        """This rank: as given, else ``torch.distributed``'s or ``RANK`` (read now)."""
        return _rank_and_world()[0] if self._rank is None else self._rank

    @rank.setter
    def rank(self, rank: Optional[int]) -> None:
        self._rank = rank

    @property
    def world_size(self) -> int:
        """Ranks reading the epoch together: as given, else ``torch.distributed``'s or
        ``WORLD_SIZE`` (read now)."""
        return _rank_and_world()[1] if self._world_size is None else self._world_size

    @world_size.setter
    def world_size(self, world_size: Optional[int]) -> None:
        self._world_size = world_size

    def set_epoch(self, epoch: int) -> None:
        """Serves ``epoch`` next (a new order for shuffled streams)."""
        self.epoch = epoch
        self._resume = None

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "GpufeedDataset was iterated in a DataLoader worker process: use num_workers=0 "
                "(gpufeed.torch.loader(dataset), or DataLoader(dataset, batch_size=None, "
                "num_workers=0)). The daemon forms the batches on the device already; each worker "
                "would read the whole epoch again.")
        # Rank and world size now, not at construction: init_process_group may have run since.
        common = self._common()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            key, client, stream = ahead
            if self._resume is None and key == self._key(self.epoch, common):
                return self._batches(client, stream)
            stream.close()
            client.close()
        client = gpufeed.Client(self.socket)
        try:
            if self._resume is not None:
                stream = client.open_stream(batch_size=self.batch_size, state=self._resume,
                                            **self._source(), **common)
            else:
                stream = client.open_stream(batch_size=self.batch_size, shuffle=self.shuffle,
                                            window_shards=self.window_shards, seed=self.seed,
                                            epoch=self.epoch, **self._source(), **common)
        except BaseException:
            client.close()
            raise
        return self._batches(client, stream)

    def _batches(self, client: gpufeed.Client,
                 stream: gpufeed.Stream) -> Iterator[Dict[str, torch.Tensor]]:
        self._stream = stream
        self._epoch_samples[self.dataset] = stream.epoch_samples
        try:
            if self.device.startswith("cuda"):
                device = torch.device(self.device)
                stream.set_cuda_stream(torch.cuda.current_stream(device).cuda_stream)
            steps = stream.steps
            ahead_at = steps - int(steps * self.open_ahead) if self.open_ahead > 0 else None
            yielded = 0
            for batch in stream:
                self.step = batch.step
                self.replaced = batch.replaced
                # torch.from_dlpack passes the current stream to __dlpack__: it waits for the batch
                # on the device, and the slot is released after the work queued on it.
                yield {name: torch.from_dlpack(field) for name, field in batch.items()}
                del batch
                yielded += 1
                if ahead_at is not None and yielded >= ahead_at and self._ahead is None:
                    self._open_ahead(self.epoch + 1)
            self._resume = None
            self.epoch += 1
        finally:
            self._stream = None
            stream.close()
            client.close()

    def _common(self) -> Dict[str, Any]:
        return dict(fields=self.fields, device=self.device, rank=self.rank,
                    world_size=self.world_size, tail=self.tail, on_corrupt=self.on_corrupt,
                    prefetch=self.prefetch)

    def _key(self, epoch: int, common: Dict[str, Any]) -> tuple:
        """What a stream opened ahead must have been opened with to serve an iteration."""
        fields = common["fields"]
        fields = tuple(fields.items()) if isinstance(fields, Mapping) else fields
        return (self.socket, self.dataset, self.batch_size, self.shuffle, self.window_shards,
                self.seed, epoch, fields, common["device"], common["rank"], common["world_size"],
                common["tail"], common["on_corrupt"], common["prefetch"])

    def _open_ahead(self, epoch: int) -> None:
        """Opens epoch ``epoch``'s stream now, for the next iteration. A failure (no slot memory left
        for a second stream, say) only means the next iteration opens its stream itself."""
        common = self._common()
        try:
            client = gpufeed.Client(self.socket)
        except Exception:
            return
        try:
            stream = client.open_stream(batch_size=self.batch_size, shuffle=self.shuffle,
                                        window_shards=self.window_shards, seed=self.seed,
                                        epoch=epoch, **self._source(), **common)
        except Exception:
            client.close()
            return
        self._ahead = (self._key(epoch, common), client, stream)

    def close(self) -> None:
        """Closes the next epoch's stream if it was opened ahead (the current one closes with its
        iteration)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[2].close()
            ahead[1].close()

    def __len__(self) -> int:
        """Batches one iteration yields on this rank: the epoch's (from the checkpoint's cursor
        after :meth:`load_state_dict`), per the ``tail`` rule: ``"drop"`` leaves out the samples
        that do not fill a step of ``batch_size`` × ``world_size``, ``"pad"`` fills that step.
        While an iteration runs, that iteration's.

        The first call before any iteration opens a stream to learn the epoch's sample count."""
        if self._stream is not None:
            return self._stream.steps
        dataset = self.dataset
        samples = self._epoch_samples.get(dataset)
        if samples is None:
            samples = self._epoch_samples[dataset] = self._probe_epoch_samples(dataset)
        cursor = self._resume["cursor"] if self._resume else 0
        left = max(samples - cursor, 0)
        step_samples = self.world_size * self.batch_size
        if self.tail == "pad":
            return -(-left // step_samples)
        return left // step_samples

    def _probe_epoch_samples(self, dataset: Union[str, Tuple[Tuple[str, float], ...]]) -> int:
        """The epoch's sample count, from a stream opened for it and closed at once: one field, one
        sample per batch, in host memory (the least the daemon fills)."""
        fields = self.fields
        if fields:
            fields = [next(iter(fields))]
        with gpufeed.Client(self.socket) as client:
            with client.open_stream(batch_size=1, fields=fields, device="cpu", prefetch=1,
                                    **self._source(dataset)) as stream:
                return stream.epoch_samples

    def state_dict(self) -> Dict[str, Any]:
        """Where the epoch stands: resumable at this or another world size."""
        if self._stream is not None:
            return {"epoch": self.epoch, "stream": self._stream.state_dict()}
        return {"epoch": self.epoch, "stream": self._resume}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from a :meth:`state_dict` at the next iteration."""
        self.epoch = state["epoch"]
        self._resume = state.get("stream")
        self.close()


def loader(dataset: GpufeedDataset) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` that adds nothing: batches are already formed, in the main
    process (``batch_size=None``, ``num_workers=0``)."""
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)
