"""The scatter (``pipeline.scatter``): whatever the blocks, their order and the budget, every shard leaves once,
complete, its rows in slot order; spill files are gone at the end and no waiting group outlives its shards."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutcli.pipeline.scatter import Field, ShardScatter

FIELDS = [Field("x", "x", "observations", torch.float32, (3,)), Field("d", "d", "dones", torch.bool, ())]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    dropped=st.integers(0, 5),
    seed=st.integers(0, 2**31),
    block=st.integers(1, 40),
    budget=st.sampled_from([1, 64, 700, 1 << 20]),
)
def test_every_shard_is_complete_and_exact(sizes: list[int], dropped: int, seed: int, block: int, budget: int) -> None:
    total = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.randperm(total, generator=g), torch.full((dropped,), -1)])
    positions = positions[torch.randperm(positions.numel(), generator=g)]  # item i goes to positions[i]
    items = {"x": torch.randn(positions.numel(), 3, generator=g), "d": torch.rand(positions.numel(), generator=g) < 0.5}
    largest = max(sizes)
    done: dict[int, dict[str, torch.Tensor]] = {}

    def complete(shard: int, rows: dict[str, torch.Tensor]) -> None:
        assert shard not in done
        done[shard] = {name: value.clone() for name, value in rows.items()}

    def buffers(size: int, spanned: bool = False) -> dict[str, torch.Tensor]:
        return {f.name: torch.full((largest, *f.row_shape), 7, dtype=f.dtype)[:size] for f in FIELDS}

    with tempfile.TemporaryDirectory() as tmp:
        out = ShardScatter(Path(tmp), FIELDS, sizes, budget, buffers=buffers, complete=complete)
        for start in range(0, positions.numel(), block):
            items_here = torch.arange(start, min(start + block, positions.numel()))

            def take(index: torch.Tensor, into: dict | None, items_here: torch.Tensor = items_here) -> dict:
                rows = {name: value[items_here[index]] for name, value in items.items()}
                if into is not None:
                    for name, value in rows.items():
                        into[name].copy_(value)
                    return into
                return rows

            out.add(positions[items_here], take)
        out.finish()
        assert not list(Path(tmp).iterdir())  # spill files read and deleted
        assert out.spill.groups == [] and out.spill.pending_bytes == 0
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    assert sorted(done) == list(range(len(sizes)))
    for shard, rows in done.items():
        lo, hi = offsets[shard], offsets[shard + 1]
        which = [int((positions == p).nonzero()) for p in range(lo, hi)]  # the item at each slot
        for name, value in rows.items():
            assert torch.equal(value, items[name][which])
