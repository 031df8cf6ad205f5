"""Index plans (core/batching.py) and RolloutStorage's generators against RSL-RL's own generators."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_factory import rollout_arrays
from rsl_rl.storage import RolloutStorage as RslStorage
from tensordict import TensorDict

from rolloutcli.core.batching import (
    distillation_plan,
    feedforward_plan,
    gather_fields,
    gather_rows,
    parity_sizes,
    plan_batches,
    recurrent_groups,
    recurrent_plan,
    split_sizes,
)
from rolloutcli.storage import RolloutStorage

# ------------------------------------------------------------------------------------------------------------
# helpers shared with the other batch test files
# ------------------------------------------------------------------------------------------------------------


def full_arrays(T: int = 12, N: int = 5, *, hidden: str | None = "gru", seed: int = 0) -> dict[str, np.ndarray]:
    """A rollout with advantages, returns and privileged actions (identifiable observations)."""
    arrays = rollout_arrays(T, N, seed=seed, hidden=hidden, layers=2 if hidden == "lstm" else 1)
    rng = np.random.default_rng(seed + 100)
    arrays["advantages"] = rng.standard_normal((T, N)).astype(np.float32)
    arrays["returns"] = rng.standard_normal((T, N)).astype(np.float32)
    arrays["privileged_actions"] = rng.standard_normal((T, N, 2)).astype(np.float32)
    return arrays


def rsl_storage(arrays: dict[str, np.ndarray], training_type: str = "rl") -> RslStorage:
    """RSL-RL's RolloutStorage filled step by step with add_transition (hidden states for actor and critic)."""
    T, N = arrays["rewards"].shape
    keys = sorted(k.split("/", 1)[1] for k in arrays if k.startswith("observations/"))

    def obs(t: int | None) -> TensorDict:
        values = {k: torch.from_numpy(arrays[f"observations/{k}"][0 if t is None else t]) for k in keys}
        return TensorDict(values, batch_size=[N])

    storage = RslStorage(training_type, N, T, obs(None), tuple(arrays["actions"].shape[2:]), "cpu")
    for t in range(T):
        tr = RslStorage.Transition()
        tr.observations = obs(t)
        tr.actions = torch.from_numpy(arrays["actions"][t])
        tr.rewards = torch.from_numpy(arrays["rewards"][t])
        tr.dones = torch.from_numpy(arrays["dones"][t])
        if training_type == "rl":
            tr.values = torch.from_numpy(arrays["values"][t]).unsqueeze(-1)
            tr.actions_log_prob = torch.from_numpy(arrays["actions_log_prob"][t])
            tr.distribution_params = (
                torch.from_numpy(arrays["distribution/mean"][t]),
                torch.from_numpy(arrays["distribution/std"][t]),
            )
        else:
            tr.privileged_actions = torch.from_numpy(arrays["privileged_actions"][t])
        states = []
        for net in ("actor", "critic"):
            parts = tuple(
                torch.from_numpy(arrays[f"hidden_states/{net}/{i}"][t])
                for i in (0, 1)
                if f"hidden_states/{net}/{i}" in arrays
            )
            states.append(None if not parts else parts[0] if len(parts) == 1 else parts)
        tr.hidden_states = (states[0], states[1])
        storage.add_transition(tr)
    if training_type == "rl":
        storage.advantages.copy_(torch.from_numpy(arrays["advantages"]).unsqueeze(-1))
        storage.returns.copy_(torch.from_numpy(arrays["returns"]).unsqueeze(-1))
    return storage


BATCH_FIELDS = (
    "observations",
    "actions",
    "values",
    "advantages",
    "returns",
    "old_actions_log_prob",
    "old_distribution_params",
    "hidden_states",
    "masks",
    "privileged_actions",
    "dones",
)


def assert_same(ours: object, theirs: object, where: str = "") -> None:
    """Exact equality of tensors (dtype, shape, values), dicts vs TensorDicts, tuples and None."""
    if theirs is None:
        assert ours is None, where
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), where
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (where, ours.shape, theirs.shape)
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:  # TensorDict or dict of observations
        assert sorted(ours.keys()) == sorted(theirs.keys()), where
        for key in theirs.keys():
            assert_same(ours[key], theirs[key], f"{where}.{key}")


def assert_batches(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for name in BATCH_FIELDS:
            assert_same(getattr(a, name), getattr(b, name), f"batch {i}.{name}")


def ours_from(arrays: dict[str, np.ndarray], training_type: str = "rl", tmp_path=None) -> RolloutStorage:
    from rollout_factory import write_rollout

    path = write_rollout(tmp_path / f"src_{training_type}.h5", arrays)
    return RolloutStorage.from_hdf5(path, training_type=training_type)


# ------------------------------------------------------------------------------------------------------------
# plans
# ------------------------------------------------------------------------------------------------------------


def test_split_rules() -> None:
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(9, 3) == [3, 3, 3]
    assert parity_sizes(10, 3) == [3, 3, 3]
    with pytest.raises(ValueError):
        split_sizes(2, 3)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 12), st.integers(1, 3), st.booleans())
def test_feedforward_plan_invariants(T: int, N: int, M: int, E: int, parity: bool) -> None:
    if M > T * N:
        return
    plan = feedforward_plan(T, N, M, E, parity=parity, generator=torch.Generator().manual_seed(1))
    assert len(plan.epoch_pass) == E
    for index in plan.epoch_pass:
        rows = plan.passes[index].all_rows()
        sizes = plan.passes[index].sizes
        assert len(sizes) == M and max(sizes) - min(sizes) <= (0 if parity else 1)
        kept = M * (T * N // M) if parity else T * N
        assert sorted(rows.tolist()) == list(range(kept))  # each kept row exactly once, the rest dropped
        assert plan.dropped_rows == T * N - kept
        positions = plan.passes[index].positions(T * N)
        assert torch.equal(rows[positions[rows]], rows)
    if parity:
        assert plan.epoch_pass == [0] * E  # one order reused every epoch, as RSL-RL


def test_feedforward_parity_equals_rsl_randperm_and_default_reshuffles() -> None:
    plan = feedforward_plan(10, 7, 4, 3, parity=True, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(5)
    assert torch.equal(plan.passes[0].rows, torch.randperm(4 * (70 // 4)))
    default = feedforward_plan(10, 7, 4, 3, parity=False, generator=torch.Generator().manual_seed(5))
    orders = [p.all_rows() for p in default.passes]
    assert len(orders) == 3 and not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])
    again = feedforward_plan(10, 7, 4, 3, parity=False, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(a.all_rows(), b.all_rows()) for a, b in zip(default.passes, again.passes, strict=True))


def test_recurrent_groups_modes() -> None:
    assert [g.tolist() for g in recurrent_groups(7, 3, parity=True, generator=None)] == [[0, 1], [2, 3], [4, 5]]
    assert [g.tolist() for g in recurrent_groups(7, 3, parity=False, generator=None)] == [[0, 1, 2], [3, 4], [5, 6]]
    shuffled = recurrent_groups(7, 3, parity=False, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert sorted(torch.cat(shuffled).tolist()) == list(range(7)) and [g.numel() for g in shuffled] == [3, 2, 2]
    assert all(torch.equal(g, torch.sort(g).values) for g in shuffled)
    plan = recurrent_plan(4, 7, 3, 2, parity=True, shuffle=False, generator=torch.Generator())
    assert plan.dropped_envs == [6] and plan.dropped_rows == 4 and plan.epoch_pass == [0, 0]
    rows = plan.passes[0].rows_of(1).view(4, 2)  # slot t * G + j -> row t * N + env
    assert rows.tolist() == [[t * 7 + 2, t * 7 + 3] for t in range(4)]
    shuffled_plan = recurrent_plan(4, 7, 3, 2, parity=False, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert shuffled_plan.epoch_pass == [0, 1]
    with pytest.raises(ValueError):
        recurrent_groups(7, 3, parity=True, shuffle=True, generator=None)


def test_distillation_plan_and_modes() -> None:
    plan = distillation_plan(10, 3, 4, 2)
    assert plan.passes[0].steps == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert plan.passes[0].sizes == (9, 9, 6, 6) and plan.epoch_pass == [0, 0]
    assert torch.equal(plan.passes[0].rows_of(1), torch.arange(9, 18))
    with pytest.raises(ValueError):
        plan_batches("sideways", 2, 2, 1, 1, generator=torch.Generator())


def test_gather_rows_matches_fancy_indexing_for_every_dtype() -> None:
    index = torch.randperm(50)[:31]
    for value in (
        torch.randn(50, 48),
        torch.randn(50, 3),
        torch.randn(50),
        torch.randint(0, 2, (50,), dtype=torch.uint8),
        torch.rand(50, 5) > 0.5,
        torch.randn(50, 2, 3).double(),
    ):
        assert torch.equal(gather_rows(value, index), value[index])
        out = torch.empty(40, *value.shape[1:], dtype=value.dtype)
        assert torch.equal(gather_rows(value, index, out=out[:31]), value[index])


FIELD_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.int64,
]


@settings(max_examples=60, deadline=None)
@given(
    source_rows=st.integers(1, 300),
    data=st.data(),
)
def test_gather_fields_equals_fancy_indexing_bit_for_bit(source_rows: int, data: st.DataObject) -> None:
    # Narrow fields (<= 8 bytes a row) take the sorted compiled path, wider ones index_select; every byte
    # (NaN payloads included) must come out as value[index] would have it.
    count = data.draw(st.integers(0, source_rows))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    index = torch.randperm(source_rows, generator=generator)[:count]
    shapes = data.draw(st.lists(st.sampled_from([(), (1,), (2,), (3,), (12,), (2, 3)]), min_size=1, max_size=5))
    sources, outs = {}, {}
    for i, shape in enumerate(shapes):
        dtype = data.draw(st.sampled_from(FIELD_DTYPES))
        raw = torch.randint(
            0, 256, (source_rows, *shape, torch.empty(0, dtype=dtype).element_size()), generator=generator
        )
        if dtype == torch.bool:
            raw = raw % 2  # only 0 and 1 are valid bools (torch's own copy would normalise other bytes)
        sources[f"f{i}"] = raw.to(torch.uint8).view(dtype).reshape(source_rows, *shape)
        outs[f"f{i}"] = torch.empty(count, *shape, dtype=dtype)
    result = gather_fields(sources, index, outs)
    for name, value in sources.items():
        expected = value[index]
        assert result[name] is outs[name]
        assert torch.equal(outs[name].view(torch.uint8), expected.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("compiled", [True, False])
def test_gather_fields_uses_the_compiled_kernels_or_falls_back(monkeypatch, compiled: bool) -> None:
    from rolloutcli.core import native

    if compiled and native.library() is None:
        pytest.skip("the C file was not compiled in this install")
    if not compiled:
        monkeypatch.setattr(native, "library", lambda: None)
    calls: list[str] = []
    for kernel in ("gather_rows", "gather_sorted"):
        real = getattr(native, kernel)
        monkeypatch.setattr(native, kernel, lambda *a, _real=real, _name=kernel: calls.append(_name) or _real(*a))
    index = torch.randperm(500)[:200]
    sources = {"obs": torch.randn(500, 48), "r": torch.randn(500), "d": torch.randint(0, 2, (500,), dtype=torch.uint8)}
    outs = {name: torch.empty(200, *value.shape[1:], dtype=value.dtype) for name, value in sources.items()}
    gather_fields(sources, index, outs)
    for name, value in sources.items():
        assert torch.equal(outs[name], value[index]), name
    assert sorted(calls) == ["gather_rows", "gather_sorted", "gather_sorted"]  # tried either way


def test_gather_fields_refuses_rows_out_of_range() -> None:
    sources = {"obs": torch.randn(10, 4), "r": torch.randn(10)}
    outs = {name: torch.empty(3, *value.shape[1:]) for name, value in sources.items()}
    for bad in ([0, 10, 2], [-1, 0, 1]):
        with pytest.raises(IndexError):
            gather_fields(sources, torch.tensor(bad), outs)


def test_gather_fields_into_reused_buffer_views() -> None:
    # The export gathers into the first B rows of a larger reused buffer.
    index = torch.randperm(1000)[:257]
    sources = {"r": torch.randn(1000), "d": torch.randint(0, 2, (1000,), dtype=torch.uint8), "o": torch.randn(1000, 48)}
    buffers = {name: torch.full((300, *v.shape[1:]), 7, dtype=v.dtype) for name, v in sources.items()}
    gather_fields(sources, index, {name: b[:257] for name, b in buffers.items()})
    for name, value in sources.items():
        assert torch.equal(buffers[name][:257], value[index])
        assert (buffers[name][257:] == 7).all()  # nothing written past the shard


# ------------------------------------------------------------------------------------------------------------
# RolloutStorage generators vs RSL-RL
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_mini_batches", [4, 7])
def test_mini_batch_generator_parity(tmp_path, num_mini_batches: int) -> None:
    arrays = full_arrays(12, 5)
    theirs, ours = rsl_storage(arrays), ours_from(arrays, tmp_path=tmp_path)
    torch.manual_seed(3)
    expected = list(theirs.mini_batch_generator(num_mini_batches, 3))
    torch.manual_seed(3)
    assert_batches(list(ours.mini_batch_generator(num_mini_batches, 3)), expected)
    seeded = ours.mini_batch_generator(num_mini_batches, 3, generator=torch.Generator().manual_seed(3))
    assert_batches(list(seeded), expected)


def test_mini_batch_generator_default_uses_every_row_each_epoch(tmp_path) -> None:
    ours = ours_from(full_arrays(12, 5), tmp_path=tmp_path)
    batches = list(ours.mini_batch_generator(7, 2, parity=False, generator=torch.Generator().manual_seed(0)))
    flat = ours.observations["policy"].flatten(0, 1)
    for epoch in range(2):
        rows = torch.cat([b.observations["policy"] for b in batches[epoch * 7 : (epoch + 1) * 7]])
        assert rows.shape[0] == 60
        assert sorted(rows[:, 0].tolist()) == sorted(flat[:, 0].tolist())
    assert not torch.equal(batches[0].observations["policy"], batches[7].observations["policy"])


@pytest.mark.parametrize("hidden", ["gru", "lstm", None])
@pytest.mark.parametrize("num_mini_batches", [2, 3])
def test_recurrent_mini_batch_generator_parity(tmp_path, hidden: str | None, num_mini_batches: int) -> None:
    arrays = full_arrays(12, 5, hidden=hidden)
    theirs, ours = rsl_storage(arrays), ours_from(arrays, tmp_path=tmp_path)
    expected = list(theirs.recurrent_mini_batch_generator(num_mini_batches, 2))
    assert_batches(list(ours.recurrent_mini_batch_generator(num_mini_batches, 2)), expected)


def test_recurrent_generator_default_and_shuffled_keep_every_env(tmp_path) -> None:
    ours = ours_from(full_arrays(12, 5, hidden="lstm"), tmp_path=tmp_path)
    default = list(ours.recurrent_mini_batch_generator(2, 1, parity=False))
    assert [b.actions.shape[1] for b in default] == [3, 2]
    shuffled = list(
        ours.recurrent_mini_batch_generator(
            2, 3, parity=False, shuffle_envs=True, generator=torch.Generator().manual_seed(1)
        )
    )
    for epoch in range(3):
        masks = [b.masks for b in shuffled[epoch * 2 : epoch * 2 + 2]]
        assert sum(int(m.sum()) for m in masks) == 12 * 5  # every step of every env once per epoch


def test_distillation_generator_parity(tmp_path) -> None:
    arrays = full_arrays(12, 5)
    theirs, ours = rsl_storage(arrays, "distillation"), ours_from(arrays, "distillation", tmp_path)
    assert_batches(list(ours.generator()), list(theirs.generator()))
    with pytest.raises(ValueError):
        next(ours.mini_batch_generator(2))
