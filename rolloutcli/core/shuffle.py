"""Load-time orders: which permutation a reader uses for a given seed, epoch and stream.

Every load-time shuffle (``ShardDataset(shuffle=True)``: the order of shards, the order of rows within a shard)
goes through :func:`epoch_order`, the same stateless bijection as the exports' default order
(:class:`rolloutcli.core.order.RowOrder`), keyed by ``(seed, epoch, stream)``. Nothing here touches the global RNG.
"""

from __future__ import annotations

import hashlib

import torch

from rolloutcli.core.order import RowOrder


def epoch_order(n: int, seed: int, epoch: int, stream: int = 0) -> torch.Tensor:
    """``[n]`` int64, a permutation of ``range(n)`` that depends only on ``(seed, epoch, stream)``.

    ``stream`` separates the orders one epoch needs (0: the shards; ``k + 1``: the rows of the k-th shard of the
    manifest), so each can be drawn alone, in any process, without drawing the others first.
    """
    key = hashlib.blake2b(f"{seed}/{epoch}/{stream}".encode(), digest_size=8).digest()
    return RowOrder(int.from_bytes(key, "little") >> 2, n).rows()
