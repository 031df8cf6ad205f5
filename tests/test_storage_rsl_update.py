"""A storage loaded with ``RolloutStorage.from_hdf5`` goes straight into RSL-RL's own ``update()`` (issue 12.11).

The same recorded data is fed to RSL-RL 5.5.1's ``PPO.update()`` / ``Distillation.update()`` twice: once from
RSL-RL's own storage, once from rolloutcli's storage saved with ``to_hdf5`` and loaded with ``from_hdf5``
(default settings). Same data and same seeds must give the same parameters, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rsl_rl.algorithms import PPO, Distillation
from rsl_rl.models import MLPModel
from rsl_rl.storage import RolloutStorage as RslStorage
from tensordict import TensorDict

from rolloutcli import RolloutStorage

T, N, OBS, ACT = 8, 6, 5, 2
GROUPS = {"actor": ["policy"], "critic": ["policy", "critic"], "student": ["policy"], "teacher": ["critic"]}


def _obs(generator: torch.Generator) -> TensorDict:
    data = {"policy": torch.randn(N, OBS, generator=generator), "critic": torch.randn(N, OBS, generator=generator)}
    return TensorDict(data, batch_size=[N])


def _fill(storage, training_type: str) -> None:
    """Identical, seeded transitions into either storage class."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(T):
        transition = type(storage).Transition()
        transition.observations = _obs(generator)
        transition.actions = torch.randn(N, ACT, generator=generator)
        transition.rewards = torch.randn(N, generator=generator)
        transition.dones = (torch.rand(N, generator=generator) < 0.2).to(torch.uint8)
        if training_type == "rl":
            transition.values = torch.randn(N, 1, generator=generator)
            transition.actions_log_prob = torch.randn(N, generator=generator)
            mean, std = torch.randn(N, ACT, generator=generator), torch.rand(N, ACT, generator=generator) + 0.5
            transition.distribution_params = (mean, std)
        else:
            transition.privileged_actions = torch.randn(N, ACT, generator=generator)
        storage.add_transition(transition)
    if training_type == "rl":
        storage.returns = torch.randn(T, N, 1, generator=generator)
        storage.advantages = torch.randn(T, N, 1, generator=generator)


def _model(obs: TensorDict, obs_set: str, output: int, stochastic: bool) -> MLPModel:
    distribution = {"class_name": "GaussianDistribution", "init_std": 1.0} if stochastic else None
    return MLPModel(obs, GROUPS, obs_set, output, hidden_dims=(16, 16), distribution_cfg=distribution)


def _ppo_parameters(storage) -> list[torch.Tensor]:
    torch.manual_seed(7)
    obs = _obs(torch.Generator().manual_seed(0))
    ppo = PPO(
        _model(obs, "actor", ACT, True),
        _model(obs, "critic", 1, False),
        storage,
        num_learning_epochs=2,
        num_mini_batches=3,
        schedule="adaptive",
    )
    torch.manual_seed(11)  # the mini-batch order: RSL-RL draws it from the global RNG
    ppo.update()
    return [p.detach().clone() for p in (*ppo.actor.parameters(), *ppo.critic.parameters())]


def test_ppo_update_from_a_loaded_storage_equals_rsl_rl(tmp_path: Path) -> None:
    theirs = RslStorage("rl", N, T, _obs(torch.Generator().manual_seed(0)), (ACT,), "cpu")
    _fill(theirs, "rl")
    ours = RolloutStorage("rl", N, T, _obs(torch.Generator().manual_seed(0)), (ACT,), "cpu")
    _fill(ours, "rl")
    ours.distribution_names = ["mean", "std"]
    ours.to_hdf5(tmp_path / "r.h5")
    loaded = RolloutStorage.from_hdf5(tmp_path / "r.h5")
    assert isinstance(loaded.observations, TensorDict) and loaded.observations.batch_size == (T, N)
    expected, found = _ppo_parameters(theirs), _ppo_parameters(loaded)
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))


def _distillation_parameters(storage) -> list[torch.Tensor]:
    torch.manual_seed(5)
    obs = _obs(torch.Generator().manual_seed(0))
    algorithm = Distillation(
        _model(obs, "student", ACT, False), _model(obs, "teacher", ACT, False), storage, gradient_length=4
    )
    algorithm.update()
    return [p.detach().clone() for p in algorithm.student.parameters()]


def test_distillation_update_from_a_loaded_storage_equals_rsl_rl(tmp_path: Path) -> None:
    theirs = RslStorage("distillation", N, T, _obs(torch.Generator().manual_seed(0)), (ACT,), "cpu")
    _fill(theirs, "distillation")
    ours = RolloutStorage("distillation", N, T, _obs(torch.Generator().manual_seed(0)), (ACT,), "cpu")
    _fill(ours, "distillation")
    ours.to_hdf5(tmp_path / "d.h5")
    loaded = RolloutStorage.from_hdf5(tmp_path / "d.h5")
    assert loaded.training_type == "distillation"
    expected, found = _distillation_parameters(theirs), _distillation_parameters(loaded)
    assert all(torch.equal(a, b) for a, b in zip(expected, found, strict=True))
