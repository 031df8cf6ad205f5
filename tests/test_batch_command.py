"""``rolloutcli batch``: shards against RSL-RL's generators, invariants, budgets, manifest, errors, atomicity."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import xxhash
from rollout_factory import identifiable, write_rollout
from test_batching import assert_batches, full_arrays, rsl_storage

from rolloutcli import ShardDataset
from rolloutcli.hdf5.shards import read_shard
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions

T, N = 12, 5
GAE_ATTRS = {"gae_gamma": 0.99, "gae_lambda": 0.95, "advantages_normalized": True, "timeouts_bootstrapped": False}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    folder = tmp_path_factory.mktemp("sources")
    out = {}
    for hidden in ("gru", "lstm"):
        arrays = full_arrays(T, N, hidden=hidden)
        out[hidden] = (write_rollout(folder / f"{hidden}.h5", arrays, GAE_ATTRS), arrays)
    return out


def export(src: Path, dst: Path, *, memory: int = 1 << 30, **options: object) -> dict:
    num_mini_batches = int(options.pop("num_mini_batches", 3))  # type: ignore[call-overload]
    return run_batch(src, dst, BatchOptions(num_mini_batches, **options), RunOptions(max_memory=memory))


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".h5"}


def entries(folder: Path) -> list[dict]:
    return json.loads((folder / "manifest.json").read_text())["shards"]


# ------------------------------------------------------------------------------------------------------------
# parity with RSL-RL's generators (shards read back with ShardDataset)
# ------------------------------------------------------------------------------------------------------------


def test_feedforward_parity_with_rsl_rl(sources, tmp_path) -> None:
    src, arrays = sources["gru"]
    summary = export(src, tmp_path / "ff", num_mini_batches=7, epochs=3, seed=11, rsl_parity=True)
    torch.manual_seed(11)  # RSL-RL draws from the global RNG; ours from torch.Generator().manual_seed(11)
    expected = list(rsl_storage(arrays).mini_batch_generator(7, 3))
    assert_batches(list(ShardDataset(tmp_path / "ff", epochs="all")), expected)
    manifest = json.loads((tmp_path / "ff" / "manifest.json").read_text())
    assert manifest["dropped_rows"] == summary["dropped_rows"] == 60 % 7
    assert summary["files"] == 7 and len(manifest["shards"]) == 21  # one order, written once, listed per epoch


@pytest.mark.parametrize("hidden", ["gru", "lstm"])
def test_recurrent_parity_with_rsl_rl(sources, tmp_path, hidden: str) -> None:
    src, arrays = sources[hidden]
    summary = export(src, tmp_path / "rec", num_mini_batches=2, epochs=2, mode="recurrent", rsl_parity=True)
    expected = list(rsl_storage(arrays).recurrent_mini_batch_generator(2, 2))
    assert_batches(list(ShardDataset(tmp_path / "rec", epochs="all")), expected)
    assert summary["dropped_envs"] == [4] and summary["dropped_rows"] == T


def test_distillation_matches_rsl_rl_generator(sources, tmp_path) -> None:
    src, arrays = sources["gru"]
    export(src, tmp_path / "dist", num_mini_batches=5, mode="distillation")
    expected = list(rsl_storage(arrays, "distillation").generator())
    assert_batches(list(ShardDataset(tmp_path / "dist")), expected)
    steps = [read_shard(tmp_path / "dist" / e["file"])[0]["steps"].tolist() for e in entries(tmp_path / "dist")]
    assert [t for s in steps for t in s] == list(range(T)) and max(map(len, steps)) - min(map(len, steps)) <= 1


# ------------------------------------------------------------------------------------------------------------
# invariants with identifiable data
# ------------------------------------------------------------------------------------------------------------


def test_feedforward_default_every_row_once_per_epoch_fresh_order_aligned(sources, tmp_path) -> None:
    src, arrays = sources["gru"]
    export(src, tmp_path / "ff", num_mini_batches=7, epochs=3, seed=2)
    orders = []
    for epoch in range(3):
        shards = [read_shard(tmp_path / "ff" / e["file"])[0] for e in entries(tmp_path / "ff") if e["epoch"] == epoch]
        sizes = [len(s["index"]) for s in shards]
        assert max(sizes) - min(sizes) <= 1
        index = np.concatenate([s["index"] for s in shards])
        assert sorted(index.tolist()) == list(range(T * N))  # every row exactly once, nothing dropped
        orders.append(index)
        for shard in shards:
            t, n = np.divmod(shard["index"], N)
            for name in ("observations/policy", "observations/critic", "actions", "rewards", "dones", "values"):
                assert np.array_equal(shard[name], arrays[name][t, n]), name  # every field aligned with index
            assert np.array_equal(shard["distribution/std"], arrays["distribution/std"][t, n])
            assert np.array_equal(shard["observations/policy"][:, 0], identifiable(T, N, 1)[t, n, 0])
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])


@pytest.mark.parametrize("shuffle", [False, True])
def test_recurrent_trajectories_masks_and_hidden_states(sources, tmp_path, shuffle: bool) -> None:
    src, arrays = sources["lstm"]
    export(src, tmp_path / "rec", num_mini_batches=2, epochs=2, mode="recurrent", shuffle_envs=shuffle, seed=4)
    groups = []
    for entry in entries(tmp_path / "rec"):
        shard = read_shard(tmp_path / "rec" / entry["file"])[0]
        envs = shard["env_ids"]
        groups.append((entry["epoch"], tuple(envs.tolist())))
        masks, traj_env, traj_start = shard["masks"], shard["trajectory_env"], shard["trajectory_start"]
        assert masks.shape == (T, len(traj_env))
        for env in envs:  # masks sum to T per env
            assert masks[:, traj_env == env].sum() == T
        obs = shard["observations/policy"]
        for m, (env, start) in enumerate(zip(traj_env, traj_start, strict=True)):
            length = int(masks[:, m].sum())
            steps = np.arange(start, start + length)
            # no trajectory crosses an env or a done: its valid rows are consecutive steps of one env
            assert np.array_equal(obs[:length, m], arrays["observations/policy"][steps, env])
            assert not arrays["dones"][steps[:-1], env].any()
            assert (obs[length:, m] == 0).all()
            for net in ("actor", "critic"):
                for i in (0, 1):  # hidden state = the one recorded at the trajectory's first step
                    state = shard[f"hidden_states/{net}/{i}"][:, m]
                    assert np.array_equal(state, arrays[f"hidden_states/{net}/{i}"][start, :, env])
        assert np.array_equal(shard["actions"], arrays["actions"][:, envs])
        assert np.array_equal(shard["advantages"], arrays["advantages"][:, envs])
    for epoch in range(2):  # no env dropped by default
        assert sorted(env for e, g in groups if e == epoch for env in g) == list(range(N))
    if shuffle:
        assert [g for _, g in groups[:2]] != [g for _, g in groups[2:]]


# ------------------------------------------------------------------------------------------------------------
# memory budget, manifest, CLI
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"epochs": 2},
        {"epochs": 2, "rsl_parity": True, "num_mini_batches": 7},
        {"mode": "recurrent", "shuffle_envs": True, "epochs": 2},
        {"mode": "recurrent", "rsl_parity": True, "num_mini_batches": 2},
        {"mode": "distillation"},
    ],
)
def test_tiny_memory_budget_gives_identical_shards(sources, tmp_path, options: dict) -> None:
    src, _ = sources["lstm"]
    big = export(src, tmp_path / "big", **dict(options))
    # 5K: the smallest budget its largest shard fits in (a shard is built whole in memory; issue 40.7)
    small = export(src, tmp_path / "small", memory=5 << 10, **dict(options))
    assert not big["streamed"] and small["streamed"] and small["blocks"] > 1
    assert shard_files(tmp_path / "big") == shard_files(tmp_path / "small")
    assert entries(tmp_path / "big") == entries(tmp_path / "small")
    assert not [p for p in (tmp_path / "small").iterdir() if p.name.startswith(".")]  # spill files removed


def test_env_chunked_source_streams_by_env_with_identical_shards(sources, tmp_path) -> None:
    _, arrays = sources["gru"]
    src = tmp_path / "chunked.h5"
    with h5py.File(src, "w") as handle:  # chunked by env, compressed: streamed in env blocks
        for name, value in arrays.items():
            chunks = (value.shape[0], 1, *value.shape[2:]) if value.ndim >= 2 and "hidden" not in name else None
            handle.create_dataset(name, data=value, chunks=chunks, compression="gzip" if chunks else None)
    reference = export(sources["gru"][0], tmp_path / "ref", num_mini_batches=4, epochs=2)
    chunked = export(src, tmp_path / "env", memory=2 << 10, num_mini_batches=4, epochs=2)
    assert chunked["streamed"] and not reference["streamed"]
    assert shard_files(tmp_path / "ref") == shard_files(tmp_path / "env")


def test_manifest_content(sources, tmp_path, cli) -> None:
    src, _ = sources["gru"]
    code, out, err = cli("batch", src, "-o", tmp_path / "s", "--num-mini-batches", 4, "--epochs", 2, "--seed", 9)
    assert code == 0, err
    assert "mini-batches" in out
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["format"] == "rolloutcli.shards" and manifest["mode"] == "feedforward"
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
        "rsl_parity": False,
        "shuffle_envs": False,
        "compression": None,
        "offline": False,
    }
    assert manifest["gae"] == {
        "gamma": 0.99,
        "lambda": 0.95,
        "advantages_normalized": True,
        "timeouts_bootstrapped": False,
    }
    assert manifest["dropped_rows"] == 0 and manifest["rows_per_epoch"] == T * N
    shards = manifest["shards"]
    assert [(e["epoch"], e["mini_batch"]) for e in shards] == [(e, b) for e in range(2) for b in range(4)]
    for entry in shards:
        assert sorted(entry) == ["epoch", "file", "mini_batch", "rows", "sha256"]
        data = (tmp_path / "s" / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert entry["rows"] == len(read_shard(tmp_path / "s" / entry["file"])[0]["index"])
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted({e["file"] for e in shards} | {"manifest.json"})
    code, out, _ = cli("batch", src, "-o", tmp_path / "s", "-m", 4, "--json")
    assert code == 2  # exists: no --overwrite
    code, out, _ = cli("batch", src, "-o", tmp_path / "s", "-m", 4, "--json", "--overwrite", "--compression", "lzf")
    assert code == 0 and json.loads(out)["compression"] == "lzf"
    with h5py.File(tmp_path / "s" / entries(tmp_path / "s")[0]["file"]) as handle:
        assert handle["observations/policy"].compression == "lzf"


def test_errors(sources, tmp_path, cli) -> None:
    src, arrays = sources["gru"]
    no_gae = write_rollout(tmp_path / "raw.h5", {k: v for k, v in arrays.items() if k not in ("advantages", "returns")})
    code, _, err = cli("batch", no_gae, "-o", tmp_path / "o1", "-m", 2)
    assert code == 1 and "advantages" in err and "rolloutcli gae" in err
    code, _, err = cli("batch", no_gae, "-o", tmp_path / "o1", "-m", 2, "--recurrent")
    assert code == 1 and "returns" in err
    no_teacher = write_rollout(tmp_path / "nt.h5", {k: v for k, v in arrays.items() if k != "privileged_actions"})
    code, _, err = cli("batch", no_teacher, "-o", tmp_path / "o2", "-m", 2, "--distillation")
    assert code == 1 and "privileged_actions" in err
    for args, text in [
        (("-m", N + 1, "--recurrent"), "at most 5"),
        (("-m", T + 1, "--distillation"), "at most 12"),
        (("-m", T * N + 1), "at most 60"),
        (("-m", 0), "num-mini-batches"),
        (("-m", 2, "--shuffle-envs"), "--recurrent"),
        (("-m", 2, "--recurrent", "--shuffle-envs", "--rsl-parity"), "--shuffle-envs"),
        (("-m", 2, "--recurrent", "--distillation"), "both"),
        (("-m", 2, "--compression", "zstd"), "lzf or gzip"),
    ]:
        code, _, err = cli("batch", src, "-o", tmp_path / "o3", *args)
        assert code == 2 and text in err, (args, err)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


def test_failed_run_leaves_no_published_folder(sources, tmp_path, monkeypatch) -> None:
    src, _ = sources["gru"]
    from rolloutcli.hdf5 import shards

    calls = []
    original = shards.ShardWriter.submit

    def submit(self, name, tensors) -> None:
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(self, name, tensors)

    monkeypatch.setattr(shards.ShardWriter, "submit", submit)
    for memory in (1 << 30, 8 << 10):  # in memory, and streamed with spill files
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            export(src, tmp_path / "out", memory=memory, num_mini_batches=6)
        assert os.listdir(tmp_path) == [], "no output and no temporary folder left"


def test_disk_full_exits_cleanly_without_a_folder(sources, tmp_path) -> None:
    src, _ = sources["lstm"]
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (9000, 9000))\n"
        "from rolloutcli.cli.app import main\n"
        f"sys.exit(main(['batch', {str(src)!r}, '-o', {str(tmp_path / 'out')!r}, '-m', '2', '-q']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr  # an I/O fault, not a crash at exit
    assert "cannot write" in result.stderr
    assert os.listdir(tmp_path) == []
