"""Bad input (README, promises): every validation rule, through every command of ``COMMANDS``, via the CLI.

For each rule and command: exit 1, one ``error:`` line naming the field and the problem, no output and no
temporary file left, and the input's bytes unchanged (hash before and after). Rules of the rollout format
apply to the commands that read rollouts; ``split --unpad`` reads split files and has its own table. A
hypothesis property closes the file: on generated rollouts every command succeeds or fails cleanly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from promises import (
    COMMANDS,
    ROLLOUT_READERS,
    assert_fits,
    digest,
    error_lines,
    input_from_arrays,
    make_input,
    temporaries,
)
from rollout_factory import rollout_arrays

Arrays = dict[str, np.ndarray]


def _drop(*names: str) -> Callable[[Arrays], None]:
    def change(arrays: Arrays) -> None:
        for name in names:
            arrays.pop(name)

    return change


def _set(name: str, make: Callable[[Arrays], np.ndarray]) -> Callable[[Arrays], None]:
    def change(arrays: Arrays) -> None:
        arrays[name] = make(arrays)

    return change


def _poke(name: str, value: float, dtype: type | None = None) -> Callable[[Arrays], None]:
    """Set one element of ``name`` (converted to ``dtype`` first)."""

    def change(arrays: Arrays) -> None:
        data = arrays[name].astype(dtype or arrays[name].dtype)
        data.reshape(-1)[1] = value
        arrays[name] = data

    return change


def _orphan_time_out(arrays: Arrays) -> None:
    time_outs = arrays["time_outs"].copy()
    t, n = np.argwhere(arrays["dones"] == 0)[0]
    time_outs[t, n] = 1
    arrays["time_outs"] = time_outs


def _empty(axis: int) -> Callable[[Arrays], None]:
    def change(arrays: Arrays) -> None:
        for name, value in list(arrays.items()):
            if name == "last_values":
                arrays[name] = value[:0] if axis == 1 else value
            elif name.startswith("hidden_states/"):
                arrays[name] = value[:0] if axis == 0 else value[:, :, :0]
            else:
                arrays[name] = value[:0] if axis == 0 else value[:, :0]

    return change


# rule: (change of a valid rollout, field named, words naming the problem, commands it applies to or None = all
# commands reading rollouts)
RULES: dict[str, tuple[Callable[[Arrays], None], str, str, tuple[str, ...] | None]] = {
    "missing rewards": (_drop("rewards"), "rewards", "found nothing", None),
    "missing actions": (_drop("actions"), "actions", "found nothing", None),
    "missing dones": (_drop("dones"), "dones", "found nothing", None),
    "missing observations": (
        _drop("observations/policy", "observations/critic"),
        "observations",
        "found nothing",
        None,
    ),
    "T disagrees": (
        _set("actions", lambda a: np.zeros((13, 3, 2), np.float32)),
        "actions",
        "expected shape [T, N, ...] with T=12, N=3, found shape (13, 3, 2)",
        None,
    ),
    "N disagrees": (
        _set("values", lambda a: np.zeros((12, 4), np.float32)),
        "values",
        "expected shape [T, N] = [12, 3] (or [12, 3, 1]), found shape (12, 4)",
        None,
    ),
    "wrong rank": (_set("dones", lambda a: np.zeros((12, 3, 2), np.uint8)), "dones", "found shape (12, 3, 2)", None),
    "rewards of rank 1": (
        _set("rewards", lambda a: np.zeros(12, np.float32)),
        "rewards",
        "expected shape [T, N] or [T, N, 1], found shape (12,)",
        None,
    ),
    "non-numeric dtype": (
        _set("actions", lambda a: np.full((12, 3, 2), b"abc")),
        "actions",
        "expected a numeric dtype (bool, integer or float), found dtype |S3",
        None,
    ),
    "NaN rewards": (_poke("rewards", np.nan), "rewards", "expected finite numbers, found 1 NaN/Inf values", None),
    "Inf values": (_poke("values", np.inf), "values", "expected finite numbers, found 1 NaN/Inf values", None),
    "NaN last_values": (_poke("last_values", np.nan), "last_values", "expected finite numbers", None),
    "dones outside 0/1": (_poke("dones", 2, np.int32), "dones", "expected only 0 and 1, found 1 other values", None),
    "time_outs outside 0/1": (_poke("time_outs", 7, np.int32), "time_outs", "expected only 0 and 1", None),
    "time-out where dones is 0": (
        _orphan_time_out,
        "time_outs",
        "expected time-outs only where dones is 1, found 1 time-outs where dones is 0",
        None,
    ),
    "empty T": (_empty(0), "rewards", "expected at least one step and one env, found T=0, N=3", None),
    "empty N": (_empty(1), "rewards", "expected at least one step and one env, found T=12, N=0", None),
    "last_values shape": (
        _set("last_values", lambda a: np.zeros(4, np.float32)),
        "last_values",
        "expected shape [N] = [3] (or [3, 1]), found shape (4,)",
        None,
    ),
    "hidden state rank": (
        _set("hidden_states/actor/0", lambda a: np.zeros((12, 3, 3), np.float32)),
        "hidden_states/actor/0",
        "expected shape [T, layers, N, hidden]",
        None,
    ),
    "LSTM h and c differ": (
        _set("hidden_states/critic/1", lambda a: np.zeros((12, 2, 3, 3), np.float32)),
        "hidden_states/critic",
        "expected LSTM h and c of the same shape",
        None,
    ),
    "hidden state index": (
        _set("hidden_states/actor/2", lambda a: np.zeros((12, 1, 3, 3), np.float32)),
        "hidden_states/actor/2",
        "expected hidden_states/actor/<0|1>",
        None,
    ),
    "gae without values": (
        _drop("values"),
        "values",
        "expected a dataset [T, N] of V(s_t), found nothing",
        ("gae", "gae --in-place"),
    ),
    "gae without last_values": (_drop("last_values"), "last_values", "found nothing", ("gae", "gae --in-place")),
}
RULE_CASES = [
    (rule, name) for rule, (*_, only) in RULES.items() for name in ROLLOUT_READERS if only is None or name in only
]


def _assert_refused(
    folder: Path, name: str, src: Path, before: str, code: int, out: str, err: str, field: str, words: str
) -> None:
    command = COMMANDS[name]
    assert code == 1, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    shown = out + err if command.strict else err  # inspect --strict lists value problems in its report
    assert f"field '{field}'" in shown and words in shown, err
    if not command.strict:
        assert out == ""
    assert digest(src) == before, "the input was modified"
    assert sorted(os.listdir(folder)) == [src.name] and temporaries(folder) == []


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_validation_rule(tmp_path: Path, cli, case: tuple[str, str]) -> None:
    rule, name = case
    change, field, words, _ = RULES[rule]
    command = COMMANDS[name]
    arrays = rollout_arrays(hidden="lstm")
    change(arrays)
    src = input_from_arrays(command.source, tmp_path / "in.h5", arrays)
    before = digest(src)
    code, out, err = cli(*command.argv(src, command.output_path(src, tmp_path), *command.strict))
    _assert_refused(tmp_path, name, src, before, code, out, err, field, words)


# ------------------------------------------------------------------------------------ split files (--unpad)


def _delete(name: str) -> Callable[[h5py.File], None]:
    return lambda handle: handle.__delitem__(name)


def _attr(key: str, value: object) -> Callable[[h5py.File], None]:
    def change(handle: h5py.File) -> None:
        if value is None:
            del handle.attrs[key]
        else:
            handle.attrs[key] = value

    return change


def _reshape(name: str, grow: int, axis: int) -> Callable[[h5py.File], None]:
    def change(handle: h5py.File) -> None:
        data = handle[name][()]
        pad = [(0, 0)] * data.ndim
        pad[axis] = (0, grow)
        del handle[name]
        handle[name] = np.pad(data, pad)

    return change


def _lengthen_first_span(handle: h5py.File) -> None:
    lengths = handle["trajectory_length"][()]
    lengths[0] += 1
    handle["trajectory_length"][...] = lengths


def _shift_second_span(handle: h5py.File) -> None:
    """Overlapping spans with the same total: trajectory 1 starts one step early, trajectory 0 is one longer
    only by count (the sum of lengths still equals T * N)."""
    starts, lengths = handle["trajectory_start"][()], handle["trajectory_length"][()]
    starts[1] -= 1
    lengths[0] += 1
    lengths[-1] -= 1
    handle["trajectory_start"][...] = starts
    handle["trajectory_length"][...] = lengths


SPLIT_RULES: dict[str, tuple[Callable[[h5py.File], None], str, str]] = {
    "not a split file": (
        _attr("rolloutcli_format", "rollout"),
        "/ (attribute rolloutcli_format)",
        "expected 'trajectories' (a file written by rolloutcli split), found 'rollout'",
    ),
    "no source_T": (_attr("source_T", None), "/ (attribute source_T)", "expected a positive integer, found nothing"),
    "negative source_N": (_attr("source_N", -3), "/ (attribute source_N)", "expected a positive integer"),
    "no split_fields": (_attr("split_fields", None), "/ (attribute split_fields)", "found nothing"),
    "missing masks": (_delete("masks"), "masks", "expected a dataset written by split, found nothing"),
    "missing trajectory_length": (_delete("trajectory_length"), "trajectory_length", "found nothing"),
    "missing split field": (_delete("actions"), "actions", "expected a dataset written by split, found nothing"),
    "field of the wrong shape": (_reshape("actions", 1, 1), "actions", "expected shape [L, M, ...]"),
    "span of the wrong shape": (_reshape("trajectory_start", 2, 0), "trajectory_start", "expected shape [M]"),
    "spans not covering T*N": (
        _lengthen_first_span,
        "trajectory_env/trajectory_start/trajectory_length",
        "expected env-major spans tiling every env's T = 12 steps",
    ),
    "overlapping spans": (
        _shift_second_span,
        "trajectory_env/trajectory_start/trajectory_length",
        "expected env-major spans tiling",
    ),
}
SPLIT_READERS = [name for name, command in COMMANDS.items() if command.source == "split"]
SPLIT_CASES = [(rule, name) for rule in SPLIT_RULES for name in SPLIT_READERS]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_split_file_rule(tmp_path: Path, cli, case: tuple[str, str]) -> None:
    rule, name = case
    change, field, words = SPLIT_RULES[rule]
    command = COMMANDS[name]
    src = make_input(command.source, tmp_path / "in.h5", end_rate=0.3)
    with h5py.File(src, "a") as handle:
        change(handle)
    before = digest(src)
    code, out, err = cli(*command.argv(src, command.output_path(src, tmp_path)))
    _assert_refused(tmp_path, name, src, before, code, out, err, field, words)


# ------------------------------------------------------------------------------------- object references

# Commands carrying a rollout's other datasets into a file. Not export: its targets have no place for them (a
# warning names them, test_export_promises.py), so no reference of the input reaches its output.
FILE_WRITERS = [
    name
    for name, command in COMMANDS.items()
    if command.output == "file" and command.source != "d4rl" and not name.startswith("export")
]
REFERENCE_TARGETS = {"index": ["/actions", "/last_values"], "links": ["/last_values", "/observations/policy"]}


def _add_references(handle: h5py.File, per_step: bool) -> None:
    """Datasets of object references: ``index`` (plain), ``links`` (a compound of a reference and a number) and,
    ``per_step``, ``frame_ref`` laid out ``[T, N]`` like a step field (every step pointing at ``/values``)."""
    for name, targets in REFERENCE_TARGETS.items():
        if name == "index":
            handle.create_dataset(name, data=np.array([handle[t].ref for t in targets], object), dtype=h5py.ref_dtype)
        else:
            dtype = np.dtype([("target", h5py.ref_dtype), ("weight", "f4")])
            handle.create_dataset(name, data=np.array([(handle[t].ref, 0.5) for t in targets], dtype))
    if per_step:
        refs = np.full(handle["rewards"].shape[:2], handle["values"].ref, object)
        handle.create_dataset("frame_ref", data=refs, dtype=h5py.ref_dtype)


def _targets(handle: h5py.File, name: str) -> list[str]:
    """What each reference of ``name`` points at in ``handle`` ("null" or "dangling" where it points nowhere)."""
    data = handle[name][()]
    refs = data["target"] if data.dtype.names else data
    out = []
    for ref in refs.reshape(-1):
        try:
            out.append(handle[ref].name if ref else "null")
        except (KeyError, ValueError):
            out.append("dangling")
    return out


@pytest.mark.parametrize("per_step", [False, True], ids=["carried", "per-step"])
@pytest.mark.parametrize("name", FILE_WRITERS)
def test_object_references_resolve_in_the_output_or_are_refused(tmp_path: Path, cli, name: str, per_step: bool) -> None:
    """Issue 40.6: every reference a written file holds points at its own copy of the object the input's pointed
    at, or the command refuses (exit 1, one line naming the field, nothing written): split copied them nulled
    and crashed on a per-step field of them."""
    command = COMMANDS[name]
    if per_step and command.source == "split":
        pytest.skip("a split file's per-step fields are those split wrote")
    src = make_input(command.source, tmp_path / "in.h5", end_rate=0.3)
    with h5py.File(src, "a") as handle:
        _add_references(handle, per_step)
    before = digest(src)
    dst = command.output_path(src, tmp_path)
    code, out, err = cli(*command.argv(src, dst))
    if per_step and name == "split":
        words = "expected fixed-size values, found HDF5 object references or variable-length data"
        return _assert_refused(tmp_path, name, src, before, code, out, err, "frame_ref", words)
    assert code == 0 and error_lines(err) == [], err
    with h5py.File(dst) as handle:
        for dataset, targets in REFERENCE_TARGETS.items():
            assert _targets(handle, dataset) == targets, dataset
        if per_step:
            assert set(_targets(handle, "frame_ref")) == {"/values"}


def test_a_reference_the_output_cannot_hold_is_refused(tmp_path: Path, cli) -> None:
    """A region reference (or one to an object the output drops) is not re-pointed: refused, never published."""
    src = make_input("rollout", tmp_path / "in.h5")
    with h5py.File(src, "a") as handle:
        handle.create_dataset("regions", (1,), dtype=h5py.regionref_dtype)[0] = handle["rewards"].regionref[0:2]
    before = digest(src)
    code, out, err = cli("split", src, "-o", tmp_path / "out.h5")
    assert err == (
        f"error: {src}: field 'regions': expected object references to objects the output keeps, found a reference "
        "to an object the output does not hold, or a region reference. Nothing was written; point the references "
        "at datasets the output keeps, or remove them.\n"
    )
    _assert_refused(tmp_path, "split", src, before, code, out, err, "regions", "a region reference")


def test_import_points_references_at_the_carried_copies_or_refuses(tmp_path: Path, cli) -> None:
    """``import`` carries a source's unknown datasets verbatim: their references, nulled by libhdf5's copy, point
    at the output's copies of their targets; one whose target was imported (changed in layout) is refused."""
    src = make_input("d4rl", tmp_path / "in.h5")
    with h5py.File(src, "a") as handle:
        handle.create_dataset("extra", data=np.arange(5))
        handle.create_dataset("index", data=np.array([handle["extra"].ref] * 2, object), dtype=h5py.ref_dtype)
    code, out, err = cli("import", src, "-o", tmp_path / "out.h5")
    assert code == 0, err
    with h5py.File(tmp_path / "out.h5") as handle:
        assert _targets(handle, "index") == ["/extra", "/extra"]
    with h5py.File(src, "a") as handle:
        handle["index"][1] = handle["rewards"].ref
    code, out, err = cli("import", src, "-o", tmp_path / "refused.h5")
    assert code == 1 and out == "" and not (tmp_path / "refused.h5").exists()
    assert err == (
        f"error: {src}: field 'index': expected object references to objects the output keeps, found a reference "
        "to an object the output does not hold, or a region reference. Nothing was written; point the references "
        "at datasets the output keeps, or remove them.\n"
    )


# ------------------------------------------------------------------------------------------ no inputs

FILE_ARGUMENT_READERS = [name for name, command in COMMANDS.items() if command.source != "d4rl"]  # import: a source


@pytest.mark.parametrize("kind", ["empty folder", "glob matching nothing"])
@pytest.mark.parametrize("name", FILE_ARGUMENT_READERS)
def test_arguments_naming_no_input_are_a_usage_error(tmp_path: Path, cli, monkeypatch, name: str, kind: str) -> None:
    """Issue 40.9: an empty input folder was exit 1 and a glob matching nothing exit 2; both name no input: exit 2,
    one line, nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("not a rollout")
    arg = "runs" if kind == "empty folder" else "runs/*.h5"
    command = COMMANDS[name]
    code, out, err = cli(*command.argv(arg, "out"))
    expected = {
        "empty folder": "error: runs: expected rollout files (*.h5, *.hdf5) in the directory, found none. Check the "
        "path.",
        "glob matching nothing": "error: runs/*.h5: expected files matching the pattern, found none. Check the "
        "pattern.",
    }[kind]
    assert (code, out, err) == (2, "", expected + "\n")
    assert sorted(os.listdir(tmp_path)) == ["runs"] and os.listdir(tmp_path / "runs") == ["notes.txt"]


# ------------------------------------------------------------------------------------------ property


@st.composite
def perturbed_rollouts(draw: st.DrawFn) -> Arrays:
    """Valid rollouts of random size and layout, with a few random faults (often none)."""
    T, N = draw(st.integers(1, 7)), draw(st.integers(1, 4))
    arrays = rollout_arrays(
        T,
        N,
        seed=draw(st.integers(0, 2**16)),
        end_rate=draw(st.floats(0, 1)),
        hidden=draw(st.sampled_from([None, "gru", "lstm"])),
        obs_dim=draw(st.integers(1, 3)),
    )
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(sorted(arrays)))
        fault = draw(st.sampled_from(["drop", "dtype", "shape", "nan", "flag", "trailing one"]))
        value = arrays[name]
        if fault == "drop":
            arrays.pop(name)
        elif fault == "dtype":
            arrays[name] = value.astype(draw(st.sampled_from([np.float16, np.float64, np.int8, np.uint8, np.bool_])))
        elif fault == "shape":
            arrays[name] = value.reshape(-1) if value.ndim > 1 else value[:, None, None]
        elif fault == "nan" and value.dtype.kind == "f" and value.size:
            value = value.copy()
            value.reshape(-1)[0] = np.nan
            arrays[name] = value
        elif fault == "flag" and value.size:
            arrays[name] = value.astype(np.int16) + 2
        elif fault == "trailing one":
            arrays[name] = value[..., None]
    return arrays


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrays=perturbed_rollouts(), name=st.sampled_from(list(COMMANDS)))
def test_every_command_succeeds_or_fails_cleanly(
    tmp_path_factory: pytest.TempPathFactory, cli, arrays: Arrays, name: str
) -> None:
    """``main`` re-raises anything that is not a ``RolloutError``: only codes 0-4 may come back."""
    folder = tmp_path_factory.mktemp("property")
    command = COMMANDS[name]
    try:
        src = input_from_arrays(command.source, folder / "in.h5", arrays)
    except Exception as error:  # the flat D4RL layout cannot hold every perturbation (e.g. 1-D actions)
        assert type(error).__name__ == "RolloutError" or command.source == "d4rl"
        return
    before = digest(src)
    dst = command.output_path(src, folder)
    code, out, err = cli(*command.argv(src, dst))
    event(f"{name}: exit {code}")
    assert code in (0, 1, 2, 3, 4), err  # 2: options the file is too small for (batch -m 4 on 3 rows)
    if code == 0:
        assert error_lines(err) == []
        if dst is not None:
            assert dst.exists()
    else:
        assert len(error_lines(err)) == 1 and out == ""
        assert digest(src) == before and sorted(os.listdir(folder)) == ["in.h5"]
    assert temporaries(folder) == []


@pytest.mark.parametrize("name", list(COMMANDS))
def test_human_output_fits_80_columns_and_never_breaks_a_name(tmp_path: Path, cli, monkeypatch, name: str) -> None:
    """Each command's summary, captured (not a terminal, so 80 columns): no line wider, no name broken; long
    dataset names included (issue 41.5)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.chdir(tmp_path)  # paths as a user types them (an 80-column path could not fit a line)
    command = COMMANDS[name]
    group = "observations/proprioception_of_the_whole_robot_arm"
    arrays = rollout_arrays(T=16, N=4)
    arrays[group] = arrays["observations/policy"][..., :3].copy()
    try:
        src = input_from_arrays(command.source, Path("a_recording_with_a_long_descriptive_name.h5"), arrays)
    except Exception:  # the flat D4RL layout holds no observation groups: its plain input
        src = make_input(command.source, Path("a_recording_with_a_long_descriptive_name.h5"))
    dst = command.output_path(src, Path("an_output_folder_named_at_length"))
    Path("an_output_folder_named_at_length").mkdir()
    argv = [arg for arg in command.args(str(src), str(dst)) if arg != "--json"]
    code, out, err = cli(*argv)
    assert code == 0, err
    assert_fits(out, [group, str(src), str(dst)])
