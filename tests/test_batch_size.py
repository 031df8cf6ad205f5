"""``batch --batch-size B`` (instead of ``-m``), and RSL-RL's ``PPO.update()`` fed from ``DataLoader(ShardDataset)``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_factory import write_rollout
from rsl_rl.algorithms import PPO
from rsl_rl.models import MLPModel, RNNModel
from tensordict import TensorDict
from test_batching import full_arrays, rsl_storage
from torch.utils.data import DataLoader

from rolloutcli import ShardDataset
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions

T, N = 10, 6
GROUPS = {"actor": ["policy"], "critic": ["critic"]}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    arrays = full_arrays(T, N, hidden="gru", seed=4)
    for key in ("observations/policy", "observations/critic"):
        arrays[key] = (arrays[key] / 1000.0).astype(np.float32)  # identifiable, and of a trainable scale
    return write_rollout(tmp_path_factory.mktemp("bs") / "src.h5", arrays), arrays


def shard_sizes(folder: Path) -> list[int]:
    return [e["rows"] for e in json.loads((folder / "manifest.json").read_text())["shards"]]


def test_batch_size_is_m_from_it(source, tmp_path, cli) -> None:
    src, _ = source
    code, out, err = cli("batch", src, "-o", tmp_path / "b", "--batch-size", 16, "--json")
    assert code == 0, err
    assert json.loads(out)["num_mini_batches"] == 4 and json.loads(out)["batch_size"] == 16
    assert shard_sizes(tmp_path / "b") == [15, 15, 15, 15]  # ceil(60 / 16) = 4 mini-batches of at most 16 rows
    assert cli("batch", src, "-o", tmp_path / "m", "-m", 4)[0] == 0
    for a, b in zip(sorted((tmp_path / "b").glob("*.h5")), sorted((tmp_path / "m").glob("*.h5")), strict=True):
        assert a.read_bytes() == b.read_bytes()  # the same shards as -m 4
    assert cli("batch", src, "-o", tmp_path / "r", "--batch-size", 4, "--recurrent")[0] == 0
    assert shard_sizes(tmp_path / "r") == [3 * T, 3 * T]  # envs per group
    assert cli("batch", src, "-o", tmp_path / "d", "--batch-size", 3, "--distillation")[0] == 0
    assert shard_sizes(tmp_path / "d") == [3 * N, 3 * N, 2 * N, 2 * N]  # steps per shard


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (
            ("-m", 2, "--batch-size", 8),
            "expected exactly one of --num-mini-batches/-m M and --batch-size B, found both",
        ),
        ((), "found neither"),
        (("--batch-size", 61), "--batch-size: expected at most 60 (the file's rows (T*N)), found 61"),
        (("--batch-size", 7, "--recurrent"), "expected at most 6 (the file's envs (N)), found 7"),
        (("--batch-size", 8, "--rsl-parity"), "use -m M with --rsl-parity"),
        (("--batch-size", 0), "--batch-size"),
        (("--batch-size", 8, "--history", 2), "--history: expected none of --batch-size"),
    ],
)
def test_batch_size_usage_errors(source, tmp_path, cli, args, text: str) -> None:
    code, _, err = cli("batch", source[0], "-o", tmp_path / "x", *args)
    assert code == 2 and text in err, err
    assert not (tmp_path / "x").exists()


def _obs(arrays: dict[str, np.ndarray]) -> TensorDict:
    keys = ("policy", "critic")
    return TensorDict({k: torch.from_numpy(arrays[f"observations/{k}"][0]) for k in keys}, batch_size=[N])


def _models(arrays, recurrent: bool):
    obs = _obs(arrays)
    torch.manual_seed(0)
    gaussian = {"class_name": "GaussianDistribution", "init_std": 0.5}
    if recurrent:  # the recorded GRU states are [T, 1, N, 3]
        rnn = {"rnn_type": "gru", "rnn_hidden_dim": 3, "rnn_num_layers": 1, "hidden_dims": [16]}
        return RNNModel(obs, GROUPS, "actor", 2, distribution_cfg=gaussian, **rnn), RNNModel(
            obs, GROUPS, "critic", 1, **rnn
        )
    return (
        MLPModel(obs, GROUPS, "actor", 2, hidden_dims=[16], distribution_cfg=gaussian),
        MLPModel(obs, GROUPS, "critic", 1, hidden_dims=[16]),
    )


@pytest.mark.parametrize("recurrent", [False, True], ids=["feedforward", "gru"])
def test_ppo_update_fed_by_a_dataloader_equals_rsl_rl_storage(source, tmp_path, recurrent: bool) -> None:
    src, arrays = source
    mode = "recurrent" if recurrent else "feedforward"
    run_batch(src, tmp_path / "s", BatchOptions(3, epochs=2, seed=7, mode=mode, rsl_parity=True), RunOptions())
    actor, critic = _models(arrays, recurrent)
    results, params = [], []
    for feed in ("rsl_rl", "dataloader"):
        ppo = PPO(copy.deepcopy(actor), copy.deepcopy(critic), rsl_storage(arrays), num_learning_epochs=2,
                  num_mini_batches=3)  # fmt: skip
        if feed == "dataloader":
            loader = DataLoader(ShardDataset(tmp_path / "s", epochs="all"), batch_size=None, num_workers=2)
            name = "recurrent_mini_batch_generator" if recurrent else "mini_batch_generator"
            setattr(ppo.storage, name, lambda *args, loader=loader, **kwargs: iter(loader))
        torch.manual_seed(7)  # RSL-RL draws its feed-forward order from the global RNG; the shards from seed 7
        results.append(ppo.update())
        params.append([p.detach().clone() for m in (ppo.actor, ppo.critic) for p in m.parameters()])
    assert results[0] == results[1]
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1], strict=True))  # bit for bit
    before = [p for m in (actor, critic) for p in m.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(params[0], before, strict=True))
