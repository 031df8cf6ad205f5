"""The scatter (``pipeline.scatter``): whatever the blocks, their order and the budget, every shard leaves once,
complete, its rows in slot order; spill files are gone at the end and no waiting group outlives its shards."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutcli.pipeline.progress import Progress
from rolloutcli.pipeline.scatter import Emitter, Field, ShardScatter

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


class _Writer:
    """``ShardWriter``'s contract: ``submit`` queues a shard once the one before is written; ``wait`` ends the one
    in flight. Records the buffers of the shard in flight."""

    def __init__(self) -> None:
        self.flight: int | None = None

    def submit(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.flight = tensors["x"].data_ptr()

    def wait(self) -> None:
        self.flight = None


def _emitter(writer: _Writer, buffer_sets: int = 2) -> Emitter:
    plan: Any = SimpleNamespace(passes=[SimpleNamespace(sizes=[4] * 8)], epoch_pass=[0])
    return Emitter(plan, writer, FIELDS, Progress(), lambda _, __, rows: rows, buffer_sets=buffer_sets)  # type: ignore[arg-type]


def test_only_shards_from_one_block_take_a_second_buffer_set() -> None:
    """A shard assembled from pieces (``spanned``) waits for the shard in flight and takes its buffers; a shard
    gathered from one block is filled while the one before is written, never into its buffers. Shards that are
    all assembled (a dataset of many files) so hold one set: a second grew with the shards (issue 39)."""
    writer = _Writer()
    emitter, lent = _emitter(writer), []
    for shard, spanned in enumerate([False, False, True, True, False, True, False, False]):
        rows = emitter.buffers(4, spanned)
        pointer = rows["x"].data_ptr()
        assert pointer != writer.flight  # never the buffers being written
        assert writer.flight is None or not spanned  # an assembled shard waited first
        lent.append(pointer)
        emitter.emit(0, shard, rows)
    assert len(set(lent)) == 2
    for buffer_sets, spanned in ((2, True), (1, False)):  # every shard assembled; one set asked for
        writer, lent = _Writer(), []
        emitter = _emitter(writer, buffer_sets)
        for shard in range(4):
            rows = emitter.buffers(4, spanned)
            assert writer.flight is None
            lent.append(rows["x"].data_ptr())
            emitter.emit(0, shard, rows)
        assert len(set(lent)) == 1
