"""IkostrikovRolloutStorage against a reference transcribed from ikostrikov/pytorch-a2c-ppo-acktr-gail's
a2c_ppo_acktr/storage.py (compute_returns, feed_forward_generator with drop_last=True, recurrent_generator)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data.sampler import BatchSampler, SubsetRandomSampler

from rolloutcli.compat import IkostrikovRolloutStorage
from rolloutcli.errors import RolloutError


class Box:
    shape = (2,)


class Discrete:
    n = 4


def ref_compute_returns(s, next_value, use_gae, gamma, gae_lambda, use_proper_time_limits):
    """The original's loops, on the storage's tensors in place."""
    if use_proper_time_limits:
        if use_gae:
            s.value_preds[-1] = next_value
            gae = 0
            for step in reversed(range(s.rewards.size(0))):
                delta = s.rewards[step] + gamma * s.value_preds[step + 1] * s.masks[step + 1] - s.value_preds[step]
                gae = delta + gamma * gae_lambda * s.masks[step + 1] * gae
                gae = gae * s.bad_masks[step + 1]
                s.returns[step] = gae + s.value_preds[step]
        else:
            s.returns[-1] = next_value
            for step in reversed(range(s.rewards.size(0))):
                s.returns[step] = (s.returns[step + 1] * gamma * s.masks[step + 1] + s.rewards[step]) * s.bad_masks[
                    step + 1
                ] + (1 - s.bad_masks[step + 1]) * s.value_preds[step]
    elif use_gae:
        s.value_preds[-1] = next_value
        gae = 0
        for step in reversed(range(s.rewards.size(0))):
            delta = s.rewards[step] + gamma * s.value_preds[step + 1] * s.masks[step + 1] - s.value_preds[step]
            gae = delta + gamma * gae_lambda * s.masks[step + 1] * gae
            s.returns[step] = gae + s.value_preds[step]
    else:
        s.returns[-1] = next_value
        for step in reversed(range(s.rewards.size(0))):
            s.returns[step] = s.returns[step + 1] * gamma * s.masks[step + 1] + s.rewards[step]


def ref_feed_forward(s, advantages, num_mini_batch=None, mini_batch_size=None, generator=None):
    num_steps, num_processes = s.rewards.size()[0:2]
    batch_size = num_processes * num_steps
    if mini_batch_size is None:
        mini_batch_size = batch_size // num_mini_batch
    sampler = BatchSampler(SubsetRandomSampler(range(batch_size), generator=generator), mini_batch_size, drop_last=True)
    for indices in sampler:
        yield (
            s.obs[:-1].view(-1, *s.obs.size()[2:])[indices],
            s.recurrent_hidden_states[:-1].view(-1, s.recurrent_hidden_states.size(-1))[indices],
            s.actions.view(-1, s.actions.size(-1))[indices],
            s.value_preds[:-1].view(-1, 1)[indices],
            s.returns[:-1].view(-1, 1)[indices],
            s.masks[:-1].view(-1, 1)[indices],
            s.action_log_probs.view(-1, 1)[indices],
            None if advantages is None else advantages.view(-1, 1)[indices],
        )


def ref_recurrent(s, advantages, num_mini_batch, generator=None):
    num_processes = s.rewards.size(1)
    num_envs_per_batch = num_processes // num_mini_batch
    perm = torch.randperm(num_processes, generator=generator)
    for start_ind in range(0, num_processes, num_envs_per_batch):
        parts = [[] for _ in range(8)]
        for offset in range(num_envs_per_batch):
            ind = perm[start_ind + offset]
            parts[0].append(s.obs[:-1, ind])
            parts[1].append(s.recurrent_hidden_states[0:1, ind])
            parts[2].append(s.actions[:, ind])
            parts[3].append(s.value_preds[:-1, ind])
            parts[4].append(s.returns[:-1, ind])
            parts[5].append(s.masks[:-1, ind])
            parts[6].append(s.action_log_probs[:, ind])
            parts[7].append(advantages[:, ind])
        T, N = s.num_steps, num_envs_per_batch
        out = [torch.stack(p, 1) for p in parts]
        out[1] = out[1].view(N, -1)
        yield tuple(x if i == 1 else x.view(T * N, *x.size()[2:]) for i, x in enumerate(out))


def filled(steps=7, envs=4, action_space=None, seed=0, after_update=True) -> IkostrikovRolloutStorage:
    """A storage filled through ``insert`` with episodes ending by termination and by time limit."""
    g = torch.Generator().manual_seed(seed)
    s = IkostrikovRolloutStorage(steps, envs, (3,), action_space or Box(), 5)
    for _ in range(2 if after_update else 1):
        for _ in range(steps):
            masks = (torch.rand(envs, 1, generator=g) > 0.3).float()
            bad = torch.maximum(masks, (torch.rand(envs, 1, generator=g) > 0.5).float())  # time-out implies done
            actions = torch.randint(0, 4, (envs, 1), generator=g) if s.actions.dtype == torch.long else None
            s.insert(
                torch.randn(envs, 3, generator=g),
                torch.randn(envs, 5, generator=g),
                actions if actions is not None else torch.randn(envs, 2, generator=g),
                torch.randn(envs, 1, generator=g),
                torch.randn(envs, 1, generator=g),
                torch.randn(envs, 1, generator=g),
                masks,
                bad,
            )
        if after_update:
            s.after_update()
    return s


def clone(s: IkostrikovRolloutStorage) -> IkostrikovRolloutStorage:
    c = IkostrikovRolloutStorage.__new__(IkostrikovRolloutStorage)
    c.__dict__.update({k: v.clone() if torch.is_tensor(v) else v for k, v in s.__dict__.items()})
    return c


FIELDS = ("obs", "recurrent_hidden_states", "rewards", "value_preds", "returns", "action_log_probs", "actions")
ALL = (*FIELDS, "masks", "bad_masks")


def test_layout_matches_the_original():
    s = IkostrikovRolloutStorage(6, 3, (2, 2), Discrete(), 4)
    assert s.obs.shape == (7, 3, 2, 2) and s.recurrent_hidden_states.shape == (7, 3, 4)
    assert s.value_preds.shape == s.returns.shape == s.masks.shape == s.bad_masks.shape == (7, 3, 1)
    assert s.rewards.shape == s.action_log_probs.shape == (6, 3, 1)
    assert s.actions.shape == (6, 3, 1) and s.actions.dtype == torch.long
    assert IkostrikovRolloutStorage(6, 3, (2,), Box(), 1).actions.shape == (6, 3, 2)
    assert bool(s.masks.eq(1).all()) and bool(s.bad_masks.eq(1).all())


def test_insert_after_update_step_wraps():
    s = filled(steps=4, envs=2, after_update=False)
    assert s.step == 0
    last = {n: getattr(s, n)[-1].clone() for n in ("obs", "recurrent_hidden_states", "masks", "bad_masks")}
    s.after_update()
    for name, row in last.items():
        assert torch.equal(getattr(s, name)[0], row)


@pytest.mark.parametrize("use_gae", [True, False])
@pytest.mark.parametrize("proper", [True, False])
def test_compute_returns_bit_for_bit(use_gae, proper):
    s = filled(seed=3)
    s.returns.normal_(generator=torch.Generator().manual_seed(9))  # row T must be kept where the original keeps it
    ref = clone(s)
    next_value = torch.randn(4, 1, generator=torch.Generator().manual_seed(5))
    s.compute_returns(next_value, use_gae, 0.99, 0.95, use_proper_time_limits=proper)
    ref_compute_returns(ref, next_value, use_gae, 0.99, 0.95, proper)
    for name in ALL:
        assert torch.equal(getattr(s, name), getattr(ref, name)), name


def test_proper_time_limits_changes_the_numbers():
    s, t = filled(seed=3), filled(seed=3)
    s.compute_returns(torch.ones(4, 1), True, 0.99, 0.95, use_proper_time_limits=True)
    t.compute_returns(torch.ones(4, 1), True, 0.99, 0.95, use_proper_time_limits=False)
    assert bool(t.bad_masks.eq(0).any()) and not torch.equal(s.returns, t.returns)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("kwargs", [{"num_mini_batch": 4}, {"num_mini_batch": 3}, {"mini_batch_size": 5}])
def test_feed_forward_generator_equals_reference(kwargs):
    s = filled(seed=1)
    s.compute_returns(torch.zeros(4, 1), True, 0.99, 0.95)
    advantages = s.returns[:-1] - s.value_preds[:-1]
    ours = list(s.feed_forward_generator(advantages, generator=torch.Generator().manual_seed(7), **kwargs))
    ref = list(ref_feed_forward(s, advantages, generator=torch.Generator().manual_seed(7), **kwargs))
    assert len(ours) == len(ref) > 0
    for a, b in zip(ours, ref, strict=True):
        _same(a, b)
    none = next(s.feed_forward_generator(None, 2, generator=torch.Generator().manual_seed(7)))
    assert none[-1] is None


def test_feed_forward_global_rng_like_the_original():
    s = filled(seed=1)
    torch.manual_seed(11)
    ours = list(s.feed_forward_generator(None, 2))
    torch.manual_seed(11)
    ref = list(ref_feed_forward(s, None, 2))
    for a, b in zip(ours, ref, strict=True):
        _same(a, b)


@pytest.mark.parametrize("action_space", [Box(), Discrete()])
def test_recurrent_generator_equals_reference(action_space):
    s = filled(envs=6, seed=2, action_space=action_space)
    s.compute_returns(torch.zeros(6, 1), True, 0.99, 0.95)
    advantages = s.returns[:-1] - s.value_preds[:-1]
    ours = list(s.recurrent_generator(advantages, 3, generator=torch.Generator().manual_seed(4)))
    ref = list(ref_recurrent(s, advantages, 3, generator=torch.Generator().manual_seed(4)))
    assert len(ours) == len(ref) == 3
    for a, b in zip(ours, ref, strict=True):
        _same(a, b)


def test_generators_refuse_too_many_mini_batches():
    s = filled(steps=2, envs=2)
    with pytest.raises(ValueError, match=r"number of steps \(2\) = 4 to be greater than or equal .* \(5\)"):
        next(s.feed_forward_generator(None, 5))
    with pytest.raises(ValueError, match=r"processes \(2\) to be greater than or equal .* \(3\)"):
        next(s.recurrent_generator(None, 3))


@pytest.mark.parametrize("action_space", [Box(), Discrete()])
def test_hdf5_round_trip_and_format_mapping(tmp_path, action_space):
    from rolloutcli.hdf5.storage_io import read_rollout

    s = filled(seed=4, action_space=action_space)
    s.masks[0, 1] = 0  # row 0 travels as an extra
    s.to_hdf5(tmp_path / "r.h5")
    back = IkostrikovRolloutStorage.from_hdf5(tmp_path / "r.h5")
    for name in (*ALL[:4], *ALL[5:]):
        assert torch.equal(getattr(back, name), getattr(s, name)), name
    assert back.actions.dtype == s.actions.dtype and back.num_steps == 7 and back.step == 0
    r = read_rollout(tmp_path / "r.h5").tensors
    assert torch.equal(r["dones"].float(), 1 - s.masks[1:, :, 0])
    assert torch.equal(r["time_outs"].float(), 1 - s.bad_masks[1:, :, 0])
    assert torch.equal(r["last_values"], s.value_preds[-1, :, 0])
    assert torch.equal(r["values"], s.value_preds[:-1, :, 0])


def test_to_moves_every_tensor():
    s = filled(steps=2, envs=2)
    s.to("cpu")
    assert all(getattr(s, n).device.type == "cpu" for n in ALL)


def test_from_hdf5_refuses_two_observation_groups(tmp_path):
    from rolloutcli.hdf5.storage_io import write_rollout

    z = torch.zeros(2, 1)
    write_rollout(
        tmp_path / "two.h5",
        {"observations/a": z, "observations/b": z, "actions": z, "rewards": z, "dones": z.to(torch.uint8)},
    )
    with pytest.raises(RolloutError) as err:
        IkostrikovRolloutStorage.from_hdf5(tmp_path / "two.h5")
    assert str(err.value) == (
        f"{tmp_path / 'two.h5'}: field 'observations': expected one observation group (the storage holds one obs "
        "tensor), found 2 groups: a, b. Write a file with one group, e.g. observations/policy."
    )


@pytest.mark.parametrize(("proper", "rule"), [(False, "ignore"), (True, "proper")])
def test_returns_without_gae_are_gae_with_lambda_one(tmp_path, cli, proper, rule):
    """docs/commands.md (issue 41.8): ``returns`` never bootstraps; ikostrikov's ``use_gae=False`` returns are
    ``gae --lam 1`` with the matching ``--timeouts`` rule, to float32 rounding."""
    import h5py

    s = filled(seed=4)
    next_value = torch.randn(4, 1, generator=torch.Generator().manual_seed(6))
    s.value_preds[-1] = next_value  # what the file's last_values hold
    s.to_hdf5(tmp_path / "ik.h5")
    s.compute_returns(next_value, False, 0.99, 0.95, use_proper_time_limits=proper)
    flags = ("--gamma", "0.99", "--lam", "1", "--timeouts", rule, "--no-normalize", "-q")
    code, _, err = cli("gae", tmp_path / "ik.h5", "-o", tmp_path / "gae.h5", *flags)
    assert code == 0, err
    with h5py.File(tmp_path / "gae.h5", "r") as handle:
        returns = torch.from_numpy(handle["returns"][()])
    torch.testing.assert_close(returns, s.returns[:-1, :, 0], rtol=1e-5, atol=1e-5)
    code, _, err = cli("returns", tmp_path / "ik.h5", "-o", tmp_path / "mc.h5", "--gamma", "0.99", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "mc.h5", "r") as handle:  # no value is added where the data stops
        assert handle["returns_to_go"][-1].tolist() == handle["rewards"][-1].tolist()
