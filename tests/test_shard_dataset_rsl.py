"""``ShardDataset`` batches go straight into RSL-RL's own ``PPO.update()`` and ``Distillation.update()`` (issue 12.11)
and keep manifest order through a ``DataLoader`` with workers (issue 12.6)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_factory import write_rollout
from rsl_rl.algorithms import PPO, Distillation
from rsl_rl.models import MLPModel
from tensordict import TensorDict
from test_batching import assert_batches, full_arrays, rsl_storage
from torch.utils.data import DataLoader

from rolloutcli import ShardDataset
from rolloutcli.pipeline.batch import BatchOptions, run_batch
from rolloutcli.pipeline.options import RunOptions

T, N = 10, 6
GROUPS = {"actor": ["policy"], "critic": ["critic"], "student": ["policy"], "teacher": ["critic"]}


def _arrays() -> dict[str, np.ndarray]:
    arrays = full_arrays(T, N, hidden=None, seed=4)
    for key in ("observations/policy", "observations/critic"):
        arrays[key] = (arrays[key] / 1000.0).astype(np.float32)  # identifiable, and of a trainable scale
    return arrays


def _observation(arrays: dict[str, np.ndarray]) -> TensorDict:
    keys = ("policy", "critic")
    return TensorDict({k: torch.from_numpy(arrays[f"observations/{k}"][0]) for k in keys}, batch_size=[N])


def _parameters(*models: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for model in models for p in model.parameters()]


def test_ppo_update_from_shards_equals_update_on_rsl_rl_storage(tmp_path: Path) -> None:
    arrays = _arrays()
    src = write_rollout(tmp_path / "src.h5", arrays)
    run_batch(src, tmp_path / "ff", BatchOptions(3, epochs=2, seed=7, rsl_parity=True), RunOptions())
    obs = _observation(arrays)
    torch.manual_seed(0)
    gaussian = {"class_name": "GaussianDistribution", "init_std": 0.5}
    actor = MLPModel(obs, GROUPS, "actor", 2, hidden_dims=[16], distribution_cfg=gaussian)
    critic = MLPModel(obs, GROUPS, "critic", 1, hidden_dims=[16])
    results, params = [], []
    for source in ("rsl_rl", "shards"):
        ppo = PPO(copy.deepcopy(actor), copy.deepcopy(critic), rsl_storage(arrays), num_learning_epochs=2,
                  num_mini_batches=3)  # fmt: skip
        if source == "shards":
            batches = list(ShardDataset(tmp_path / "ff", epochs="all"))
            assert isinstance(batches[0].observations, TensorDict)
            ppo.storage.mini_batch_generator = lambda *args, b=batches, **kwargs: iter(b)  # type: ignore[method-assign]
        torch.manual_seed(7)  # RSL-RL draws its order from the global RNG; the shards from seed 7
        results.append(ppo.update())
        params.append(_parameters(ppo.actor, ppo.critic))
    assert results[0] == results[1]
    for ours, theirs in zip(params[1], params[0], strict=True):
        assert torch.equal(ours, theirs)  # bit for bit
    assert not all(torch.equal(a, b) for a, b in zip(params[0], _parameters(actor, critic), strict=True))


def test_distillation_update_from_shards_equals_update_on_rsl_rl_storage(tmp_path: Path) -> None:
    arrays = _arrays()
    src = write_rollout(tmp_path / "src.h5", arrays)
    run_batch(src, tmp_path / "d", BatchOptions(4, mode="distillation"), RunOptions())
    obs = _observation(arrays)
    torch.manual_seed(0)
    student = MLPModel(obs, GROUPS, "student", 2, hidden_dims=[16])
    teacher = MLPModel(obs, GROUPS, "teacher", 2, hidden_dims=[16])
    params = []
    for source in ("rsl_rl", "shards"):
        storage = rsl_storage(arrays, "distillation")
        algo = Distillation(copy.deepcopy(student), copy.deepcopy(teacher), storage, gradient_length=5)
        if source == "shards":
            batches = list(ShardDataset(tmp_path / "d"))
            assert len(batches) == T and isinstance(batches[0].observations, TensorDict)
            algo.storage.generator = lambda b=batches: iter(b)  # type: ignore[method-assign]
        algo.update()
        params.append(_parameters(algo.student))
    for ours, theirs in zip(params[1], params[0], strict=True):
        assert torch.equal(ours, theirs)
    assert not all(torch.equal(a, b) for a, b in zip(params[0], _parameters(student), strict=True))


@pytest.mark.parametrize("workers", [2, 3])
def test_distillation_steps_keep_their_order_through_dataloader_workers(tmp_path: Path, workers: int) -> None:
    arrays = _arrays()
    src = write_rollout(tmp_path / "src.h5", arrays)
    run_batch(src, tmp_path / "d", BatchOptions(3, mode="distillation", epochs=2), RunOptions())
    dataset = ShardDataset(tmp_path / "d", epochs="all")
    single = list(dataset)
    loaded = list(DataLoader(dataset, batch_size=None, num_workers=workers))
    assert len(loaded) == len(single) == len(dataset) == 2 * T
    steps = [round(float(b.observations["policy"][0, 0]) * 1000) // 1000 for b in loaded]
    assert steps == list(range(T)) * 2  # not 0, 4, 1, 5, ... (issue 12.6)
    assert_batches(loaded, single)


def test_feedforward_items_keep_manifest_order_through_workers(tmp_path: Path) -> None:
    src = write_rollout(tmp_path / "src.h5", _arrays())
    run_batch(src, tmp_path / "ff", BatchOptions(4, epochs=2, seed=1), RunOptions())
    items = list(DataLoader(ShardDataset(tmp_path / "ff", as_dict=True, epochs="all"), batch_size=None, num_workers=3))
    assert [(i["epoch"], i["mini_batch"]) for i in items] == [(e, b) for e in range(2) for b in range(4)]
