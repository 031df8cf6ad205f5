"""rolloutcli.core.trajectories against RSL-RL 5.5.1 (the reference), hand-drawn cases and round-trip properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rsl_rl.storage import RolloutStorage
from rsl_rl.utils import split_and_pad_trajectories as rsl_split
from rsl_rl.utils import unpad_trajectories as rsl_unpad
from tensordict import TensorDict

from rolloutcli.core.trajectories import (
    TrajectorySpans,
    clear_trajectories,
    hidden_states_at_starts,
    plan_trajectories,
    scatter_into_trajectories,
    split_and_pad_trajectories,
    trajectory_buffer_view,
    trajectory_spans,
    unpad_trajectories,
    unpad_with_spans,
)

# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, same shape, same bytes (so NaN payloads, -0.0 and padding zeros all count)."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    a = actual.contiguous().view(torch.uint8) if actual.numel() else actual
    b = expected.contiguous().view(torch.uint8) if expected.numel() else expected
    assert torch.equal(a, b)


def random_field(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (floats include NaNs with payloads, infinities, -0.0, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    count = 1
    for size in shape:
        count *= size
    raw = torch.randint(0, 256, (count * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def random_dones(num_steps: int, num_envs: int, rate: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(num_steps, num_envs, generator=g) < rate


def reference_spans(dones: torch.Tensor, max_length: int | None = None) -> list[tuple[int, int, int]]:
    """Plain-Python (env, start, length) list: the definition, step by step."""
    done = dones.reshape(dones.shape[0], dones.shape[1]) != 0
    num_steps, num_envs = done.shape
    spans = []
    for env in range(num_envs):
        start = 0
        for t in range(num_steps):
            cut = bool(done[t, env]) or t == num_steps - 1 or (max_length is not None and t - start + 1 == max_length)
            if cut:
                spans.append((env, start, t - start + 1))
                start = t + 1
    return spans


def spans_as_list(spans: TrajectorySpans) -> list[tuple[int, int, int]]:
    return list(zip(spans.env.tolist(), spans.start.tolist(), spans.length.tolist(), strict=True))


# --------------------------------------------------------------------------------------------------------------
# Bit-exact parity with RSL-RL
# --------------------------------------------------------------------------------------------------------------

DONE_PATTERNS = ["random", "all", "none", "first", "last", "first_and_last"]


def make_dones(pattern: str, num_steps: int, num_envs: int, seed: int) -> torch.Tensor:
    if pattern == "random":
        return random_dones(num_steps, num_envs, 0.3, seed)
    dones = torch.zeros(num_steps, num_envs, dtype=torch.bool)
    if pattern == "all":
        dones[:] = True
    if pattern in ("first", "first_and_last"):
        dones[0] = True
    if pattern in ("last", "first_and_last"):
        dones[-1] = True
    return dones


@pytest.mark.parametrize("pattern", DONE_PATTERNS)
@pytest.mark.parametrize(("num_steps", "num_envs"), [(9, 5), (1, 4), (6, 1), (1, 1), (24, 33)])
def test_tensor_matches_rsl_rl_bit_for_bit(pattern: str, num_steps: int, num_envs: int) -> None:
    dones = make_dones(pattern, num_steps, num_envs, seed=num_steps * 100 + num_envs)
    x = random_field((num_steps, num_envs, 7), torch.float32, seed=1)
    padded, masks = split_and_pad_trajectories(x, dones)
    expected, expected_masks = rsl_split(x, dones)
    assert_bits_equal(padded, expected)
    assert_bits_equal(masks, expected_masks)
    assert_bits_equal(unpad_trajectories(padded, masks), rsl_unpad(expected, expected_masks))
    assert_bits_equal(unpad_trajectories(padded, masks), x)


@pytest.mark.parametrize("done_dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("trailing_one", [False, True])
def test_dones_dtypes_and_trailing_one(done_dtype: torch.dtype, trailing_one: bool) -> None:
    dones = random_dones(11, 6, 0.25, seed=3).to(done_dtype)
    if trailing_one:
        dones = dones.unsqueeze(-1)
    x = random_field((11, 6, 4), torch.float32, seed=2)
    before = dones.clone()
    padded, masks = split_and_pad_trajectories(x, dones)
    expected, expected_masks = rsl_split(x, dones)
    assert_bits_equal(padded, expected)
    assert_bits_equal(masks, expected_masks)
    assert_bits_equal(dones, before)  # the caller's dones are never modified


def test_dones_other_than_one_count_as_done() -> None:
    # RSL-RL finds ends with nonzero(); a 2 or a -1 is a done there, and so here.
    dones = torch.tensor([[0, 2, 0], [-1, 0, 0], [0, 0, 3], [0, 0, 0]], dtype=torch.int64)
    x = random_field((4, 3, 2), torch.float32, seed=4)
    padded, masks = split_and_pad_trajectories(x, dones)
    expected, expected_masks = rsl_split(x, dones)
    assert_bits_equal(padded, expected)
    assert_bits_equal(masks, expected_masks)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]
)
@pytest.mark.parametrize("feature_shape", [(), (1,), (3,), (2, 5)])
def test_field_dtypes_and_shapes(dtype: torch.dtype, feature_shape: tuple[int, ...]) -> None:
    dones = random_dones(10, 4, 0.3, seed=5)
    x = random_field((10, 4, *feature_shape), dtype, seed=6)
    padded, masks = split_and_pad_trajectories(x, dones)
    expected, expected_masks = rsl_split(x, dones)
    assert_bits_equal(padded, expected)
    assert_bits_equal(masks, expected_masks)
    assert_bits_equal(unpad_trajectories(padded, masks), x)


def test_bool_field() -> None:
    dones = random_dones(10, 4, 0.3, seed=7)
    x = random_field((10, 4, 3), torch.bool, seed=8)
    padded, _ = split_and_pad_trajectories(x, dones)
    expected, _ = rsl_split(x, dones)
    assert_bits_equal(padded, expected)


def test_non_contiguous_and_misaligned_fields() -> None:
    # Rows are moved as the widest integer that tiles them: strided or 4-byte-offset sources take narrower ones.
    dones = random_dones(40, 50, 0.3, seed=9)
    wide = random_field((40, 50, 10), torch.float32, seed=10)
    flat = random_field((40 * 50 * 8 + 1,), torch.float32, seed=11)
    misaligned = flat[1:].view(40, 50, 8)
    transposed = wide.transpose(0, 1).contiguous().transpose(0, 1)
    for x in (wide[:, :, 1:9], wide[:, :, ::2], transposed, misaligned):
        padded, _ = split_and_pad_trajectories(x, dones)
        expected, _ = rsl_split(x, dones)
        assert_bits_equal(padded, expected)


def test_dict_input_returns_dict() -> None:
    dones = random_dones(12, 5, 0.2, seed=11)
    fields = {
        "policy": random_field((12, 5, 6), torch.float32, seed=12),
        "critic": random_field((12, 5, 2), torch.float16, seed=13),
    }
    padded, masks = split_and_pad_trajectories(fields, dones)
    assert isinstance(padded, dict)
    assert set(padded) == {"policy", "critic"}
    for key, value in fields.items():
        expected, expected_masks = rsl_split(value, dones)
        assert_bits_equal(padded[key], expected)
        assert_bits_equal(masks, expected_masks)
    restored = unpad_trajectories(padded, masks)
    assert isinstance(restored, dict)
    for key, value in fields.items():
        assert_bits_equal(restored[key], value)


def test_tensordict_input_returns_tensordict() -> None:
    dones = random_dones(12, 5, 0.2, seed=14).unsqueeze(-1).to(torch.uint8)
    td = TensorDict(
        {
            "policy": random_field((12, 5, 6), torch.float32, seed=15),
            "image": random_field((12, 5, 2, 3), torch.uint8, seed=16),
        },
        batch_size=[12, 5],
    )
    padded, masks = split_and_pad_trajectories(td, dones)
    expected, expected_masks = rsl_split(td, dones)
    assert isinstance(padded, TensorDict)
    assert padded.batch_size == expected.batch_size
    for key in ("policy", "image"):
        assert_bits_equal(padded[key], expected[key])
    assert_bits_equal(masks, expected_masks)
    restored = unpad_trajectories(padded, masks)
    rsl_restored = rsl_unpad(expected, expected_masks)
    assert isinstance(restored, TensorDict)
    assert restored.batch_size == td.batch_size == rsl_restored.batch_size
    for key in ("policy", "image"):
        assert_bits_equal(restored[key], td[key])
        assert_bits_equal(restored[key], rsl_restored[key])


def test_nested_tensordict() -> None:
    dones = random_dones(7, 3, 0.3, seed=17)
    inner = TensorDict({"a": random_field((7, 3, 2), torch.float32, seed=18)}, batch_size=[7, 3])
    td = TensorDict({"outer": random_field((7, 3), torch.int64, seed=19), "group": inner}, batch_size=[7, 3])
    padded, masks = split_and_pad_trajectories(td, dones)
    assert_bits_equal(padded["group", "a"], rsl_split(inner["a"], dones)[0])
    assert_bits_equal(padded["outer"], rsl_split(td["outer"], dones)[0])
    restored = unpad_trajectories(padded, masks)
    assert_bits_equal(restored["group", "a"], inner["a"])


# --------------------------------------------------------------------------------------------------------------
# RSL-RL's docstring picture, drawn by hand
# --------------------------------------------------------------------------------------------------------------


def test_docstring_picture() -> None:
    # Input (transposed): [[a1, a2, a3, a4 | a5, a6],
    #                      [b1, b2 | b3, b4, b5 | b6]]
    a = [11.0, 12.0, 13.0, 14.0, 15.0, 16.0]
    b = [21.0, 22.0, 23.0, 24.0, 25.0, 26.0]
    x = torch.tensor([a, b]).t().unsqueeze(-1)  # [T=6, N=2, 1]
    dones = torch.zeros(6, 2, dtype=torch.bool)
    dones[3, 0] = True  # after a4
    dones[1, 1] = True  # after b2
    dones[4, 1] = True  # after b5
    columns = [[11, 12, 13, 14], [15, 16], [21, 22], [23, 24, 25], [26]]
    expected = torch.zeros(6, 5, 1)
    expected_masks = torch.zeros(6, 5, dtype=torch.bool)
    for m, column in enumerate(columns):
        expected[: len(column), m, 0] = torch.tensor(column, dtype=torch.float32)
        expected_masks[: len(column), m] = True

    padded, masks = split_and_pad_trajectories(x, dones)  # RSL-RL pads to T = 6 rows
    assert_bits_equal(padded, expected)
    assert_bits_equal(masks, expected_masks)
    assert_bits_equal(rsl_split(x, dones)[0], expected)

    longest, longest_masks = split_and_pad_trajectories(x, dones, pad_to="longest")  # the docstring's 4 rows
    assert_bits_equal(longest, expected[:4])
    assert_bits_equal(longest_masks, expected_masks[:4])

    assert spans_as_list(trajectory_spans(dones)) == [(0, 0, 4), (0, 4, 2), (1, 0, 2), (1, 2, 3), (1, 5, 1)]
    # max_length=2 cuts a1..a4 into a1 a2 | a3 a4 and b3 b4 b5 into b3 b4 | b5.
    assert spans_as_list(trajectory_spans(dones, max_length=2)) == [
        (0, 0, 2),
        (0, 2, 2),
        (0, 4, 2),
        (1, 0, 2),
        (1, 2, 2),
        (1, 4, 1),
        (1, 5, 1),
    ]
    cut, cut_masks = split_and_pad_trajectories(x, dones, max_length=2, pad_to="longest")
    assert cut[:, :, 0].t().tolist() == [[11, 12], [13, 14], [15, 16], [21, 22], [23, 24], [25, 0], [26, 0]]
    assert cut_masks.sum(0).tolist() == [2, 2, 2, 2, 2, 1, 1]


# --------------------------------------------------------------------------------------------------------------
# Spans and identifiable data
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_length", [None, 1, 2, 3, 5, 40])
@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 1.0])
def test_spans_match_plain_python_definition(max_length: int | None, rate: float) -> None:
    dones = random_dones(17, 6, rate, seed=int(rate * 10) + 20)
    assert spans_as_list(trajectory_spans(dones, max_length)) == reference_spans(dones, max_length)
    spans = trajectory_spans(dones, max_length)
    assert spans.env.dtype == spans.start.dtype == spans.length.dtype == torch.int64


@pytest.mark.parametrize(("pad_to", "max_length"), [("rollout", None), ("longest", None), ("longest", 4), (30, 7)])
def test_identifiable_steps_never_cross_envs(pad_to: str | int, max_length: int | None) -> None:
    num_steps, num_envs = 29, 13
    dones = random_dones(num_steps, num_envs, 0.15, seed=30)
    t = torch.arange(num_steps).unsqueeze(1)
    n = torch.arange(num_envs).unsqueeze(0)
    x = (t * 1000 + n).to(torch.int64)  # value = t * 1000 + env
    padded, masks = split_and_pad_trajectories(x, dones, pad_to=pad_to, max_length=max_length)
    spans = trajectory_spans(dones, max_length)
    assert masks.shape == padded.shape == (masks.shape[0], spans.length.numel())
    assert torch.equal(masks.sum(0), spans.length)
    assert bool((padded[~masks] == 0).all())  # padding is zero
    per_env = torch.zeros(num_envs, dtype=torch.int64)
    for m, (env, start, length) in enumerate(spans_as_list(spans)):
        column = padded[:length, m]
        assert column.tolist() == [(start + i) * 1000 + env for i in range(length)]  # one env, consecutive steps
        # No done inside a trajectory: only its last step may end an episode.
        assert not bool(dones[start : start + length - 1, env].any())
        if max_length is not None:
            assert length <= max_length
        per_env[env] += int(masks[:, m].sum())
    assert per_env.tolist() == [num_steps] * num_envs  # masks sum to T per env


# --------------------------------------------------------------------------------------------------------------
# Hidden states at trajectory starts: RSL-RL's real recurrent generator
# --------------------------------------------------------------------------------------------------------------


def fill_rsl_storage(num_steps: int, num_envs: int, seed: int) -> tuple[RolloutStorage, dict[str, torch.Tensor]]:
    """A real RSL-RL RolloutStorage with GRU actor state and LSTM critic state, filled via add_transition."""
    g = torch.Generator().manual_seed(seed)
    layers, hidden = 2, 3
    obs0 = TensorDict({"policy": torch.zeros(num_envs, 4)}, batch_size=[num_envs])
    storage = RolloutStorage("rl", num_envs, num_steps, obs0, [2])
    record: dict[str, list[torch.Tensor]] = {"dones": [], "gru": [], "h": [], "c": [], "obs": []}
    for _ in range(num_steps):
        tr = RolloutStorage.Transition()
        obs = torch.randn(num_envs, 4, generator=g)
        tr.observations = TensorDict({"policy": obs}, batch_size=[num_envs])
        tr.actions = torch.randn(num_envs, 2, generator=g)
        tr.rewards = torch.randn(num_envs, generator=g)
        tr.dones = (torch.rand(num_envs, generator=g) < 0.2).to(torch.uint8)
        tr.values = torch.randn(num_envs, 1, generator=g)
        tr.actions_log_prob = torch.randn(num_envs, generator=g)
        tr.distribution_params = (torch.randn(num_envs, 2, generator=g), torch.rand(num_envs, 2, generator=g))
        gru = torch.randn(layers, num_envs, hidden, generator=g)
        h = torch.randn(layers, num_envs, hidden, generator=g)
        c = torch.randn(layers, num_envs, hidden, generator=g)
        tr.hidden_states = (gru, (h, c))
        storage.add_transition(tr)
        for key, value in (("dones", tr.dones), ("gru", gru), ("h", h), ("c", c), ("obs", obs)):
            record[key].append(value)
    return storage, {key: torch.stack(values) for key, values in record.items()}


@pytest.mark.parametrize("num_mini_batches", [1, 3])
def test_hidden_states_match_rsl_rl_recurrent_generator(num_mini_batches: int) -> None:
    num_steps, num_envs = 16, 6
    storage, rec = fill_rsl_storage(num_steps, num_envs, seed=40)
    batches = list(storage.recurrent_mini_batch_generator(num_mini_batches, num_epochs=1))
    assert len(batches) == num_mini_batches
    gru_expected = torch.cat([b.hidden_states[0] for b in batches], dim=1)
    h_expected = torch.cat([b.hidden_states[1][0] for b in batches], dim=1)
    c_expected = torch.cat([b.hidden_states[1][1] for b in batches], dim=1)
    masks_expected = torch.cat([b.masks for b in batches], dim=1)
    obs_expected = torch.cat([b.observations["policy"] for b in batches], dim=1)

    spans = trajectory_spans(rec["dones"])  # [T, N] uint8, as recorded
    # hidden_states/actor/0 is stored [T, layers, N, H] (the rollout format), as RSL-RL's saved_hidden_state_a.
    assert_bits_equal(hidden_states_at_starts(rec["gru"], spans), gru_expected)
    h, c = hidden_states_at_starts((rec["h"], rec["c"]), spans)
    assert_bits_equal(h, h_expected)
    assert_bits_equal(c, c_expected)
    assert h.is_contiguous()

    padded, masks = split_and_pad_trajectories(rec["obs"], storage.dones)
    assert_bits_equal(masks, masks_expected)
    assert_bits_equal(padded, obs_expected)


def test_hidden_states_for_segments_are_each_segments_first_step() -> None:
    num_steps, num_envs = 12, 4
    _, rec = fill_rsl_storage(num_steps, num_envs, seed=41)
    spans = trajectory_spans(rec["dones"], max_length=3)
    states = hidden_states_at_starts(rec["gru"], spans)
    assert states.shape == (2, spans.length.numel(), 3)
    for m, (env, start, _) in enumerate(spans_as_list(spans)):
        assert_bits_equal(states[:, m], rec["gru"][start, :, env])


# --------------------------------------------------------------------------------------------------------------
# Plans, reusable buffers, gathers
# --------------------------------------------------------------------------------------------------------------


def test_plan_reused_for_many_fields_and_buffers() -> None:
    dones_a = random_dones(20, 8, 0.3, seed=50)
    dones_b = random_dones(20, 8, 0.05, seed=51)
    plan_a = plan_trajectories(dones_a, pad_to="longest")
    plan_b = plan_trajectories(dones_b, pad_to="longest")
    buffer = torch.full((plan_a.padded_length * plan_a.num_trajectories * 5 + plan_b.padded_length * 64 * 5,), 7.0)
    for plan, dones in ((plan_a, dones_a), (plan_b, dones_b)):
        x = random_field((20, 8, 5), torch.float32, seed=52)
        expected, expected_masks = split_and_pad_trajectories(x, dones, pad_to="longest")
        # zero=True wipes whatever the buffer held before (here 7.0 or the previous block).
        out = trajectory_buffer_view(buffer, plan, (5,))
        assert_bits_equal(scatter_into_trajectories(x, plan, out), expected)
        assert_bits_equal(plan.masks(), expected_masks)
        assert_bits_equal(unpad_with_spans(out, plan.spans, 20, 8), x)
        clear_trajectories(out, plan)
        assert not bool(out.any())
        # After clear, zero=False is enough.
        assert_bits_equal(scatter_into_trajectories(x, plan, out, zero=False), expected)
        clear_trajectories(out, plan)


def test_spans_unpad() -> None:
    dones = random_dones(15, 7, 0.2, seed=53)
    x = random_field((15, 7, 3), torch.float16, seed=54)
    plan = plan_trajectories(dones, max_length=4, pad_to=4)
    padded = scatter_into_trajectories(x, plan)
    assert_bits_equal(unpad_with_spans(padded, plan.spans, 15, 7), x)
    assert_bits_equal(unpad_trajectories(padded, plan.masks(), num_steps=15), x)


def test_errors() -> None:
    dones = random_dones(6, 3, 0.3, seed=55)
    x = torch.zeros(6, 3, 2)
    with pytest.raises(ValueError, match="dones must be"):
        split_and_pad_trajectories(x, dones.unsqueeze(0))
    with pytest.raises(ValueError, match="T = 0"):
        trajectory_spans(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="does not start with"):
        split_and_pad_trajectories(torch.zeros(6, 4, 2), dones)
    with pytest.raises(ValueError, match="max_length"):
        trajectory_spans(dones, max_length=0)
    with pytest.raises(ValueError, match="pad_to"):
        plan_trajectories(torch.zeros(6, 3), pad_to=5)  # one 6-step trajectory per env
    with pytest.raises(ValueError, match="pad_to"):
        plan_trajectories(dones, pad_to="shortest")  # type: ignore[arg-type]
    plan = plan_trajectories(dones)
    with pytest.raises(ValueError, match="does not start with"):
        scatter_into_trajectories(x[:, :2], plan)
    with pytest.raises(ValueError, match="out must be"):
        scatter_into_trajectories(x, plan, torch.zeros(6, plan.num_trajectories, 3))
    with pytest.raises(ValueError, match="spans cover"):
        unpad_with_spans(torch.zeros(6, plan.num_trajectories), plan.spans, 6, 4)
    with pytest.raises(TypeError):
        split_and_pad_trajectories([x], dones)  # type: ignore[arg-type]


def test_lazy_exports() -> None:
    import rolloutcli

    assert rolloutcli.split_and_pad_trajectories is split_and_pad_trajectories
    assert rolloutcli.unpad_trajectories is unpad_trajectories
    assert rolloutcli.trajectory_spans is trajectory_spans


# --------------------------------------------------------------------------------------------------------------
# Autograd: RSL-RL users split and unpad inside a loss
# --------------------------------------------------------------------------------------------------------------


def grads(fn, *inputs: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Gradients of ``sum(fn(*leaves) * w)`` for a fixed random ``w``, with respect to fresh leaf copies."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * weight).sum().backward()
    return [leaf.grad for leaf in leaves]


def pad_by_indexing(x: torch.Tensor, dones: torch.Tensor, rows: int, max_length: int | None) -> torch.Tensor:
    """The padded layout built from plain differentiable indexing, span by span (an independent reference)."""
    columns = []
    for env, start, length in reference_spans(dones, max_length):
        column = x[start : start + length, env]
        columns.append(torch.cat([column, column.new_zeros(rows - length, *x.shape[2:])]))
    return torch.stack(columns, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_split_and_unpad_gradients_equal_rsl_rl(dtype: torch.dtype) -> None:
    dones = random_dones(24, 9, 0.2, seed=70)
    x = torch.randn(24, 9, 5, generator=torch.Generator().manual_seed(71), dtype=dtype)
    _, masks = rsl_split(x, dones)
    assert_bits_equal(
        grads(lambda t: split_and_pad_trajectories(t, dones)[0], x, seed=72)[0],
        grads(lambda t: rsl_split(t, dones)[0], x, seed=72)[0],
    )
    padded = rsl_split(x, dones)[0]
    assert_bits_equal(
        grads(lambda t: unpad_trajectories(t, masks), padded, seed=73)[0],
        grads(lambda t: rsl_unpad(t, masks), padded, seed=73)[0],
    )
    # The recurrent policy's pattern: split, a layer on the padded batch, unpad, loss. (Elementwise, so that
    # both sides round alike: a matmul's rounding depends on its input's strides, and RSL-RL's output is a view.)
    assert_bits_equal(
        grads(lambda t: unpad_trajectories(split_and_pad_trajectories(t, dones)[0].tanh() * 3, masks), x, seed=75)[0],
        grads(lambda t: rsl_unpad(rsl_split(t, dones)[0].tanh() * 3, masks), x, seed=75)[0],
    )


def test_gradients_through_dicts_and_tensordicts() -> None:
    dones = random_dones(10, 4, 0.3, seed=76)
    x = torch.randn(10, 4, 3, generator=torch.Generator().manual_seed(77))
    masks = rsl_split(x, dones)[1]
    expected = grads(lambda t: rsl_unpad(rsl_split(t, dones)[0] * 2, masks), x, seed=78)[0]
    for wrap in (lambda t: {"policy": t}, lambda t: TensorDict({"policy": t}, batch_size=t.shape[:2])):

        def chain(t: torch.Tensor, wrap=wrap) -> torch.Tensor:
            padded, masks = split_and_pad_trajectories(wrap(t), dones)
            return unpad_trajectories(wrap(padded["policy"] * 2), masks)["policy"]

        assert_bits_equal(grads(chain, x, seed=78)[0], expected)


@pytest.mark.parametrize(("pad_to", "max_length"), [("longest", None), ("longest", 3), (30, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradients_of_every_layout_equal_plain_indexing(
    pad_to: str | int, max_length: int | None, dtype: torch.dtype
) -> None:
    dones = random_dones(21, 6, 0.2, seed=79)
    x = torch.randn(21, 6, 4, generator=torch.Generator().manual_seed(80)).to(dtype)
    padded, masks = split_and_pad_trajectories(x, dones, pad_to=pad_to, max_length=max_length)
    rows = padded.shape[0]
    expected = grads(lambda t: pad_by_indexing(t, dones, rows, max_length), x, seed=81)[0]
    plan = plan_trajectories(dones, pad_to=pad_to, max_length=max_length)
    for pad in (
        lambda t: split_and_pad_trajectories(t, dones, pad_to=pad_to, max_length=max_length)[0],
        lambda t: scatter_into_trajectories(t, plan),
    ):
        assert_bits_equal(grads(pad, x, seed=81)[0], expected)
    # unpad is pad's inverse, so its gradient is the weight laid out like the padded batch
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(82), dtype=dtype)
    spans = trajectory_spans(dones, max_length)
    for unpad in (lambda t: unpad_trajectories(t, masks, num_steps=21), lambda t: unpad_with_spans(t, spans, 21, 6)):
        assert_bits_equal(grads(unpad, padded, seed=82)[0], pad_by_indexing(weight, dones, rows, max_length))


def test_hidden_state_gradients_equal_plain_indexing() -> None:
    dones = random_dones(12, 5, 0.25, seed=83)
    hidden = torch.randn(12, 2, 5, 3, generator=torch.Generator().manual_seed(84))
    spans = spans_as_list(trajectory_spans(dones))

    def by_indexing(h: torch.Tensor) -> torch.Tensor:
        return torch.stack([h[start, :, env] for env, start, _ in spans], dim=1)

    assert_bits_equal(
        grads(lambda h: hidden_states_at_starts(h, trajectory_spans(dones)), hidden, seed=85)[0],
        grads(by_indexing, hidden, seed=85)[0],
    )


# --------------------------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
FEATURES = [(), (1,), (3,), (2, 3)]


@st.composite
def rollouts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    num_steps = draw(st.integers(1, 12))
    num_envs = draw(st.integers(1, 6))
    flags = draw(st.lists(st.booleans(), min_size=num_steps * num_envs, max_size=num_steps * num_envs))
    dones = torch.tensor(flags, dtype=torch.bool).view(num_steps, num_envs)
    dones = dones.to(draw(st.sampled_from([torch.bool, torch.uint8, torch.int64, torch.float32])))
    if draw(st.booleans()):
        dones = dones.unsqueeze(-1)
    dtype = draw(st.sampled_from(DTYPES))
    x = random_field((num_steps, num_envs, *draw(st.sampled_from(FEATURES))), dtype, seed=draw(st.integers(0, 999)))
    return x, dones


FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(rollouts())
def test_property_rollout_layout_equals_rsl_rl(case: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, dones = case
    padded, masks = split_and_pad_trajectories(x, dones)
    expected, expected_masks = rsl_split(x, dones)
    assert_bits_equal(padded, expected)
    assert_bits_equal(masks, expected_masks)
    assert_bits_equal(unpad_trajectories(padded, masks), x)


@FAST
@given(rollouts(), st.sampled_from(["rollout", "longest", "int"]), st.one_of(st.none(), st.integers(1, 13)))
def test_property_unpad_split_round_trips(
    case: tuple[torch.Tensor, torch.Tensor], pad_to: str, max_length: int | None
) -> None:
    x, dones = case
    num_steps, num_envs = x.shape[:2]
    layout: str | int = num_steps + 2 if pad_to == "int" else pad_to
    padded, masks = split_and_pad_trajectories(x, dones, pad_to=layout, max_length=max_length)
    spans = trajectory_spans(dones, max_length)
    assert spans_as_list(spans) == reference_spans(dones, max_length)
    assert masks.shape == padded.shape[:2] == (masks.shape[0], len(spans.env))
    assert torch.equal(masks.sum(0), spans.length)
    assert_bits_equal(padded[~masks], torch.zeros_like(padded[~masks]))
    assert_bits_equal(unpad_trajectories(padded, masks, num_steps=num_steps), x)
    assert_bits_equal(unpad_with_spans(padded, spans, num_steps, num_envs), x)
    plan = plan_trajectories(dones, pad_to=layout, max_length=max_length)
    assert_bits_equal(scatter_into_trajectories(x, plan), padded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_follows_the_device_and_matches_cpu() -> None:
    dones = random_dones(24, 300, 0.2, seed=60)
    x = random_field((24, 300, 48), torch.float32, seed=61)
    hidden = random_field((24, 2, 300, 8), torch.float32, seed=62)
    padded, masks = split_and_pad_trajectories(x.cuda(), dones.cuda())
    assert padded.is_cuda and masks.is_cuda
    expected, expected_masks = rsl_split(x, dones)
    assert_bits_equal(padded.cpu(), expected)
    assert_bits_equal(masks.cpu(), expected_masks)
    assert_bits_equal(unpad_trajectories(padded, masks).cpu(), x)
    spans = trajectory_spans(dones.cuda(), max_length=5)
    assert spans.env.is_cuda
    assert_bits_equal(
        hidden_states_at_starts(hidden.cuda(), spans).cpu(), hidden_states_at_starts(hidden, trajectory_spans(dones, 5))
    )


def test_large_fresh_output_is_zero_padded_and_outlives_its_call() -> None:
    """Outputs over 4 MiB come from an anonymous huge-page mapping: zeros where masked, alive after gc."""
    import gc

    from rsl_rl.utils import split_and_pad_trajectories as rsl_split

    from rolloutcli.core.trajectories import split_and_pad_trajectories as ours

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(24, 2048, 48, generator=generator)
    dones = (torch.rand(24, 2048, 1, generator=generator) < 0.2).to(torch.uint8)
    padded, masks = ours(x, dones)
    assert padded.numel() * 4 > 4 << 20
    gc.collect()
    expected, expected_masks = rsl_split(x, dones)
    assert torch.equal(padded, expected) and torch.equal(masks, expected_masks)
    assert padded[~masks].abs().sum() == 0


def test_large_output_with_gradient_backpropagates_through_one_index_copy() -> None:
    """A large output that needs a gradient is a tensor of its own: no as_strided backward (slow) through a view."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(24, 2048, 48, generator=generator).requires_grad_(True)
    dones = torch.rand(24, 2048, generator=generator) < 0.2
    padded, masks = split_and_pad_trajectories(x, dones)
    assert padded.numel() * 4 > 4 << 20
    assert "AsStrided" not in type(padded.grad_fn).__name__
    weight = torch.randn(padded.shape, generator=generator)
    (padded * weight).sum().backward()
    assert_bits_equal(x.grad, unpad_trajectories(weight, masks))
