"""``update_from_shards``: RSL-RL 5.5.1's own ``PPO.update()`` / ``Distillation.update()`` on a shard folder equals,
bit for bit, the update on RSL-RL's own storage of the same rollout (issue 41.3): feed-forward and recurrent
(GRU, LSTM) under ``batch --rsl-parity``, distillation as written; normalizers included."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_factory import write_rollout
from rsl_rl.algorithms import PPO, Distillation
from rsl_rl.models import MLPModel, RNNModel
from tensordict import TensorDict
from test_batching import full_arrays, rsl_storage

from rolloutcli import RolloutError, ShardStorage, update_from_shards
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions

T, N = 10, 6
GROUPS = {"actor": ["policy"], "critic": ["critic"], "student": ["policy"], "teacher": ["critic"]}
GAUSSIAN = {"class_name": "GaussianDistribution", "init_std": 0.5}


def _arrays(hidden: str | None) -> dict[str, np.ndarray]:
    arrays = full_arrays(T, N, hidden=hidden, seed=4)
    for key in ("observations/policy", "observations/critic"):
        arrays[key] = (arrays[key] / 1000.0).astype(np.float32)  # identifiable, and of a trainable scale
    return arrays


def _observation(arrays: dict[str, np.ndarray]) -> TensorDict:
    return TensorDict({k: torch.from_numpy(arrays[f"observations/{k}"][0]) for k in ("policy", "critic")}, [N])


def _state(*models: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers (the normalizers' statistics)."""
    return [t.detach().clone() for model in models for t in model.state_dict().values()]


def _models(arrays: dict[str, np.ndarray], hidden: str | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    obs = _observation(arrays)
    torch.manual_seed(0)
    if hidden is None:
        actor = MLPModel(obs, GROUPS, "actor", 2, hidden_dims=[16], obs_normalization=True, distribution_cfg=GAUSSIAN)
        return actor, MLPModel(obs, GROUPS, "critic", 1, hidden_dims=[16], obs_normalization=True)
    rnn = {"rnn_type": hidden, "rnn_hidden_dim": 3, "rnn_num_layers": 2 if hidden == "lstm" else 1}
    actor = RNNModel(
        obs, GROUPS, "actor", 2, hidden_dims=[16], obs_normalization=True, distribution_cfg=GAUSSIAN, **rnn
    )
    return actor, RNNModel(obs, GROUPS, "critic", 1, hidden_dims=[16], obs_normalization=True, **rnn)


@pytest.mark.parametrize("hidden", [None, "gru", "lstm"])
def test_ppo_update_from_a_shard_folder_equals_rsl_rl_bit_for_bit(tmp_path: Path, hidden: str | None) -> None:
    arrays = _arrays(hidden)
    mode = "feedforward" if hidden is None else "recurrent"
    src = write_rollout(tmp_path / "src.h5", arrays)
    run_batch(src, tmp_path / "s", BatchOptions(3, epochs=2, seed=7, mode=mode, rsl_parity=True), RunOptions())
    actor, critic = _models(arrays, hidden)
    results, states = [], []
    for source in ("rsl_rl", "shards"):
        own = rsl_storage(arrays)
        ppo = PPO(copy.deepcopy(actor), copy.deepcopy(critic), own, num_learning_epochs=2, num_mini_batches=3)
        torch.manual_seed(7)  # RSL-RL draws its order from the global RNG; the shards from seed 7
        results.append(ppo.update() if source == "rsl_rl" else update_from_shards(ppo, tmp_path / "s"))
        states.append(_state(ppo.actor, ppo.critic))
        assert ppo.storage is own  # put back
    assert results[0] == results[1]
    for ours, theirs in zip(states[1], states[0], strict=True):
        assert torch.equal(ours, theirs)  # bit for bit, normalizers' statistics included
    assert not all(torch.equal(a, b) for a, b in zip(states[0], _state(actor, critic), strict=True))


def test_distillation_update_from_a_shard_folder_equals_rsl_rl_bit_for_bit(tmp_path: Path) -> None:
    arrays = _arrays(None)
    src = write_rollout(tmp_path / "src.h5", arrays)
    run_batch(src, tmp_path / "d", BatchOptions(4, mode="distillation"), RunOptions())
    obs = _observation(arrays)
    torch.manual_seed(0)
    student = MLPModel(obs, GROUPS, "student", 2, hidden_dims=[16], obs_normalization=True)
    teacher = MLPModel(obs, GROUPS, "teacher", 2, hidden_dims=[16])
    results, states = [], []
    for source in ("rsl_rl", "shards"):
        algo = Distillation(copy.deepcopy(student), copy.deepcopy(teacher), rsl_storage(arrays, "distillation"),
                            num_learning_epochs=2, gradient_length=5)  # fmt: skip
        results.append(algo.update() if source == "rsl_rl" else update_from_shards(algo, tmp_path / "d"))
        states.append(_state(algo.student))
    assert results[0] == results[1]
    for ours, theirs in zip(states[1], states[0], strict=True):
        assert torch.equal(ours, theirs)
    assert not all(torch.equal(a, b) for a, b in zip(states[0], _state(student), strict=True))


@pytest.mark.parametrize("mode", ["feedforward", "recurrent", "distillation"])
def test_observations_are_the_source_rows_in_rsl_rl_order(tmp_path: Path, mode: str) -> None:
    arrays = _arrays("gru")
    src = write_rollout(tmp_path / "src.h5", arrays)
    run_batch(src, tmp_path / "s", BatchOptions(3, epochs=2, seed=1, mode=mode), RunOptions())
    observations = ShardStorage(tmp_path / "s").observations
    assert observations.batch_size == (T, N)
    for key in ("policy", "critic"):
        assert torch.equal(observations[key], torch.from_numpy(arrays[f"observations/{key}"]))


@pytest.mark.parametrize(
    ("mode", "held"), [("feedforward", 56), ("recurrent", 4 * T)]
)  # 60 rows % 7: 4 dropped; 6 envs // 4: one env per mini-batch, 2 envs dropped
def test_dropped_rows_leave_the_rows_held_in_source_order(tmp_path: Path, mode: str, held: int) -> None:
    arrays = _arrays("gru")
    src = write_rollout(tmp_path / "src.h5", arrays)
    M = 7 if mode == "feedforward" else 4
    run_batch(src, tmp_path / "s", BatchOptions(M, seed=3, mode=mode, rsl_parity=True), RunOptions())
    observations = ShardStorage(tmp_path / "s").observations
    assert observations.batch_size == (1, held)
    flat = torch.from_numpy(arrays["observations/policy"]).flatten(0, 1)
    kept = observations["policy"][0]
    assert torch.equal(kept, flat[torch.isin(flat[:, 0], kept[:, 0])])  # identifiable rows, ascending


@pytest.mark.parametrize(
    ("options", "ppo", "message"),
    [
        (
            BatchOptions(2, epochs=2, rsl_parity=True),
            {"num_mini_batches": 3, "num_learning_epochs": 2},
            "field 'num_mini_batches': expected 3 (the algorithm's num_mini_batches), found 2. "
            "Write the shards with `rolloutcli batch -m 3` or set num_mini_batches=2.",
        ),
        (
            BatchOptions(3, epochs=1, rsl_parity=True),
            {"num_mini_batches": 3, "num_learning_epochs": 2},
            "field 'epochs': expected 2 (the algorithm's num_learning_epochs), found 1. "
            "Write the shards with `rolloutcli batch --epochs 2` or set num_learning_epochs=1.",
        ),
        (
            BatchOptions(3, mode="distillation"),
            {"num_mini_batches": 3, "num_learning_epochs": 1},
            "field 'mode': expected feedforward (the algorithm calls mini_batch_generator), found distillation. "
            "Write the shards with `rolloutcli batch`.",
        ),
    ],
)
def test_a_folder_the_algorithm_does_not_ask_for_is_refused(tmp_path: Path, options, ppo, message: str) -> None:
    arrays = _arrays(None)
    run_batch(write_rollout(tmp_path / "src.h5", arrays), tmp_path / "s", options, RunOptions())
    actor, critic = _models(arrays, None)
    own = rsl_storage(arrays)
    algorithm = PPO(actor, critic, own, **ppo)
    before = _state(algorithm.actor, algorithm.critic)
    with pytest.raises(RolloutError) as caught:
        update_from_shards(algorithm, tmp_path / "s")
    assert str(caught.value) == f"{tmp_path / 's' / 'manifest.json'}: {message}"
    assert algorithm.storage is own
    assert all(torch.equal(a, b) for a, b in zip(before, _state(algorithm.actor, algorithm.critic), strict=True))
