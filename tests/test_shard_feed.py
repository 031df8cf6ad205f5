"""``ShardDataset`` as a map-style dataset: items, one epoch per pass, load-time shuffling, ranks, prefetch."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from rollout_factory import shard_folders
from test_batching import full_arrays
from torch.utils.data import DataLoader

from rolloutcli import RolloutError, ShardDataset
from rolloutcli.core.shuffle import epoch_order
from rolloutcli.minibatch import Batch
from rolloutcli.pipeline.batch import BatchOptions

T, N = 12, 5


folders = shard_folders(
    "feed",
    full_arrays(T, N, hidden="gru"),
    {
        "feedforward": BatchOptions(6, epochs=3, seed=1),
        "recurrent": BatchOptions(5, mode="recurrent"),
        "distillation": BatchOptions(3, mode="distillation", epochs=2),
    },
)


def rows_of(batch: Batch) -> list[int]:
    """Source rows ``t * N + n`` of a feed-forward batch (identifiable observations ``t * 1000 + n``)."""
    values = batch.observations["policy"][:, 0].round().long()
    return (values // 1000 * N + values % 1000).tolist()


def test_map_style_items_and_one_epoch_per_pass(folders) -> None:
    dataset = ShardDataset(folders["feedforward"])
    assert len(dataset) == 6  # one written epoch per pass, not all 3 (issue 18)
    assert isinstance(dataset[0], Batch) and torch.equal(dataset[-1].actions, dataset[5].actions)
    for index in (6, -7):
        with pytest.raises(IndexError, match="out of range for 6 items"):
            dataset[index]
    per_epoch = []
    for epoch in range(4):
        dataset.set_epoch(epoch)
        per_epoch.append([r for i in range(len(dataset)) for r in rows_of(dataset[i])])
        assert sorted(per_epoch[-1]) == list(range(T * N))
    assert per_epoch[3] == per_epoch[0] != per_epoch[1]  # epoch e reads the written epoch e % 3
    assert len(ShardDataset(folders["feedforward"], epochs="all")) == 18
    assert len(ShardDataset(folders["feedforward"], epochs=[2, 0])) == 12
    distillation = ShardDataset(folders["distillation"])
    assert len(distillation) == T and distillation[T - 1].dones.shape == (N, 1)  # an item is a time step
    assert [int(b.observations["policy"][0, 0]) // 1000 for b in distillation] == list(range(T))


def test_dataloader_shuffle_and_batch_size_now_work(folders) -> None:
    dataset = ShardDataset(folders["feedforward"])
    rows = [r for b in DataLoader(dataset, batch_size=None, shuffle=True) for r in rows_of(b)]
    assert sorted(rows) == list(range(T * N))
    merged = list(DataLoader(dataset, batch_size=4))  # Batches concatenate: 4 mini-batches, then 2
    assert [b.actions.shape[0] for b in merged] == [40, 20]
    assert sorted(r for b in merged for r in rows_of(b)) == list(range(T * N))


def test_load_time_shuffle_fresh_order_each_epoch(folders) -> None:
    dataset = ShardDataset(folders["feedforward"], epochs=[0], shuffle=True, seed=5)
    plain = ShardDataset(folders["feedforward"], epochs=[0])
    orders = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        batches = list(dataset)
        orders.append([r for b in batches for r in rows_of(b)])
        assert sorted(orders[-1]) == list(range(T * N))  # every row once per epoch
        assert [b.actions.shape[0] for b in batches] == [10] * 6
        for batch in batches:  # each row keeps its own fields
            assert torch.equal(batch.observations["critic"][:, 0] - 0.5, batch.observations["policy"][:, 0])
    assert len({tuple(o) for o in orders}) == 3 and orders[0] != [r for b in plain for r in rows_of(b)]
    shard_sets = [sorted(rows_of(b)) for b in dataset]
    assert sorted(shard_sets) == sorted(sorted(rows_of(b)) for b in plain)  # the same shards, reordered
    again = ShardDataset(folders["feedforward"], epochs=[0], shuffle=True, seed=5)
    again.set_epoch(2)
    assert [r for b in again for r in rows_of(b)] == orders[2]  # reproducible from (seed, epoch)
    assert torch.equal(epoch_order(10, 5, 2), epoch_order(10, 5, 2))
    assert not torch.equal(epoch_order(10, 5, 2), epoch_order(10, 5, 2, stream=1))


def test_recurrent_and_distillation_shards_keep_time_order(folders) -> None:
    for name in ("recurrent", "distillation"):
        dataset = ShardDataset(folders[name], shuffle=True, seed=3)
        dataset.set_epoch(1)
        for batch in dataset:
            steps = batch.observations["policy"][..., 0] // 1000
            if name == "recurrent":  # [T, trajectories]: steps ascend within each trajectory
                assert bool((steps.diff(dim=0)[batch.masks[1:]] == 1).all())
            else:
                assert bool((steps == steps[0]).all())
    dataset = ShardDataset(folders["distillation"], shuffle=True, seed=4)
    steps = [int(b.observations["policy"][0, 0]) // 1000 for b in dataset]
    assert sorted(steps) == list(range(T)) and steps != list(range(T))  # shards shuffled, steps within in order


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_split_shards_without_overlap(folders, world_size: int) -> None:
    for epoch in range(3):
        seen: list[int] = []
        for rank in range(world_size):
            dataset = ShardDataset(folders["feedforward"], shuffle=True, seed=9, rank=rank, world_size=world_size)
            dataset.set_epoch(epoch)
            seen += [r for b in DataLoader(dataset, batch_size=None, num_workers=0) for r in rows_of(b)]
        assert sorted(seen) == list(range(T * N))  # every row exactly once per epoch across ranks


def test_bad_arguments_and_a_manifest_that_disagrees(folders, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"expected 0 <= rank < world_size.*rank=2, world_size=2"):
        ShardDataset(folders["feedforward"], rank=2, world_size=2)
    with pytest.raises(ValueError, match="epochs must be None, 'all'"):
        ShardDataset(folders["feedforward"], epochs="first")
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(folders["feedforward"], folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["shards"][0]["rows"] += 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RolloutError, match=r"field .rows.: expected 11 rows .the manifest.s., found 10 rows"):
        ShardDataset(folder)[0]


def test_prefetch_reads_the_next_shard_in_the_background(folders, monkeypatch) -> None:
    dataset = ShardDataset(folders["feedforward"])
    threads: list[tuple[str, str]] = []
    load = ShardDataset.load

    def spy(self, entry):
        threads.append((threading.current_thread().name, entry["file"]))
        return load(self, entry)

    monkeypatch.setattr(ShardDataset, "load", spy)
    batches = list(dataset)
    assert [file for _, file in threads] == [e["file"] for e in dataset.entries]  # each shard read once
    assert threads[0][0] == "MainThread" and all(name.startswith("rolloutcli-prefetch") for name, _ in threads[1:])
    unfetched = list(ShardDataset(folders["feedforward"], prefetch=False))
    assert all(torch.equal(a.actions, b.actions) for a, b in zip(batches, unfetched, strict=True))
    iterator = iter(dataset)
    next(iterator)  # a read is in flight; starting workers (a fork) waits for it
    workers = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert all(torch.equal(a.actions, b.actions) for a, b in zip(batches, workers, strict=True))
