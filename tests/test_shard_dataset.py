"""``ShardDataset``: manifest checks, checksums, RSL-RL batch shapes, DataLoader workers, and shard files."""

from __future__ import annotations

import hashlib
import json

import h5py
import numpy as np
import pytest
import torch
from rollout_factory import shard_folders, write_rollout
from tensordict import TensorDict
from test_batching import full_arrays
from torch.utils.data import DataLoader

from rolloutcli import RolloutError, ShardDataset
from rolloutcli.hdf5.shards import ShardWriter, read_shard, shard_bytes
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions

T, N = 12, 5


folders = shard_folders(
    "shards",
    full_arrays(T, N, hidden="lstm"),
    {
        "feedforward": BatchOptions(4, epochs=3, seed=1),
        "recurrent": BatchOptions(2, epochs=2, mode="recurrent", shuffle_envs=True),
        "distillation": BatchOptions(3, mode="distillation"),
    },
)


def test_dataloader_workers_yield_every_shard_exactly_once(folders) -> None:
    dataset = ShardDataset(folders["feedforward"], as_dict=True, epochs="all")
    assert len(dataset) == 12
    seen = [(item["epoch"], item["mini_batch"]) for item in DataLoader(dataset, batch_size=None, num_workers=2)]
    assert sorted(seen) == [(e, b) for e in range(3) for b in range(4)]
    batches = list(DataLoader(ShardDataset(folders["feedforward"], epochs="all"), batch_size=None, num_workers=2))
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
    assert len(list(ShardDataset(folder, verify_checksums=True, epochs="all"))) == 12
    entry = json.loads((folder / "manifest.json").read_text())["shards"][5]
    path = folder / entry["file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one bit pattern in the last dataset's data: still a readable HDF5 file
    path.write_bytes(bytes(data))
    assert len(list(ShardDataset(folder, epochs="all"))) == 12  # unverified: reads the damaged data silently
    with pytest.raises(RolloutError, match="sha256"):
        list(ShardDataset(folder, verify_checksums=True, epochs="all"))


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


# sha256 of the shard below as every earlier version wrote it (libhdf5 2.0.0): shard bytes never change.
GOLDEN_SHARDS = {
    None: "2b77dba45ac56d60776272b1b6e48721d6956c2cb7b6f3944cb38211228f707e",
    "gzip": "0f06a9e765e29db645542b555745ef01a66075a4523d09ae8809b39415c69917",
    "lzf": "1f0e5f3b9b55aec869def45ace00073dbe55f282e0d06bfaa826932e9eac4025",
}


@pytest.mark.parametrize("compression", [None, "gzip", "lzf"])
def test_shard_bytes_are_stable_and_read_back(tmp_path, compression: str | None) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "observations/policy": torch.randn(37, 48, generator=g),
        "actions": torch.randn(37, 12, generator=g).double(),
        "dones": torch.randint(0, 2, (37,), dtype=torch.uint8, generator=g),
        "masks": torch.rand(12, 4, generator=g) > 0.5,
        "index": torch.arange(37),
        "distribution/mean": torch.randn(37, 3, generator=g),
    }
    attrs = {"rolloutcli_format": "shard", "format_version": 1, "mode": "feedforward"}
    groups = {"distribution": {"order": ["mean"]}}
    image = shard_bytes(tensors, attrs, groups, compression=compression)
    if h5py.version.hdf5_version == "2.0.0":
        assert hashlib.sha256(image).hexdigest() == GOLDEN_SHARDS[compression]
    with ShardWriter(tmp_path, attrs, groups, compression=compression) as writer:  # its layout path: same bytes
        writer.submit("written.h5", tensors)
    assert (tmp_path / "written.h5").read_bytes() == image
    assert writer.results["written.h5"] == (len(image), hashlib.sha256(image).hexdigest())
    path = tmp_path / "shard.h5"
    path.write_bytes(image)
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
    assert_batches(list(ShardDataset(tmp_path / "s", epochs="all")), list(expected))


def _zeros_shard(folders, tmp_path, nbytes: int):
    """A copy of the feed-forward folder whose first shard holds ``extra/zeros``: ``nbytes`` of compressed zeros
    declared in a few KB (its chunks never written)."""
    import shutil

    folder = tmp_path / "zeros"
    shutil.copytree(folders["feedforward"], folder)
    entry = json.loads((folder / "manifest.json").read_text())["shards"][0]
    with h5py.File(folder / entry["file"], "a") as f:
        f.create_dataset("extra/zeros", (nbytes // 4096, 1024), np.float32, chunks=(64, 1024), compression="gzip")
    return folder, folder / entry["file"]


@pytest.mark.parametrize(("nbytes", "read_bytes"), [(2 << 30, None), (64 << 20, 16 << 20)])
def test_a_shard_over_read_bytes_is_refused_before_reading(folders, tmp_path, nbytes, read_bytes) -> None:
    """One shard holding 2 GiB of compressed zeros took 2.4 GB: now refused by its declared size, unread."""
    import tracemalloc

    folder, path = _zeros_shard(folders, tmp_path, nbytes)
    bound = {} if read_bytes is None else {"read_bytes": read_bytes}
    dataset = ShardDataset(folder, epochs=[0], prefetch=False, **bound)
    limit = read_bytes or 1 << 30
    tracemalloc.start()
    try:
        with pytest.raises(RolloutError) as raised:
            dataset[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    size = str(raised.value).split(", found ")[1].split(" bytes")[0]
    assert int(size) > nbytes
    assert str(raised.value) == (
        f"{path}: field 'extra/zeros': expected a shard readable within read_bytes={limit}, found {size} bytes to "
        f"read, {nbytes + 64 * 4096} of them this dataset's. Pass read_bytes={size} (or more), or write smaller "
        "shards (batch --num-mini-batches)."
    )
    if read_bytes is not None:  # within a large enough bound, the shard is read whole
        item = ShardDataset(folder, epochs=[0], prefetch=False, read_bytes=int(size), as_dict=True)[0]
        assert item["extra/zeros"].shape == (nbytes // 4096, 1024) and not item["extra/zeros"].any()
