"""gpufeed.torch on the CPU backend, where torch is installed (the GPU machine; skipped loudly
elsewhere unless GPUFEED_REQUIRE_TORCH=1 makes its absence a failure)."""

import os

import numpy as np
import pytest

if os.environ.get("GPUFEED_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401
else:
    torch = pytest.importorskip("torch", reason="torch is not installed here")


def test_state_dict_resumes_at_another_world_size(daemon):
    from gpufeed.torch import GpufeedDataset

    full = GpufeedDataset(daemon.socket, "toy", 50, shuffle="full", seed=4, rank=0, world_size=1,
                          device="cpu", fields=["ids"])
    # Copies: a view would keep its slot, and the stream has only `prefetch` of them.
    order = np.concatenate([b["ids"][:, 0].numpy().copy() for b in full])
    first = GpufeedDataset(daemon.socket, "toy", 50, shuffle="full", seed=4, rank=0, world_size=1,
                           device="cpu", fields=["ids"])
    it = iter(first)
    head = [next(it)["ids"][:, 0].numpy().copy() for _ in range(4)]
    state = first.state_dict()
    del it
    rest = []
    for rank in range(2):
        part = GpufeedDataset(daemon.socket, "toy", 50, rank=rank, world_size=2, device="cpu",
                              fields=["ids"])
        part.load_state_dict(state)
        rest += [b["ids"][:, 0].numpy().copy() for b in part]
    served = np.concatenate(head + rest)
    assert len(served) == len(order) and set(served.tolist()) == set(order.tolist())
    np.testing.assert_array_equal(np.concatenate(head), order[:200])
