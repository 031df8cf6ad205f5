"""``RolloutDataset`` / ``TrajectoryDataset``: row-level datasets over rollout files, fed by ``DataLoader``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rollout_factory import write_rollout
from tensordict import TensorDict
from test_batching import full_arrays
from torch.utils.data import DataLoader

from rolloutcli import RolloutDataset, RolloutError, TrajectoryDataset
from rolloutcli.core.trajectories import trajectory_spans
from rolloutcli.minibatch import Batch

T, N = 40, 16


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("rows")
    arrays = [full_arrays(T, N, hidden="lstm", seed=s) for s in (0, 1)]
    arrays[1]["observations/policy"] += 100_000  # rows of the second file are told apart
    paths = [write_rollout(root / f"run{i}.h5", a) for i, a in enumerate(arrays)]
    return root, paths, arrays


def row_ids(batch: Batch) -> list[int]:
    values = batch.observations["policy"][:, 0].round().long()
    return (values // 100_000 * T * N + values % 100_000 // 1000 * N + values % 1000).tolist()


def test_rows_items_and_errors(files) -> None:
    _, paths, arrays = files
    dataset = RolloutDataset(paths[0])
    assert len(dataset) == T * N
    item = dataset[3 * N + 5]  # row t * N + n
    assert isinstance(item, Batch) and item.actions.shape == (1, 2) and item.advantages.shape == (1, 1)
    assert torch.equal(item.actions[0], torch.from_numpy(arrays[0]["actions"][3, 5]))
    assert torch.equal(item.old_distribution_params[1][0], torch.from_numpy(arrays[0]["distribution/std"][3, 5]))
    assert isinstance(item.observations, TensorDict) and item.hidden_states == (None, None)
    with pytest.raises(IndexError, match=f"out of range for {T * N} items"):
        dataset[T * N]
    assert torch.equal(dataset[-1].actions, dataset[T * N - 1].actions)
    narrow = RolloutDataset(paths[0], fields=["observations/policy", "advantages"])
    assert narrow[0].actions is None and set(narrow[0].observations.keys()) == {"policy"}
    with pytest.raises(RolloutError, match="field 'rewards_typo'"):
        RolloutDataset(paths[0], fields=["rewards_typo"])


def test_dataloader_sees_every_row_once_per_epoch(files) -> None:
    root, paths, arrays = files
    dataset = RolloutDataset(root)  # a folder of files: 2 * T * N rows
    assert len(dataset) == 2 * T * N and dataset.paths == paths
    loader = DataLoader(dataset, batch_size=256, shuffle=True, num_workers=2)
    for _ in range(2):
        seen = []
        for batch in loader:
            assert isinstance(batch, Batch) and batch.values.shape == (batch.actions.shape[0], 1)
            ids = row_ids(batch)
            file, rest = np.divmod(np.array(ids), T * N)
            t, n = np.divmod(rest, N)
            for name in ("actions", "advantages"):  # each row's fields belong together
                expected = np.stack([arrays[f][name][a, b] for f, a, b in zip(file, t, n, strict=True)])
                got = getattr(batch, name).numpy()
                assert np.array_equal(got.reshape(expected.shape), expected)
            seen += ids
        assert sorted(seen) == list(range(2 * T * N))  # every row exactly once per epoch


def test_trajectories_padded_per_batch(files) -> None:
    _, paths, arrays = files
    dataset = TrajectoryDataset(paths[0])
    spans = trajectory_spans(torch.from_numpy(arrays[0]["dones"]))
    assert len(dataset) == spans.env.numel()
    k = int(torch.argmax(spans.length))
    env, start, length = int(spans.env[k]), int(spans.start[k]), int(spans.length[k])
    item = dataset[k]
    assert item.masks.shape == (length, 1) and item.actions.shape == (length, 1, 2)
    assert torch.equal(item.actions[:, 0], torch.from_numpy(arrays[0]["actions"][start : start + length, env]))
    h, c = item.hidden_states[0]  # LSTM: (h, c) at the first step, [layers, 1, H]
    assert torch.equal(h[:, 0], torch.from_numpy(arrays[0]["hidden_states/actor/0"][start, :, env]))
    assert c.shape == (2, 1, 3)
    lengths = []
    for batch in DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2):
        L, M = batch.masks.shape
        assert batch.observations.batch_size == (L, M) and batch.hidden_states[1][0].shape == (2, M, 3)
        assert L == int(batch.masks.sum(0).max())  # padded to the longest of the batch
        assert not batch.actions[~batch.masks].any()
        lengths += batch.masks.sum(0).tolist()
    assert sorted(lengths) == sorted(spans.length.tolist())


def test_fields_larger_than_the_cache_are_read_by_steps(files) -> None:
    _, paths, _ = files
    cached, direct = RolloutDataset(paths[0]), RolloutDataset(paths[0], cache_bytes=0)
    rows = [5, 3 * N + 1, 5, T * N - 1, 0]  # any order, repeats allowed
    for a, b in zip(cached.__getitems__(rows), direct.__getitems__(rows), strict=True):
        assert torch.equal(a.actions, b.actions) and torch.equal(a.observations["critic"], b.observations["critic"])
        assert torch.equal(a.old_distribution_params[0], b.old_distribution_params[0])
    k = len(TrajectoryDataset(paths[0])) - 1
    a, b = TrajectoryDataset(paths[0])[k], TrajectoryDataset(paths[0], cache_bytes=0)[k]
    assert torch.equal(a.values, b.values) and torch.equal(a.hidden_states[1][1], b.hidden_states[1][1])


def test_rows_of_compressed_chunks_are_read_a_chunk_at_a_time(tmp_path, files) -> None:
    """Issue 40.13: rows of a chunked, compressed field not cached: each chunk is read (decoded) once per read."""
    import h5py

    _, paths, arrays = files
    path = write_rollout(tmp_path / "chunked.h5", arrays[0], compression="gzip", chunks=True)
    with h5py.File(path, "r") as handle:
        assert handle["observations/policy"].chunks[0] > 1
    cached, direct = RolloutDataset(paths[0]), RolloutDataset(path, cache_bytes=0)
    rows = [5, N + 3, 2 * N + 7, 5, T * N - 1, 0, 17 * N + 15]
    reads = []
    original = direct.reader._read
    direct.reader._read = lambda *args: reads.append(args[2]) or original(*args)  # type: ignore[method-assign]
    for a, b in zip(cached.__getitems__(rows), direct.__getitems__(rows), strict=True):
        assert torch.equal(a.observations["policy"], b.observations["policy"]) and torch.equal(a.actions, b.actions)
    with h5py.File(path, "r") as handle:
        spans = [handle[name].chunks[0] for name in direct.names]
    steps = np.array(rows) // N
    assert len(reads) == sum(len(np.unique(steps // span)) for span in spans)  # one read per chunk, not per step


def test_a_field_one_row_of_which_cannot_be_bounded_is_refused(tmp_path) -> None:
    """Issue 40.13: a 2 GiB field of compressed zeros in a 9 MB file, chunks of 256 MiB (the audit's limit): one
    row would decode a 256 MiB chunk; refused at once, within a small part of that memory."""
    import resource
    import zlib

    import h5py

    arrays = full_arrays(16, 8, hidden=None)
    path = write_rollout(tmp_path / "zeros.h5", {k: v for k, v in arrays.items() if k != "observations/critic"})
    D = (2 << 30) // (4 * 16 * 8)
    with h5py.File(path, "a") as handle:
        field = handle.create_dataset(
            "observations/critic", (16, 8, D), np.float32, chunks=(2, 8, D), compression="gzip"
        )
        blob = zlib.compress(bytes(4 * 2 * 8 * D), 1)
        for t in range(0, 16, 2):
            field.id.write_direct_chunk((t, 0, 0), blob)
    assert path.stat().st_size < 16 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for kind in (RolloutDataset, TrajectoryDataset):
        with pytest.raises(RolloutError) as error:
            kind(path)
        assert str(error.value) == (
            f"{path}: field 'observations/critic': expected one row readable within read_bytes=67108864, found "
            f"compressed chunks [2, 8, {D}] of 268435456 bytes decoded whole per row. Re-save the file with smaller "
            "chunks, or pass read_bytes=268435456 (or more)."
        )
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 64 << 20
    dataset = RolloutDataset(path, read_bytes=256 << 20, fields=["actions", "observations/critic"])
    assert dataset[3].observations["critic"].shape == (1, D) and not dataset[3].observations["critic"].any()


def test_a_dataset_of_many_files_keeps_few_open(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training run's thousands of files would exhaust the file descriptors (1,024 a process is common): each
    process keeps ``OPEN_FILES`` open at most, least recently used closed first, with the same rows."""
    from rolloutcli.hdf5 import rows

    monkeypatch.setattr(rows, "OPEN_FILES", 3)
    paths = [write_rollout(tmp_path / f"r{i}.h5", full_arrays(4, 2, seed=i)) for i in range(8)]
    dataset = RolloutDataset(tmp_path, cache_bytes=0)  # no field cached whole: every read goes to its file
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    for index in order + order[::-1]:
        file, row = divmod(index, 4 * 2)
        expected = full_arrays(4, 2, seed=file)["actions"][row // 2, row % 2]
        assert torch.equal(dataset[index].actions[0], torch.from_numpy(expected))
        assert len(dataset.reader._open) <= 3
    assert [p.name for p in dataset.paths] == [p.name for p in paths]
