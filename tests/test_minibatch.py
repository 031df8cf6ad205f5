"""``Batch``: a pytree dataclass with ``.to()``, ``.pin_memory()``, a readable repr and default collation."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from tensordict import TensorDict
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from rolloutcli import RolloutStorage
from rolloutcli.minibatch import Batch, collate_batches


def flat(rows: int = 4, start: float = 0.0) -> Batch:
    values = torch.arange(rows, dtype=torch.float32).unsqueeze(-1) + start
    return Batch(
        observations=TensorDict({"policy": values.expand(rows, 3).clone()}, batch_size=[rows]),
        actions=values.expand(rows, 2).clone(),
        values=values,
        advantages=values * 2,
        returns=values * 3,
        old_actions_log_prob=-values,
        old_distribution_params=(values.expand(rows, 2).clone(), values.expand(rows, 2) + 1),
    )


def recurrent(steps: int, trajectories: int, envs: int) -> Batch:
    masks = torch.ones(steps, trajectories, dtype=torch.bool)
    return Batch(
        observations=TensorDict({"policy": torch.randn(steps, trajectories, 3)}, batch_size=[steps, trajectories]),
        actions=torch.randn(steps, envs, 2),
        values=torch.randn(steps, envs, 1),
        hidden_states=(
            torch.randn(1, trajectories, 5),
            (torch.randn(2, trajectories, 5), torch.zeros(2, trajectories, 5)),
        ),
        masks=masks,
    )


def test_is_rsl_rl_batch_and_unpacks_like_it() -> None:
    assert RolloutStorage.Batch is Batch
    batch = recurrent(6, 3, 2)
    actor, critic = batch.hidden_states  # RSL-RL: batch.hidden_states[0] for the actor, [1] for the critic
    assert actor.shape == (1, 3, 5) and isinstance(critic, tuple)
    batch.advantages = torch.zeros(1)  # RSL-RL assigns fields (per-mini-batch normalisation, symmetry)
    assert Batch().hidden_states == (None, None)


def test_repr_lists_fields_and_shapes() -> None:
    text = repr(flat(4))
    assert text.startswith("Batch(observations=TensorDict(policy: [4, 3] float32), actions=[4, 2] float32")
    assert "old_distribution_params=([4, 2] float32, [4, 2] float32)" in text and "masks" not in text
    assert "0x" not in text


def test_pytree_reaches_every_tensor() -> None:
    batch = recurrent(6, 3, 2)
    leaves, spec = pytree.tree_flatten(batch)
    assert sum(isinstance(leaf, torch.Tensor) for leaf in leaves) == 7
    doubled = pytree.tree_map(lambda t: t * 2 if t.is_floating_point() else t, batch)
    assert isinstance(doubled, Batch) and torch.equal(doubled.actions, batch.actions * 2)
    assert torch.equal(doubled.hidden_states[1][0], batch.hidden_states[1][0] * 2)
    assert isinstance(pytree.tree_unflatten(leaves, spec), Batch)


def test_to_moves_every_tensor() -> None:
    batch = flat(4)
    moved = batch.to("cpu", non_blocking=True)
    assert moved is not batch and moved.actions is batch.actions  # already there: not copied
    doubled = batch.to(torch.float64)
    assert doubled.actions.dtype == torch.float64 and doubled.observations["policy"].dtype == torch.float64


def test_torch_pin_memory_path_calls_batch_pin_memory(monkeypatch) -> None:
    calls = []

    def spy(self, device=None):
        calls.append(self)
        return self.apply(lambda t: t.clone(), lambda td: td.clone())

    monkeypatch.setattr(Batch, "pin_memory", spy)
    batch = flat(4)
    out = torch_pin_memory(batch)  # what DataLoader(pin_memory=True)'s pin-memory thread runs on each batch
    assert calls == [batch] and isinstance(out, Batch)
    assert torch.equal(out.actions, batch.actions) and out.actions is not batch.actions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_dataloader_pins_batches() -> None:
    batches = [flat(4, start=10 * i) for i in range(3)]
    for batch in DataLoader(batches, batch_size=None, pin_memory=True):
        assert batch.actions.is_pinned() and batch.observations["policy"].is_pinned()
        assert batch.old_distribution_params[0].is_pinned()
        on_gpu = batch.to("cuda", non_blocking=True)
        assert on_gpu.actions.is_cuda and on_gpu.observations.device.type == "cuda"


def test_default_collation_concatenates_rows() -> None:
    loaded = list(DataLoader([flat(4), flat(3, start=100), flat(4, start=200)], batch_size=2))
    assert [b.actions.shape[0] for b in loaded] == [7, 4]
    first = loaded[0]
    assert isinstance(first, Batch) and first.observations.batch_size == (7,)
    assert first.values[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 102]
    assert first.old_distribution_params[1].shape == (7, 2) and first.hidden_states == (None, None)


def test_recurrent_collation_pads_time_and_concatenates_trajectories() -> None:
    a, b = recurrent(6, 3, 2), recurrent(4, 1, 1)
    b.masks[3:] = False
    out = collate_batches([a, b])
    assert out.masks.shape == (6, 4) and out.observations.batch_size == (6, 4)
    assert out.masks[:, 3].tolist() == [True, True, True, False, False, False]
    assert torch.equal(out.observations["policy"][:4, 3], b.observations["policy"][:, 0])
    assert not out.observations["policy"][4:, 3].any()  # zero padding
    assert out.actions.shape == (6, 3, 2) and out.hidden_states[0].shape == (1, 4, 5)
    assert out.hidden_states[1][1].shape == (2, 4, 5)
    with pytest.raises(ValueError, match="'values' is None in some"):
        collate_batches([a, Batch(a.observations, a.actions, masks=a.masks)])
