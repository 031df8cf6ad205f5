"""``rolloutcli batch --history K``: windows against CircularBuffer, invariants, order, budgets, manifest, errors."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from rollout_factory import rollout_arrays, write_rollout
from tensordict import TensorDict
from torch.utils.data import DataLoader

from rolloutcli import CircularBuffer, ShardDataset
from rolloutcli.core.history import gather_windows, window_ends, window_mask, window_rows
from rolloutcli.core.order import RowOrder, draw_key
from rolloutcli.hdf5.shards import read_shard
from rolloutcli.pipeline.batch import run_batch
from rolloutcli.pipeline.history import HistoryOptions
from rolloutcli.pipeline.options import RunOptions

T, N = 40, 5
GROUPS = ("critic", "policy")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    arrays = rollout_arrays(T, N, seed=3, end_rate=0.15, hidden=None)
    arrays["dones"][5, 0] = 1  # env 0: episodes of 6 steps, then 34 steps ending in a done at 39
    arrays["dones"][39, 0] = 1
    arrays["dones"][:, 1] = 0  # env 1 never ends an episode
    arrays["dones"][:, 2] = 0
    arrays["dones"][::2, 2] = 1  # env 2: episodes of 1 or 2 steps only
    arrays["time_outs"] &= arrays["dones"]
    return write_rollout(tmp_path_factory.mktemp("history") / "src.h5", arrays), arrays


def export(src: Path, dst: Path, *, memory: int = 1 << 30, **options: object) -> dict:
    options.setdefault("num_mini_batches", 3)
    return run_batch(src, dst, HistoryOptions(**options), RunOptions(max_memory=memory))  # type: ignore[arg-type]


def shards(folder: Path, epoch: int | None = None) -> list[dict[str, np.ndarray]]:
    manifest = json.loads((folder / "manifest.json").read_text())
    return [read_shard(folder / e["file"])[0] for e in manifest["shards"] if epoch is None or e["epoch"] == epoch]


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".h5"}


def expected_count(dones: np.ndarray, K: int, across: bool) -> int:
    """Windows per epoch by the documented formula: per env, max(0, L - K + 1) over its episode pieces."""
    if across:
        return dones.shape[1] * max(0, dones.shape[0] - K + 1)
    total = 0
    for env in range(dones.shape[1]):
        length = 0
        for t in range(dones.shape[0]):
            length += 1
            if dones[t, env] or t == dones.shape[0] - 1:
                total += max(0, length - K + 1)
                length = 0
    return total


def buffer_windows(arrays: dict[str, np.ndarray], K: int, across: bool) -> dict[tuple[int, int], dict]:
    """The reference: a CircularBuffer(K, N) per field filled step by step, reset at dones unless ``across``;
    after each step, the window of every env whose K entries were appended since its last reset (no fill)."""
    names = {f"observations/{g}": arrays[f"observations/{g}"] for g in GROUPS}
    names |= {"window_actions": arrays["actions"], "window_rewards": arrays["rewards"], "window_dones": arrays["dones"]}
    buffers = {name: CircularBuffer(K, N, "cpu") for name in names}
    windows: dict[tuple[int, int], dict] = {}
    for t in range(T):
        for name, buffer in buffers.items():
            buffer.append(torch.from_numpy(np.ascontiguousarray(names[name][t])))
        pushes = buffers["window_dones"].num_pushes
        for name, buffer in buffers.items():
            keyed = torch.stack([buffer[torch.full((N,), K - 1 - j)] for j in range(K)], dim=1)  # keys K-1 .. 0
            assert torch.equal(keyed, buffer.buffer)  # the same as the buffer's oldest-to-newest order
            for env in range(N):
                if pushes[env] >= K:
                    windows.setdefault((t, env), {})[name] = keyed[env].numpy()
        ended = np.flatnonzero(arrays["dones"][t]).tolist()
        if not across and ended:
            for buffer in buffers.values():
                buffer.reset(ended)
    return windows


# ------------------------------------------------------------------------------------------------------------
# core
# ------------------------------------------------------------------------------------------------------------


def test_window_mask_and_rows_by_hand() -> None:
    dones = torch.tensor([[0, 0], [1, 0], [0, 0], [0, 1], [0, 0]], dtype=torch.uint8)  # [T=5, N=2]
    mask = window_mask(dones, 2)
    # env 0: done at 1, so the window (1, 2) straddles it; env 1: done at 3, window (3, 4) straddles it
    assert mask.T.tolist() == [[False, True, False, True, True], [False, True, True, True, False]]
    assert window_mask(dones, 2, across_episodes=True).T.tolist() == [[False, True, True, True, True]] * 2
    assert window_mask(dones, 1).all() and not window_mask(dones, 6).any()
    ends = window_ends(mask)
    assert ends.tolist() == [2, 3, 5, 6, 7, 8]  # rows t * N + n, ascending
    assert window_rows(ends, 2, 2).tolist() == [[0, 2], [1, 3], [3, 5], [4, 6], [5, 7], [6, 8]]
    block = torch.arange(10.0).view(5, 2, 1)
    assert gather_windows(block, ends[:2], 2).tolist() == [[[0.0], [2.0]], [[1.0], [3.0]]]


# ------------------------------------------------------------------------------------------------------------
# windows: values, episodes, counts, order
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("across", [False, True])
def test_windows_are_consecutive_steps_of_one_env(source, tmp_path, across: bool) -> None:
    src, arrays = source
    K = 4
    export(src, tmp_path / "h", history=K, across_episodes=across, num_mini_batches=4)
    straddling = 0
    for shard in shards(tmp_path / "h"):
        env, end = shard["window_env"], shard["window_end"]
        steps = end[:, None] - K + 1 + np.arange(K)[None, :]  # [B, K], oldest first
        assert (steps >= 0).all()  # every entry recorded: no padding
        policy = shard["observations/policy"]
        assert policy.shape == (len(env), K, 4) and shard["observations/critic"].shape == (len(env), K, 5)
        # identifiable values: entry [b, k, 0] = step * 1000 + env
        assert np.array_equal(policy[..., 0], (steps * 1000 + env[:, None]).astype(np.float32))
        assert np.array_equal(policy, arrays["observations/policy"][steps, env[:, None]])
        assert np.array_equal(shard["observations/critic"], arrays["observations/critic"][steps, env[:, None]])
        assert np.array_equal(shard["window_dones"], arrays["dones"][steps, env[:, None]])
        assert np.array_equal(shard["window_actions"], arrays["actions"][steps, env[:, None]])
        assert np.array_equal(shard["window_rewards"], arrays["rewards"][steps, env[:, None]])
        inside = shard["window_dones"][:, :-1].any(axis=1)
        if not across:
            assert not inside.any()  # never a done before a window's last step
        straddling += int(inside.sum())
    assert (straddling > 0) == across  # --across-episodes: windows straddle episode ends


@pytest.mark.parametrize("K", [1, 3, 7])
@pytest.mark.parametrize("across", [False, True])
def test_window_count_equals_formula(source, tmp_path, K: int, across: bool) -> None:
    src, arrays = source
    summary = export(src, tmp_path / "h", history=K, across_episodes=across, num_mini_batches=2)
    count = expected_count(arrays["dones"], K, across)
    assert count > 0 and summary["windows_per_epoch"] == count
    assert sum(len(s["window_env"]) for s in shards(tmp_path / "h")) == count
    if K == 1:
        assert count == T * N  # every step is a window of one
    if not across and K == 3:  # env 2 (episodes of 1-2 steps) has none; env 1 (one episode) has T - K + 1
        envs = np.concatenate([s["window_env"] for s in shards(tmp_path / "h")])
        assert (envs == 2).sum() == 0 and (envs == 1).sum() == T - K + 1


def test_every_window_once_per_epoch_fresh_order_documented_permutation(source, tmp_path) -> None:
    src, arrays = source
    K, M, E, seed = 3, 4, 3, 5
    export(src, tmp_path / "h", history=K, num_mini_batches=M, epochs=E, seed=seed)
    eligible = sorted(buffer_windows(arrays, K, False))  # (t, env) pairs, ascending t * N + env
    ends = torch.tensor([t * N + n for t, n in eligible])
    generator = torch.Generator().manual_seed(seed)
    orders = []
    for epoch in range(E):
        epoch_shards = shards(tmp_path / "h", epoch)
        sizes = [len(s["window_env"]) for s in epoch_shards]
        assert len(sizes) == M and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        order = np.concatenate([s["window_end"] * N + s["window_env"] for s in epoch_shards])
        assert sorted(order.tolist()) == ends.tolist()  # each eligible window exactly once, none dropped
        assert np.array_equal(order, ends[RowOrder(draw_key(generator), len(ends)).rows()].numpy())
        orders.append(order)
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])


@pytest.mark.parametrize("across", [False, True])
def test_equivalent_to_a_circular_buffer_filled_step_by_step(source, tmp_path, across: bool) -> None:
    src, arrays = source
    K = 5
    reference = buffer_windows(arrays, K, across)
    export(src, tmp_path / "h", history=K, across_episodes=across, num_mini_batches=3)
    seen = {}
    for shard in shards(tmp_path / "h"):
        for b, (end, env) in enumerate(zip(shard["window_end"], shard["window_env"], strict=True)):
            seen[(int(end), int(env))] = {name: shard[name][b] for name in reference[(int(end), int(env))]}
    assert sorted(seen) == sorted(reference)
    for key, windows in reference.items():
        for name, window in windows.items():
            assert np.array_equal(seen[key][name], window), (key, name)


# ------------------------------------------------------------------------------------------------------------
# budgets, manifest, ShardDataset, CLI
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"history": 4, "epochs": 2, "num_mini_batches": 5},
        {"history": 6, "across_episodes": True, "epochs": 2, "groups": ("policy",)},
        {"history": 2, "num_mini_batches": 7, "compression": "lzf"},
    ],
)
def test_tiny_memory_budget_gives_identical_shards(source, tmp_path, options: dict) -> None:
    src, _ = source
    big = export(src, tmp_path / "big", **dict(options))
    # 11K: the smallest budget the largest shard fits in (a shard is built whole in memory; issue 40.7)
    small = export(src, tmp_path / "small", memory=11 << 10, **dict(options))
    assert not big["streamed"] and small["streamed"] and small["blocks"] > 1
    assert shard_files(tmp_path / "big") == shard_files(tmp_path / "small")
    assert shards(tmp_path / "big")[0].keys() == shards(tmp_path / "small")[0].keys()
    manifests = [json.loads((tmp_path / p / "manifest.json").read_text()) for p in ("big", "small")]
    assert manifests[0]["shards"] == manifests[1]["shards"]
    assert not [p for p in (tmp_path / "small").iterdir() if p.name.startswith(".")]  # spill files removed


def test_manifest_content(source, tmp_path, cli) -> None:
    src, arrays = source
    args = ("--history", 3, "-m", 4, "--epochs", 2, "--seed", 9, "--observations", "policy")
    code, out, err = cli("batch", src, "-o", tmp_path / "s", *args)
    assert code == 0, err
    assert "windows per epoch" in out and "history windows of 3 steps" in out
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    windows = expected_count(arrays["dones"], 3, False)
    assert manifest["format"] == "rolloutcli.shards" and manifest["format_version"] == 1
    assert manifest["mode"] == "history"
    assert manifest["source"] == {
        "path": os.path.abspath(src),
        "size_bytes": src.stat().st_size,
        "xxh3_128": xxhash.xxh3_128(src.read_bytes()).hexdigest(),
        "T": T,
        "N": N,
    }
    assert manifest["options"] == {
        "num_mini_batches": 4,
        "epochs": 2,
        "seed": 9,
        "history": 3,
        "across_episodes": False,
        "observations": ["policy"],
        "compression": None,
    }
    assert manifest["history"] == 3 and manifest["across_episodes"] is False and manifest["padding"] == "none"
    assert manifest["groups"] == ["policy"] and manifest["windows_per_epoch"] == manifest["rows_per_epoch"] == windows
    assert "feistel-cw bijection of W" in manifest["order"] and "reset after each done" in manifest["window"]
    assert manifest["fields"] == {
        "observations/policy": {"dtype": "float32", "row_shape": [3, 4]},
        "window_actions": {"dtype": "float32", "row_shape": [3, 2]},
        "window_rewards": {"dtype": "float32", "row_shape": [3]},
        "window_dones": {"dtype": "uint8", "row_shape": [3]},
    }
    entries = manifest["shards"]
    assert [(e["epoch"], e["mini_batch"]) for e in entries] == [(e, b) for e in range(2) for b in range(4)]
    for entry in entries:
        assert sorted(entry) == ["epoch", "file", "mini_batch", "rows", "sha256"]
        path = tmp_path / "s" / entry["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
        data, attrs = read_shard(path)
        assert sorted(data) == [
            "observations/policy",
            "window_actions",
            "window_dones",
            "window_end",
            "window_env",
            "window_rewards",
        ]
        assert entry["rows"] == len(data["window_env"]) and data["window_end"].dtype == np.int64
        assert attrs[""]["mode"] == "history" and attrs[""]["history"] == 3
    assert sum(e["rows"] for e in entries) == 2 * windows
    files = {e["file"] for e in entries} | {"manifest.json"}
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(files)
    code, out, _ = cli("batch", src, "-o", tmp_path / "s", "--history", 3, "-m", 2, "--json", "--across-episodes")
    assert code == 2  # exists: no --overwrite
    code, out, _ = cli("batch", src, "-o", tmp_path / "s", "--history", 3, "-m", 2, "--json", "--overwrite")
    summary = json.loads(out)
    assert code == 0 and summary["mode"] == "history" and summary["groups"] == list(GROUPS)


def test_shard_dataset_reads_history_shards(source, tmp_path) -> None:
    src, arrays = source
    K = 3
    export(src, tmp_path / "h", history=K, num_mini_batches=4, epochs=2)
    dataset = ShardDataset(tmp_path / "h", verify_checksums=True, epochs="all")
    assert len(dataset) == 8
    items = list(dataset)
    assert len(items) == 8
    for item in items:
        B = item["window_env"].shape[0]
        assert set(item) == {
            "observations",
            "window_actions",
            "window_rewards",
            "window_dones",
            "window_env",
            "window_end",
        }
        assert item["observations"]["policy"].shape == (B, K, 4) and item["window_dones"].shape == (B, K)
        steps = item["window_end"][:, None] - K + 1 + torch.arange(K)
        expected = torch.from_numpy(arrays["observations/critic"])[steps, item["window_env"][:, None]]
        assert torch.equal(item["observations"]["critic"], expected)
    ends = sorted(int(e) * N + int(n) for i in items[:4] for e, n in zip(i["window_end"], i["window_env"], strict=True))
    assert ends == window_ends(window_mask(torch.from_numpy(arrays["dones"]), K)).tolist()
    first = next(iter(ShardDataset(tmp_path / "h", tensordict=True, epochs=[1])))
    assert isinstance(first["observations"], TensorDict) and first["observations"].batch_size[1] == K
    raw = next(iter(ShardDataset(tmp_path / "h", as_dict=True)))
    assert {"file", "epoch", "mini_batch", "observations/policy", "window_end"} <= set(raw)
    loaded = list(DataLoader(ShardDataset(tmp_path / "h", epochs="all"), batch_size=None, num_workers=2))
    assert sorted(int(i["window_env"].sum()) for i in loaded) == sorted(int(i["window_env"].sum()) for i in items)


def test_errors(source, tmp_path, cli) -> None:
    src, arrays = source
    for args, text in [
        (("--history", T + 1), "at most 40"),
        (("--history", 0), "--history"),
        (("--history", 3, "--observations", "policy,proprio"), "'proprio'"),
        (("--history", 3, "--observations", ","), "--observations"),
        (("--history", 3, "--recurrent"), "--recurrent"),
        (("--history", 3, "--distillation"), "--distillation"),
        (("--history", 3, "--rsl-parity"), "--rsl-parity"),
        (("--history", 3, "--shuffle-envs"), "--shuffle-envs"),
        (("--across-episodes",), "--history"),
        (("--observations", "policy"), "--history"),
        (("--history", 3, "-m", 10_000), "eligible windows"),
        (("--history", 3, "--compression", "zstd"), "lzf or gzip"),
    ]:
        options = args if "-m" in args else ("-m", 2, *args)
        code, _, err = cli("batch", src, "-o", tmp_path / "o", *options)
        assert code == 2 and text in err, (args, err)
    dense = dict(arrays, dones=np.ones((T, N), dtype=np.uint8), time_outs=np.zeros((T, N), dtype=np.uint8))
    every_step = write_rollout(tmp_path / "dense.h5", dense)
    code, _, err = cli("batch", every_step, "-o", tmp_path / "o", "-m", 1, "--history", 2)
    assert code == 2 and "--across-episodes" in err
    code, _, err = cli("batch", every_step, "-o", tmp_path / "o", "-m", 1, "--history", 2, "--across-episodes")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.h5", "o"]  # failed runs left no folder
