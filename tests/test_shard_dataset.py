"""``ShardDataset``: manifest checks, checksums, RSL-RL batch shapes, DataLoader workers, and shard files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_factory import write_rollout
from tensordict import TensorDict
from test_batching import full_arrays
from torch.utils.data import DataLoader

from rolloutcli import RolloutError, ShardDataset
from rolloutcli.hdf5.shards import read_shard, shard_bytes
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions

T, N = 12, 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    src = write_rollout(root / "src.h5", full_arrays(T, N, hidden="lstm"))
    out = {}
    for mode, options in {
        "feedforward": BatchOptions(4, epochs=3, seed=1),
        "recurrent": BatchOptions(2, epochs=2, mode="recurrent", shuffle_envs=True),
        "distillation": BatchOptions(3, mode="distillation"),
    }.items():
        out[mode] = root / mode
        run_batch(src, out[mode], options, RunOptions())
    return out


def test_dataloader_workers_yield_every_shard_exactly_once(folders) -> None:
    dataset = ShardDataset(folders["feedforward"], as_dict=True)
    assert len(dataset) == 12
    seen = [(item["epoch"], item["mini_batch"]) for item in DataLoader(dataset, batch_size=None, num_workers=2)]
    assert sorted(seen) == [(e, b) for e in range(3) for b in range(4)]
    batches = list(DataLoader(ShardDataset(folders["feedforward"]), batch_size=None, num_workers=2))
    rows = sorted(int(r) for b in batches for r in b.observations["policy"][:, 0])  # Batch objects cross processes
    assert len(rows) == 3 * T * N


def test_batch_shapes_follow_rsl_rl(folders) -> None:
    ff = next(iter(ShardDataset(folders["feedforward"])))
    B = ff.actions.shape[0]
    assert ff.values.shape == ff.advantages.shape == ff.returns.shape == ff.old_actions_log_prob.shape == (B, 1)
    assert [p.shape for p in ff.old_distribution_params] == [(B, 2), (B, 2)]
    assert ff.hidden_states == (None, None) and ff.masks is None
    rec = next(iter(ShardDataset(folders["recurrent"], tensordict=True)))
    M = rec.masks.shape[1]
    assert isinstance(rec.observations, TensorDict) and tuple(rec.observations.batch_size) == (T, M)
    G = rec.actions.shape[1]
    assert rec.values.shape == (T, G, 1) and rec.masks.dtype == torch.bool
    h, c = rec.hidden_states[0]  # LSTM: (h, c), each [layers, M, H]
    assert h.shape == c.shape == (2, M, 3)
    distillation = list(ShardDataset(folders["distillation"]))
    assert len(distillation) == len(ShardDataset(folders["distillation"])) == T
    assert distillation[0].dones.shape == (N, 1) and distillation[0].privileged_actions.shape == (N, 2)


def test_epoch_filter_and_dict_contents(folders) -> None:
    items = list(ShardDataset(folders["feedforward"], as_dict=True, epochs=[1]))
    assert [i["mini_batch"] for i in items] == [0, 1, 2, 3] and {i["epoch"] for i in items} == {1}
    assert {"index", "observations/policy", "advantages", "file"} <= set(items[0])
    assert sorted(torch.cat([i["index"] for i in items]).tolist()) == list(range(T * N))


def test_checksum_verification_detects_a_modified_shard(folders, tmp_path) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(folders["feedforward"], folder)
    assert len(list(ShardDataset(folder, verify_checksums=True))) == 12
    entry = json.loads((folder / "manifest.json").read_text())["shards"][5]
    path = folder / entry["file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one bit pattern in the last dataset's data: still a readable HDF5 file
    path.write_bytes(bytes(data))
    assert len(list(ShardDataset(folder))) == 12  # unverified: reads the damaged data silently
    with pytest.raises(RolloutError, match="sha256"):
        list(ShardDataset(folder, verify_checksums=True))


def test_manifest_problems_are_reported(folders, tmp_path) -> None:
    with pytest.raises(RolloutError, match="no such shard folder"):
        ShardDataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutError, match="no manifest"):
        ShardDataset(tmp_path / "empty")
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(folders["distillation"], folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["shards"][0]["file"] = "../src.h5"
    manifest["shards"][1]["sha256"] = "xyz"
    (folder / manifest["shards"][2]["file"]).unlink()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RolloutError) as info:
        ShardDataset(folder)
    assert len(info.value.problems) == 3


def test_layout_writer_equals_libhdf5_bytes(tmp_path) -> None:
    tensors = {
        "observations/policy": torch.randn(37, 48),
        "actions": torch.randn(37, 12).double(),
        "dones": torch.randint(0, 2, (37,), dtype=torch.uint8),
        "masks": torch.rand(12, 4) > 0.5,
        "index": torch.arange(37),
        "distribution/mean": torch.randn(37, 3),
    }
    attrs = {"rolloutcli_format": "shard", "format_version": 1, "mode": "feedforward"}
    groups = {"distribution": {"order": ["mean"]}}
    ours = shard_bytes(tensors, attrs, groups)
    assert ours == shard_bytes(tensors, attrs, groups, via_layout=False)  # byte for byte what libhdf5 writes
    path = tmp_path / "shard.h5"
    path.write_bytes(ours)
    arrays, read_attrs = read_shard(path)
    for name, value in tensors.items():
        assert np.array_equal(arrays[name], value.numpy()), name
    assert list(read_attrs["distribution"]["order"]) == ["mean"]


def test_default_shards_equal_storage_generator_with_the_same_seed(tmp_path) -> None:
    from test_batching import assert_batches

    from rolloutcli import RolloutStorage

    src = write_rollout(tmp_path / "src.h5", full_arrays(T, N))
    run_batch(src, tmp_path / "s", BatchOptions(7, epochs=2, seed=3), RunOptions())
    storage = RolloutStorage.from_hdf5(src)
    expected = storage.mini_batch_generator(7, 2, parity=False, generator=torch.Generator().manual_seed(3))
    assert_batches(list(ShardDataset(tmp_path / "s")), list(expected))
