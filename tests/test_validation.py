"""Every validation rule of the format contract: exact message, exit code, all problems at once."""

from __future__ import annotations

from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli import RolloutError, RolloutStorage


def _mutate(**changes: object):
    def build(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, value in changes.items():
            name = name.replace("__", "/")
            if value is None:
                arrays.pop(name)
            else:
                arrays[name] = value(arrays) if callable(value) else value
        return arrays

    return build


def _with_nan(arrays: dict[str, np.ndarray]) -> np.ndarray:
    rewards = arrays["rewards"].copy()
    rewards[0, 0] = np.nan
    rewards[3, 1] = np.inf
    return rewards


def _dones_two(arrays: dict[str, np.ndarray]) -> np.ndarray:
    dones = arrays["dones"].astype(np.int32)
    dones[5, 2] = 2
    return dones


def _orphan_timeouts(arrays: dict[str, np.ndarray]) -> np.ndarray:
    time_outs = arrays["time_outs"].copy()
    time_outs[arrays["dones"] == 0] = 0
    time_outs[np.argwhere(arrays["dones"] == 0)[0][0], np.argwhere(arrays["dones"] == 0)[0][1]] = 1
    return time_outs


# case: (change, exact message after "<path>: ")
CASES = {
    "missing rewards": (
        _mutate(rewards=None),
        "field 'rewards': expected a dataset [T, N], found nothing. Record it; see the format contract in the README.",
    ),
    "missing actions": (
        _mutate(actions=None),
        "field 'actions': expected a dataset [T, N, ...], found nothing. Record it; see the format "
        "contract in the README.",
    ),
    "missing observations": (
        _mutate(observations__policy=None, observations__critic=None),
        "field 'observations': expected a group of datasets [T, N, ...] (or one dataset), "
        "found nothing. Record at least one observation group, e.g. observations/policy.",
    ),
    "T disagrees": (
        _mutate(actions=np.zeros((13, 3, 2), np.float32)),
        "field 'actions': expected shape [T, N, ...] with T=12, N=3, found shape (13, 3, 2).",
    ),
    "N disagrees": (
        _mutate(values=np.zeros((12, 4), np.float32)),
        "field 'values': expected shape [T, N] = [12, 3] (or [12, 3, 1]), found shape (12, 4).",
    ),
    "wrong rank": (
        _mutate(dones=np.zeros((12, 3, 2), np.uint8)),
        "field 'dones': expected shape [T, N] = [12, 3] (or [12, 3, 1]), found shape (12, 3, 2).",
    ),
    "non-numeric dtype": (
        _mutate(actions=np.full((12, 3, 2), b"abc")),
        "field 'actions': expected a numeric dtype (bool, integer or float), found dtype |S3. "
        "Store numbers; strings and compound types cannot be trained on.",
    ),
    "NaN rewards": (
        _mutate(rewards=_with_nan),
        "field 'rewards': expected finite numbers, found 2 NaN/Inf values. Fix the recorder or drop the affected envs.",
    ),
    "dones outside 0/1": (
        _mutate(dones=_dones_two),
        "field 'dones': expected only 0 and 1, found 1 other values. Store episode-end flags as bool or 0/1.",
    ),
    "time-out without done": (
        _mutate(time_outs=_orphan_timeouts),
        "field 'time_outs': expected time-outs only where dones is 1, found 1 time-outs "
        "where dones is 0. A time-out ends the episode: set dones there too.",
    ),
    "empty T": (
        lambda a: {k: v[:0] if v.ndim >= 2 else v for k, v in a.items()},
        "field 'rewards': expected at least one step and one env, found T=0, N=3. The recording is empty.",
    ),
    "last_values shape": (
        _mutate(last_values=np.zeros(4, np.float32)),
        "field 'last_values': expected shape [N] = [3] (or [3, 1]), found shape (4,).",
    ),
    "hidden rank": (
        _mutate(hidden_states__actor__0=np.zeros((12, 3, 3), np.float32)),
        "field 'hidden_states/actor/0': expected shape [T, layers, N, hidden] with T=12, N=3, found shape (12, 3, 3).",
    ),
    "lstm h and c differ": (
        _mutate(hidden_states__critic__1=np.zeros((12, 2, 3, 3), np.float32)),
        "field 'hidden_states/critic': expected LSTM h and c of the same shape, found (12, 1, 3, 3) and (12, 2, 3, 3).",
    ),
    "hidden index": (
        _mutate(hidden_states__actor__1=None, hidden_states__actor__2=np.zeros((12, 1, 3, 3))),
        "field 'hidden_states/actor/2': expected hidden_states/actor/<0|1> or "
        "hidden_states/critic/<0|1>, found 'hidden_states/actor/2'.",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_message_and_exit_code(tmp_path: Path, cli, case: str) -> None:
    change, message = CASES[case]
    arrays = change(rollout_arrays(hidden="lstm" if "lstm" in case or "index" in case else "gru"))
    path = write_rollout(tmp_path / "bad.h5", arrays)
    before = path.read_bytes()
    with pytest.raises(RolloutError) as error:
        RolloutStorage.from_hdf5(path)
    assert str(error.value) == f"{path}: {message}"
    assert error.value.exit_code == 1
    # the CLI: structural problems fail inspect; value problems are warnings unless --strict
    code, out, err = cli("inspect", path, "--strict", "--json")
    assert code == 1
    assert message in out + err
    assert path.read_bytes() == before  # the input is never modified


def test_every_problem_reported_at_once(tmp_path: Path) -> None:
    arrays = rollout_arrays()
    arrays["actions"] = np.zeros((13, 3, 2), np.float32)
    arrays["last_values"] = np.zeros(5, np.float32)
    arrays.pop("dones")
    path = write_rollout(tmp_path / "bad.h5", arrays)
    with pytest.raises(RolloutError) as error:
        RolloutStorage.from_hdf5(path)
    assert error.value.problems == [
        f"{path}: field 'dones': expected a dataset [T, N], found nothing. Record it; see the format contract "
        "in the README.",
        f"{path}: field 'actions': expected shape [T, N, ...] with T=12, N=3, found shape (13, 3, 2).",
        f"{path}: field 'last_values': expected shape [N] = [3] (or [3, 1]), found shape (5,).",
    ]
    assert str(error.value) == (  # the file named once, no ".;" between the problems
        f"{path}: 3 problems: field 'dones': expected a dataset [T, N], found nothing. Record it; see the format "
        "contract in the README; field 'actions': expected shape [T, N, ...] with T=12, N=3, found shape "
        "(13, 3, 2); field 'last_values': expected shape [N] = [3] (or [3, 1]), found shape (5,)."
    )


def test_value_problems_are_inspect_warnings(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays()
    arrays["rewards"][2, 2] = np.nan
    path = write_rollout(tmp_path / "nan.h5", arrays)
    code, out, _ = cli("inspect", path, "--json")
    assert code == 0
    assert "field 'rewards': expected finite numbers, found 1 NaN/Inf values" in out


def test_accepted_variants(tmp_path: Path) -> None:
    """[T, N, 1] scalars, bool dones, a single `observations` dataset, float16 rewards, big-endian values."""
    arrays = rollout_arrays(hidden=None)
    arrays["rewards"] = arrays["rewards"][..., None].astype(np.float16)
    arrays["dones"] = arrays["dones"].astype(bool)[..., None]
    arrays["values"] = arrays["values"].astype(">f4")
    arrays["last_values"] = arrays["last_values"][:, None]
    arrays["observations"] = arrays.pop("observations/policy")
    arrays.pop("observations/critic")
    path = write_rollout(tmp_path / "variants.h5", arrays)
    storage = RolloutStorage.from_hdf5(path)
    assert list(storage.observations.keys()) == ["policy"]  # a TensorDict (RSL-RL's type)
    assert storage.rewards.dtype.is_floating_point and storage.rewards.shape == (12, 3, 1)
    assert storage.rewards.dtype == __import__("torch").float32
    assert storage.dones.dtype == __import__("torch").uint8 and set(storage.dones.unique().tolist()) <= {0, 1}
    np.testing.assert_array_equal(storage.values.squeeze(-1).numpy(), arrays["values"].astype(np.float32))
    np.testing.assert_array_equal(storage.last_values.squeeze(-1).numpy(), arrays["last_values"][:, 0])


@st.composite
def generated_rollouts(draw: st.DrawFn) -> dict[str, np.ndarray]:
    T = draw(st.integers(0, 6))
    N = draw(st.integers(0, 4))
    arrays: dict[str, np.ndarray] = {}
    for name in (
        "observations/policy",
        "actions",
        "rewards",
        "dones",
        "time_outs",
        "values",
        "last_values",
        "hidden_states/actor/0",
    ):
        if draw(st.booleans()) and name not in ("rewards",):
            continue  # sometimes missing
        shape_options = [(T, N), (T, N, 1), (T, N, 2), (N,), (T,), (T, 1, N, 2), (T + 1, N)]
        shape = draw(st.sampled_from(shape_options))
        dtype = draw(st.sampled_from([np.float32, np.float16, np.uint8, np.int64, np.bool_, np.float64]))
        elements = None
        if np.dtype(dtype).kind == "f":
            elements = st.floats(width=np.dtype(dtype).itemsize * 8, allow_nan=True, allow_infinity=True)
        arrays[name] = draw(hnp.arrays(dtype, shape, elements=elements))
    return arrays


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrays=generated_rollouts())
def test_loading_succeeds_or_raises_rollout_error(
    tmp_path_factory: pytest.TempPathFactory, arrays: dict[str, np.ndarray]
) -> None:
    path = write_rollout(tmp_path_factory.mktemp("gen") / "gen.h5", arrays)
    try:
        storage = RolloutStorage.from_hdf5(path)
    except RolloutError as error:
        assert error.exit_code in (1, 4)
        assert str(error).startswith(str(path))
    else:
        assert storage.rewards.shape[:2] == arrays["rewards"].shape[:2]


@pytest.mark.parametrize("variant", ["plain", "mixed"])
def test_normalized_predicts_what_array_returns(tmp_path: Path, variant: str) -> None:
    # batch lays out its shards from RolloutReader.normalized (metadata only); it must agree with a real read.
    arrays = rollout_arrays(T=6, N=4, hidden="lstm", layers=2)
    if variant == "mixed":
        arrays["rewards"] = arrays["rewards"].astype(">f8")[..., None]  # big-endian float64 [T, N, 1]
        arrays["values"] = arrays["values"].astype(np.float16)
        arrays["dones"] = arrays["dones"].astype(bool)
        arrays["time_outs"] = arrays["time_outs"].astype(np.int8)[..., None]
        arrays["observations/policy"] = arrays["observations/policy"].astype(">f2")
        arrays["actions_log_prob"] = arrays["actions_log_prob"].astype(np.float64)
        arrays["last_values"] = arrays["last_values"].astype(np.float64)[:, None]
        arrays["advantages"] = np.ones((6, 4), np.float16)
    source = write_rollout(tmp_path / "in.h5", arrays)
    from rolloutcli.hdf5.reader import RolloutReader

    with RolloutReader(source) as reader:
        for name in reader.schema.fields:
            for start, stop in ((0, 1), (1, 4), (0, None)):
                array = reader.array(name, start, stop)
                assert reader.normalized(name, start, stop) == (array.dtype, array.shape), (name, start, stop)


def test_a_new_field_is_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a row to rolloutcli.fields is all the schema and the reader need (shape, dtype, NaN checks)."""
    from rolloutcli import fields
    from rolloutcli.hdf5.reader import RolloutReader

    row = fields.Field("costs", load_dtype="float32", trailing_one=True, finite=True)
    monkeypatch.setattr(fields, "FIELDS", (*fields.FIELDS, row))
    monkeypatch.setattr(fields, "BY_NAME", {**fields.BY_NAME, "costs": row})
    arrays = rollout_arrays(T=6, N=2)
    arrays["costs"] = np.ones((6, 2, 1), np.float16)
    with RolloutReader(write_rollout(tmp_path / "ok.h5", arrays)) as reader:
        assert reader.schema.fields["costs"].role == "costs"
        costs = reader.array("costs")
        assert costs.dtype == np.float32 and costs.shape == (6, 2)
    arrays["costs"][3, 1] = np.nan
    with pytest.raises(RolloutError, match="field 'costs': expected finite numbers, found 1 NaN/Inf values"):
        RolloutReader(write_rollout(tmp_path / "nan.h5", arrays))
    arrays["costs"] = np.ones((6, 3), np.float32)
    with pytest.raises(RolloutError, match=r"field 'costs': expected shape \[T, N\] = \[6, 2\]"):
        RolloutReader(write_rollout(tmp_path / "shape.h5", arrays))
