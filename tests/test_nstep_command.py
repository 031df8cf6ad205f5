"""``rolloutcli nstep`` end to end: the core's numbers per env block, time-out rules, raw rewards, bad input."""

from __future__ import annotations

import hashlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.core.nstep import nstep_returns

OUTPUTS = ("nstep_returns", "nstep_discount", "nstep_next_step")


def _outputs(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as handle:
        return {name: handle[name][()] for name in OUTPUTS} | {"attrs": dict(handle.attrs)}


def _with_finals(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    finals = {
        k.replace("observations/", "final_observations/"): v + 0.25
        for k, v in arrays.items()
        if k.startswith("observations/")
    }
    return arrays | finals


def test_matches_the_core_and_any_budget_gives_the_same_bytes(tmp_path: Path, cli) -> None:
    arrays = _with_finals(rollout_arrays(T=40, N=9, end_rate=0.15))
    source = write_rollout(tmp_path / "in.h5", arrays)
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    digests = []
    for budget in ("1G", "2K"):
        out = tmp_path / f"out-{budget}.h5"
        code, _, err = cli("nstep", source, "-o", out, "--n", "4", "--gamma", "0.9", "--max-memory", budget, "-q")
        assert code == 0, err
        digests.append([_outputs(out)[name].tobytes() for name in OUTPUTS])
    assert digests[0] == digests[1]
    want = nstep_returns(
        torch.from_numpy(arrays["rewards"]),
        torch.from_numpy(arrays["dones"]),
        4,
        0.9,
        torch.from_numpy(arrays["time_outs"]),
    )
    got = _outputs(tmp_path / "out-1G.h5")
    assert got["nstep_returns"].tobytes() == want.returns.numpy().tobytes()
    assert got["nstep_discount"].tobytes() == want.discount.numpy().tobytes()
    np.testing.assert_array_equal(got["nstep_next_step"], want.next_step.numpy())
    assert got["attrs"]["nstep_n"] == 4 and got["attrs"]["nstep_timeouts"] == "final-value"
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before


def test_time_outs_without_final_observations(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=20, N=3, end_rate=0.3, time_out_rate=1.0)
    source = write_rollout(tmp_path / "in.h5", arrays)
    count = int(arrays["time_outs"].sum())
    code, _, err = cli("nstep", source, "-o", tmp_path / "out.h5", "--n", "3", "-q")
    assert code == 1
    assert err.strip() == (
        f"error: {source}: field 'final_observations': expected the observations that ended the episodes, to "
        f"bootstrap the time-outs from, found nothing, and {count} time-outs. Record final_observations (format "
        "1.1), or pass --timeouts ignore to treat time-outs as ends."
    )
    assert not (tmp_path / "out.h5").exists()
    code, _, err = cli("nstep", source, "-o", tmp_path / "out.h5", "--n", "3", "--timeouts", "ignore", "--json")
    assert code == 0, err
    got = _outputs(tmp_path / "out.h5")
    ended = got["nstep_next_step"] == -1
    assert (got["nstep_discount"][ended] == 0).all()  # time-outs end episodes like terminations


def test_time_outs_bootstrap_from_final_observations(tmp_path: Path, cli) -> None:
    arrays = _with_finals(rollout_arrays(T=20, N=3, end_rate=0.3, time_out_rate=1.0))
    source = write_rollout(tmp_path / "in.h5", arrays)
    code, out, err = cli("nstep", source, "-o", tmp_path / "out.h5", "--n", "1", "--gamma", "0.5", "--json")
    assert code == 0, err
    got = _outputs(tmp_path / "out.h5")
    time_outs = arrays["time_outs"].astype(bool)
    assert (got["nstep_next_step"][time_outs] == -1).all() and (got["nstep_discount"][time_outs] == 0.5).all()
    assert f'"final_observation": {int(time_outs.sum())}' in out


def test_bootstrapped_rewards_are_not_summed(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=15, N=2)
    raw = arrays["rewards"]
    bootstrapped = arrays | {"rewards": raw + 100.0, "rewards_raw": raw}
    source = write_rollout(tmp_path / "in.h5", bootstrapped, {"timeouts_bootstrapped": True})
    code, _, err = cli("nstep", source, "-o", tmp_path / "out.h5", "--n", "2", "--timeouts", "ignore", "-q")
    assert code == 0, err
    want = nstep_returns(
        torch.from_numpy(raw),
        torch.from_numpy(arrays["dones"]),
        2,
        0.99,
        torch.from_numpy(arrays["time_outs"]),
        timeouts="ignore",
    )
    assert _outputs(tmp_path / "out.h5")["nstep_returns"].tobytes() == want.returns.numpy().tobytes()
    del bootstrapped["rewards_raw"]
    source = write_rollout(tmp_path / "in2.h5", bootstrapped, {"timeouts_bootstrapped": True})
    code, _, err = cli("nstep", source, "-o", tmp_path / "out2.h5", "--n", "2", "--timeouts", "ignore", "-q")
    assert code == 1 and "field 'rewards_raw'" in err and "timeouts_bootstrapped is true" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "0"], "error: Invalid value for '--n': Input should be greater than or equal to 1"),
        (["--gamma", "1.5"], "error: Invalid value for '--gamma': Input should be less than or equal to 1"),
        (["--gamma", "-0.1"], "error: Invalid value for '--gamma': Input should be greater than or equal to 0"),
        (["--timeouts", "rsl"], "error: --timeouts: expected final-value or ignore, found 'rsl'."),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, cli, args: list[str], message: str) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=20, N=2))
    code, _, err = cli("nstep", source, "-o", tmp_path / "out.h5", *args, "-q")
    assert code == 2 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


def test_a_k_over_t_shortens_the_windows_as_the_library_does(tmp_path: Path, cli) -> None:
    """Issue 41.6: ``--n 21`` on T = 20 was refused while ``nstep_returns`` stops a window at the rollout's end."""
    arrays = _with_finals(rollout_arrays(T=20, N=3, end_rate=0.05))
    source = write_rollout(tmp_path / "in.h5", arrays)
    code, _, err = cli("nstep", source, "-o", tmp_path / "out.h5", "--n", "21", "-q")
    assert code == 0, err
    flags = [torch.from_numpy(arrays[name]) for name in ("rewards", "dones")]
    want = nstep_returns(*flags, 21, 0.99, torch.from_numpy(arrays["time_outs"]))
    got = _outputs(tmp_path / "out.h5")
    assert got["nstep_returns"].tobytes() == want.returns.numpy().tobytes()
    np.testing.assert_array_equal(got["nstep_next_step"], want.next_step.numpy())
    assert got["attrs"]["nstep_n"] == 21 and (want.next_step == 20).any()


def test_same_bytes_without_the_compiled_kernel(tmp_path: Path, cli, monkeypatch) -> None:
    from rolloutcli.core import nstep

    source = write_rollout(tmp_path / "in.h5", _with_finals(rollout_arrays(T=50, N=40, end_rate=0.1)))
    outputs = []
    for name in ("compiled", "torch"):
        if name == "torch":
            monkeypatch.setattr(nstep, "kernel", lambda: None)
        out = tmp_path / f"{name}.h5"
        code, _, err = cli("nstep", source, "-o", out, "--n", "6", "-q")
        assert code == 0, err
        outputs.append([_outputs(out)[n].tobytes() for n in OUTPUTS])
    assert outputs[0] == outputs[1]
