"""Issue 41 item 2: the right time-out rule without knowing to ask (format 1.2, root attribute ``timeouts_rule``).

``gae`` applies an explicit ``--timeouts``, else the file's ``timeouts_rule``, else ``rsl`` with one warning line;
the library's ``compute_gae(timeouts_rule=)`` gives the command's bits under every rule; writers and ``import
--timeouts-rule`` write the attribute; ``inspect``, ``nstep`` and ``batch --transitions`` name the rule applied.
(The recorders' own rules are asserted in tests/test_record_*.py, where SB3's and TorchRL's recordings now give
their trainers' returns with a plain ``gae``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from import_factory import make_d4rl
from rollout_factory import rollout_arrays, write_rollout
from test_gae_timeouts import GAMMA, LAM, _arrays, _ikostrikov, _sb3_returns

from rolloutcli import compute_gae
from rolloutcli.errors import RolloutError
from rolloutcli.record import RolloutWriter

RULES = ("rsl", "final-value", "proper", "ignore")
NOTE = (
    "warning: {path}: no timeouts_rule attribute: applied --timeouts rsl (RSL-RL's rule); pass --timeouts "
    "final-value for gymnasium, SB3 or TorchRL data.\n"
)


def _run(cli, source: Path, out: Path, *flags: str) -> tuple[dict, str, dict]:
    """gae without normalising: (datasets and attributes of the output, stderr, JSON summary)."""
    code, text, err = cli("gae", source, "-o", out, "--no-normalize", "--overwrite", "--json", *flags)
    assert code == 0, err
    with h5py.File(out, "r") as handle:
        result = {name: handle[name][()] for name in ("advantages", "returns", "rewards")}
        result["attrs"] = dict(handle.attrs)
    return result, err, json.loads(text)


def _library(arrays: dict[str, np.ndarray], **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    t = {k: torch.from_numpy(arrays[k]) for k in ("rewards", "values", "dones", "last_values", "time_outs")}
    return compute_gae(
        t["rewards"],
        t["values"],
        t["dones"],
        t["last_values"],
        gamma=GAMMA,
        lam=LAM,
        time_outs=t["time_outs"],
        **kwargs,
    )


@pytest.mark.parametrize("rule", RULES)
def test_compute_gae_rule_is_the_command_bit_for_bit(tmp_path: Path, cli, rule: str) -> None:
    arrays = _arrays(seed=21)
    source = write_rollout(tmp_path / "in.h5", arrays)
    flags = ("--gamma", str(GAMMA), "--lam", str(LAM), "--timeouts", rule)
    result, _, _ = _run(cli, source, tmp_path / "out.h5", *flags)
    advantages, returns = _library(arrays, timeouts_rule=rule, final_values=torch.from_numpy(arrays["final_values"]))
    assert returns.numpy().tobytes() == result["returns"].tobytes()
    assert advantages.numpy().tobytes() == result["advantages"].tobytes()
    # the torch scan applies the same rule (to float32 rounding: it reorders the sums)
    scan = _library(arrays, timeouts_rule=rule, final_values=torch.from_numpy(arrays["final_values"]), backend="torch")
    np.testing.assert_allclose(scan[1].numpy(), result["returns"], rtol=0, atol=1e-4)


def test_compute_gae_defaults_to_rsl_and_matches_the_references() -> None:
    arrays = _arrays(seed=3)
    final = torch.from_numpy(arrays["final_values"])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(
        (x.numpy() for x in _library(arrays)), (x.numpy() for x in _library(arrays, timeouts_rule="rsl")), strict=True
    ))  # fmt: skip
    _, returns = _library(arrays, timeouts_rule="final-value", final_values=final)
    assert returns.numpy().tobytes() == _sb3_returns(arrays)[1].astype(np.float32).tobytes()  # SB3's bits
    _, returns = _library(arrays, timeouts_rule="proper")
    assert returns.numpy().tobytes() == _ikostrikov(arrays).numpy().tobytes()
    original = {k: v.copy() for k, v in arrays.items()}
    _library(arrays, timeouts_rule="ignore")
    assert all(np.array_equal(arrays[k], original[k], equal_nan=True) for k in arrays)  # inputs unchanged


def test_compute_gae_refuses_an_unknown_rule_or_missing_final_values() -> None:
    arrays = _arrays()
    with pytest.raises(ValueError, match="timeouts_rule: expected one of 'rsl', 'final-value', 'proper', 'ignore'"):
        _library(arrays, timeouts_rule="sb3")
    with pytest.raises(ValueError, match="final_values: expected a \\[T, N\\] tensor for timeouts_rule='final-value'"):
        _library(arrays, timeouts_rule="final-value")


@pytest.mark.parametrize("rule", RULES)
def test_gae_applies_the_file_rule_silently(tmp_path: Path, cli, rule: str) -> None:
    arrays = _arrays(seed=5)
    tagged = write_rollout(tmp_path / "tagged.h5", arrays, {"timeouts_rule": rule})
    plain = write_rollout(tmp_path / "plain.h5", arrays)
    from_file, err, summary = _run(cli, tagged, tmp_path / "a.h5")
    named, _, _ = _run(cli, plain, tmp_path / "b.h5", "--timeouts", rule)
    assert err == ""  # the file said which rule: nothing to warn about
    assert from_file["returns"].tobytes() == named["returns"].tobytes()
    assert from_file["rewards"].tobytes() == named["rewards"].tobytes()
    assert (summary["timeouts"], summary["timeouts_from"]) == (rule, "file")
    assert from_file["attrs"]["gae_timeouts"] == rule and from_file["attrs"]["timeouts_rule"] == rule


def test_an_explicit_option_beats_the_file_rule(tmp_path: Path, cli) -> None:
    arrays = _arrays(seed=6)
    tagged = write_rollout(tmp_path / "tagged.h5", arrays, {"timeouts_rule": "final-value"})
    plain = write_rollout(tmp_path / "plain.h5", arrays)
    for flags, rule in ((("--timeouts", "proper"), "proper"), (("--no-bootstrap-timeouts",), "ignore")):
        result, err, summary = _run(cli, tagged, tmp_path / "a.h5", *flags)
        reference, _, _ = _run(cli, plain, tmp_path / "b.h5", "--timeouts", rule)
        assert err == "" and (summary["timeouts"], summary["timeouts_from"]) == (rule, "option")
        assert result["returns"].tobytes() == reference["returns"].tobytes()


def test_without_a_rule_gae_says_it_applied_rsl(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", _arrays(seed=7))
    result, err, summary = _run(cli, source, tmp_path / "out.h5")
    assert err == NOTE.format(path=source)
    assert (summary["timeouts"], summary["timeouts_from"]) == ("rsl", "default")
    assert result["attrs"]["gae_timeouts"] == "rsl" and "timeouts_rule" not in result["attrs"]
    code, text, err = cli("gae", source, "-o", tmp_path / "o2.h5")
    assert code == 0 and "time-outs: rsl (default: the file names none); " in text
    assert cli("gae", source, "-o", tmp_path / "o3.h5", "-q")[2] == ""  # --quiet: no warning
    no_time_outs = _arrays(seed=7)
    no_time_outs.pop("time_outs")  # the rule would act on nothing: nothing to say
    assert _run(cli, write_rollout(tmp_path / "nt.h5", no_time_outs), tmp_path / "nt_out.h5")[1] == ""


def test_a_rerun_on_a_gae_output_decides_the_same_way(tmp_path: Path, cli) -> None:
    arrays = _arrays(seed=8)
    tagged = write_rollout(tmp_path / "tagged.h5", arrays, {"timeouts_rule": "final-value"})
    first, _, _ = _run(cli, tagged, tmp_path / "first.h5")
    again, err, summary = _run(cli, tmp_path / "first.h5", tmp_path / "again.h5", "--gamma", "0.9")
    fresh, _, _ = _run(cli, tagged, tmp_path / "fresh.h5", "--gamma", "0.9")
    assert err == "" and (summary["timeouts"], summary["timeouts_from"]) == ("final-value", "file")
    assert again["returns"].tobytes() == fresh["returns"].tobytes()  # from rewards_raw, never bootstrapped twice
    assert again["attrs"]["gae_timeouts"] == "final-value"
    same, _, summary = _run(cli, tmp_path / "first.h5", tmp_path / "same.h5")
    assert summary["bootstrapped_by_this_run"] is False and summary["timeouts_bootstrapped"] is True
    assert same["returns"].tobytes() == first["returns"].tobytes()
    # a file without a rule, first run with --timeouts final-value: the rerun applies the default again, says so
    plain = write_rollout(tmp_path / "plain.h5", arrays)
    _run(cli, plain, tmp_path / "p1.h5", "--timeouts", "final-value")
    rerun, err, summary = _run(cli, tmp_path / "p1.h5", tmp_path / "p2.h5")
    assert err == NOTE.format(path=tmp_path / "p1.h5") and summary["timeouts"] == "rsl"
    assert rerun["returns"].tobytes() == _run(cli, plain, tmp_path / "p3.h5")[0]["returns"].tobytes()


def test_the_file_rule_needs_its_datasets_only_where_it_acts(tmp_path: Path, cli) -> None:
    arrays = _arrays(seed=9)
    arrays.pop("final_values")
    source = write_rollout(tmp_path / "in.h5", arrays, {"timeouts_rule": "final-value"})
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5")
    assert code == 1 and err.strip() == (
        f"error: {source}: field 'final_values': expected a dataset [T, N] of V(final observation) for the file's "
        "timeouts_rule final-value, found nothing. Record final values (the critic on the observation that ended "
        "the episode), or pass --timeouts rsl."
    )
    arrays.pop("time_outs")  # no time-outs: the rule acts on nothing, as the default would
    source = write_rollout(tmp_path / "nt.h5", arrays, {"timeouts_rule": "final-value"})
    assert cli("gae", source, "-o", tmp_path / "nt_out.h5", "-q")[0] == 0


@pytest.mark.parametrize(("value", "found"), [("sb3", "'sb3'"), (b"\xff", "'\\udcff'"), (3, "3")])
def test_a_bad_rule_attribute_is_refused(tmp_path: Path, cli, value, found: str) -> None:
    source = write_rollout(tmp_path / "in.h5", _arrays(), {"timeouts_rule": value})
    code, _, err = cli("gae", source, "-o", tmp_path / "o.h5")
    assert code == 1 and err.strip() == (
        f"error: {source}: attribute 'timeouts_rule': expected one of rsl, final-value, proper, ignore, found "
        f"{found}. Set it to the trainer's rule (h5py: f.attrs['timeouts_rule'] = 'rsl'), or pass --timeouts."
    )
    assert not (tmp_path / "o.h5").exists()
    assert cli("gae", source, "-o", tmp_path / "o.h5", "--timeouts", "rsl", "-q")[0] == 0  # the option decides
    code, text, _ = cli("inspect", source, "--json")
    assert code == 0 and any("attribute 'timeouts_rule'" in w for w in json.loads(text)["warnings"])


def test_each_file_of_a_dataset_gets_its_own_rule(tmp_path: Path, cli) -> None:
    arrays = _arrays(seed=10)
    folder = tmp_path / "data"
    folder.mkdir()
    write_rollout(folder / "a.h5", arrays, {"timeouts_rule": "final-value"})
    write_rollout(folder / "b.h5", arrays, {"timeouts_rule": "ignore"})
    write_rollout(folder / "c.h5", arrays)
    code, _, err = cli("gae", folder, "-o", tmp_path / "out", "--no-normalize", "-q")
    assert code == 0, err
    for name, flags in (("a", "final-value"), ("b", "ignore"), ("c", "rsl")):
        reference, _, _ = _run(cli, folder / f"{name}.h5", tmp_path / f"{name}.h5", "--timeouts", flags)
        with h5py.File(tmp_path / "out" / f"{name}.h5", "r") as handle:
            assert handle.attrs["gae_timeouts"] == flags
            assert handle["returns"][()].tobytes() == reference["returns"].tobytes()


def test_rolloutwriter_writes_the_rule_it_is_given(tmp_path: Path) -> None:
    step = {"observations": {"policy": torch.zeros(2, 3)}, "actions": torch.zeros(2, 1), "rewards": torch.zeros(2),
            "dones": torch.zeros(2), "values": torch.zeros(2)}  # fmt: skip
    for rule in (None, "proper"):
        path = tmp_path / f"{rule}.h5"
        writer = RolloutWriter(path, num_envs=2, timeouts_rule=rule)
        writer.add(step)
        writer.close(last_values=torch.zeros(2))
        with h5py.File(path, "r") as handle:
            assert handle.attrs["format_version"] == 1.2 and handle.attrs.get("timeouts_rule") == rule
    with pytest.raises(RolloutError) as error:
        RolloutWriter(tmp_path / "bad.h5", num_envs=2, timeouts_rule="sb3")
    assert str(error.value) == (
        f"{tmp_path / 'bad.h5'}: field 'timeouts_rule': expected one of rsl, final-value, proper, ignore or None, "
        "found 'sb3'. Name your trainer's."
    )
    assert not (tmp_path / "bad.h5").exists()


def test_import_writes_a_rule_only_when_named(tmp_path: Path, cli) -> None:
    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4], timeout_at=(1,))
    assert cli("import", src, "-o", tmp_path / "plain.h5", "-q")[0] == 0
    code, text, err = cli("import", src, "-o", tmp_path / "named.h5", "--timeouts-rule", "final-value")
    assert code == 0, err
    assert "time-out rule: final-value (written as timeouts_rule)" in text
    with h5py.File(tmp_path / "plain.h5", "r") as plain, h5py.File(tmp_path / "named.h5", "r") as named:
        assert "timeouts_rule" not in plain.attrs and named.attrs["timeouts_rule"] == "final-value"
    assert cli("import", src, "-o", tmp_path / "x.h5", "--timeouts-rule", "sb3")[0] == 2


def test_inspect_names_the_rule(tmp_path: Path, cli) -> None:
    arrays = _arrays(seed=12)
    tagged = write_rollout(tmp_path / "tagged.h5", arrays, {"timeouts_rule": "final-value"})
    plain = write_rollout(tmp_path / "plain.h5", arrays)
    lines = {
        tagged: "time-out rule: final-value (the file's timeouts_rule)",
        plain: "time-out rule: rsl (default: the file names none)",
    }
    for path, line in lines.items():
        code, text, _ = cli("inspect", path)
        assert code == 0 and line in text.splitlines()
    assert cli("gae", plain, "-o", tmp_path / "g.h5", "--timeouts", "proper", "-q")[0] == 0
    code, text, _ = cli("inspect", tmp_path / "g.h5")
    assert "time-out rule: gae applied proper (timeouts_rule: none)" in text.splitlines()
    report = json.loads(cli("inspect", tmp_path / "g.h5", "--json")[1])
    assert report["timeouts"] == {"recorded": None, "gae": "rsl", "from": "default", "applied": "proper"}


def test_nstep_and_transitions_print_the_rule_they_applied(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=12, N=3, seed=1)
    arrays["final_observations/policy"] = arrays["observations/policy"] * -1
    arrays["final_observations/critic"] = arrays["observations/critic"] * -1
    source = write_rollout(tmp_path / "in.h5", arrays)
    for rule in ("final-value", "ignore"):
        code, text, err = cli("nstep", source, "-o", tmp_path / f"n_{rule}.h5", "--timeouts", rule)
        assert code == 0, err
        assert f"time-outs: {rule}" in text
        code, text, err = cli(
            "batch", source, "-o", tmp_path / f"b_{rule}", "-m", "2", "--transitions", "--timeouts", rule
        )
        assert code == 0, err
        assert f"transitions: 1-step returns, gamma 0.99, time-outs: {rule}\n" in text  # its own line (issue 41.5)
    code, text, _ = cli("nstep", source, "-o", tmp_path / "n.h5", "--json")
    assert json.loads(text)["timeouts"] == "final-value"  # the default, named
