"""``batch --offline`` (feed-forward rows without advantages) and history windows of an offline file."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.shards import ShardDataset

T, N = 24, 6


@pytest.fixture
def offline(tmp_path: Path, cli) -> tuple[Path, dict[str, np.ndarray]]:
    """An offline rollout (no values, no last_values) after `rolloutcli returns`."""
    arrays = rollout_arrays(T=T, N=N, end_rate=0.2, seed=11)
    arrays = {k: v for k, v in arrays.items() if k not in ("values", "last_values")}
    write_rollout(tmp_path / "raw.h5", arrays)
    assert cli("returns", tmp_path / "raw.h5", "-o", tmp_path / "off.h5", "-q")[0] == 0
    with h5py.File(tmp_path / "off.h5") as f:
        arrays["returns_to_go"] = f["returns_to_go"][()]
        arrays["returns_truncated"] = f["returns_truncated"][()]
    return tmp_path / "off.h5", arrays


def _shards(folder: Path) -> tuple[dict, list[dict[str, np.ndarray]]]:
    manifest = json.loads((folder / "manifest.json").read_text())
    out = []
    for entry in manifest["shards"]:
        with h5py.File(folder / entry["file"]) as f:
            out.append({name: f[name][()] for name in _names(f)})
    return manifest, out


def _names(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def test_forgetting_gae_says_so_exactly(offline, tmp_path, cli):
    src, _ = offline
    code, _, err = cli("batch", src, "-o", tmp_path / "s", "-m", "4")
    assert code == 1 and not (tmp_path / "s").exists()
    fix = "Run `rolloutcli gae` first. For offline data without a critic, pass --offline (exports what the file has)."
    assert err.strip() == (
        f"error: {src}: 2 problems: field 'advantages': expected a dataset [T, N], found nothing. "
        f"{fix.removesuffix('.')}; field 'returns': expected a dataset [T, N], found nothing. {fix}"
    )


@pytest.mark.parametrize("mode", ["--recurrent", "--distillation"])
def test_offline_refuses_other_modes(offline, tmp_path, cli, mode):
    src, _ = offline
    code, _, err = cli("batch", src, "-o", tmp_path / "s", "-m", "2", "--offline", mode)
    assert code == 2
    assert err.strip() == f"error: --offline: expected feed-forward or --history batches, found {mode}."


def test_offline_feed_forward_rows_are_the_source_rows(offline, tmp_path, cli):
    src, arrays = offline
    code, out, err = cli("batch", src, "-o", tmp_path / "s", "-m", "4", "--offline", "--epochs", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["offline"] is True
    manifest, shards = _shards(tmp_path / "s")
    assert manifest["options"]["offline"] is True
    assert {"returns_to_go", "returns_truncated", "actions", "rewards", "dones"} <= set(manifest["fields"])
    assert "advantages" not in manifest["fields"] and "values" not in manifest["fields"]
    seen = []
    for shard in shards[:4]:
        t, n = np.divmod(shard["index"], N)
        seen += shard["index"].tolist()
        for name in ("returns_to_go", "returns_truncated", "actions", "observations/policy"):
            assert np.array_equal(shard[name], arrays[name][t, n]), name
        assert np.array_equal(shard["rewards"], arrays["rewards"].reshape(T, N)[t, n])
    assert sorted(seen) == list(range(T * N))  # every row once per epoch
    batch = next(iter(ShardDataset(tmp_path / "s", as_dict=True)))
    assert "returns_to_go" in batch and "advantages" not in batch


def test_offline_shards_are_the_same_for_any_budget(offline, tmp_path, cli):
    src, _ = offline
    for budget in ("1G", "8K"):
        assert cli("batch", src, "-o", tmp_path / budget, "-m", "3", "--offline", "--max-memory", budget, "-q")[0] == 0
    big, small = _shards(tmp_path / "1G")[0], _shards(tmp_path / "8K")[0]
    assert [e["sha256"] for e in big["shards"]] == [e["sha256"] for e in small["shards"]]


def test_history_windows_of_offline_data_carry_actions_and_rewards(offline, tmp_path, cli):
    src, arrays = offline
    K = 3
    assert cli("batch", src, "-o", tmp_path / "h", "-m", "2", "--history", K, "--offline", "-q")[0] == 0
    _, shards = _shards(tmp_path / "h")
    rewards = arrays["rewards"].reshape(T, N)
    for shard in shards:
        env, end = shard["window_env"], shard["window_end"]
        steps = end[:, None] - K + 1 + np.arange(K)[None, :]
        assert np.array_equal(shard["window_actions"], arrays["actions"][steps, env[:, None]])
        assert np.array_equal(shard["window_rewards"], rewards[steps, env[:, None]])
    item = next(iter(ShardDataset(tmp_path / "h")))
    assert item["window_actions"].shape[1] == K and item["window_rewards"].shape[1] == K
