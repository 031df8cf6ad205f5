"""The command line itself: help texts, usage errors, stdout and stderr, terminal safety, signals."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, SAMPLE
from promises import PAUSE_MARKER, child_env, run_rolloutcli, temporaries
from rollout_factory import make_rollout, rollout_arrays, write_rollout

from rolloutcli.errors import EXIT_INTERRUPTED, note_signal

COMMAND_NAMES = ["inspect", "gae", "split", "batch"]


def _child(*argv: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "rolloutcli", *argv]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=child_env(**env), timeout=120)


def _shell(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``script`` in bash, ``rolloutcli`` being ``python -m rolloutcli`` of this checkout."""
    env = child_env(PYTHONPATH=str(REPO))
    prefix = f'rolloutcli() {{ {shlex.quote(sys.executable)} -m rolloutcli "$@"; }}; '
    return subprocess.run(["bash", "-c", prefix + script], capture_output=True, text=True, cwd=cwd, env=env)


# ------------------------------------------------------------------------------------------------------ help


def _help(command: str) -> str:
    result = _child(command, "--help", COLUMNS="80")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_help_at_80_columns_shows_whole_option_names() -> None:
    text = _help("gae")
    assert "…" not in text and "--bootstrap-timeouts / --no-bootstrap-timeouts" in text
    for name in ("--last-values", "--max-memory", "--allow-external", "--normalize / --no-normalize"):
        assert name in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_help_lists_choices_and_required_options() -> None:
    assert "<recorded|zero>" in _help("gae")
    assert "<rollout|longest>" in _help("split")
    text = _help("batch")
    assert "<lzf|gzip>" in text
    assert "[default: 0]" not in text and "required" in text
    assert "-o, --output FOLDER" in text and "Output folder" in text
    assert "--device" not in text and "--device" not in _help("inspect")
    assert "--debug" not in text


def test_help_names_arguments_as_a_user_types_them() -> None:
    """Issue 41.6: ``FILE <list[str]>``, ``SRC <path>`` and ``{FILE}...`` were typer's types; ``-o`` was named in
    the help of commands without one; ``--overwrite`` spoke of folders for commands that write one file."""
    for command in ("inspect", "gae", "split", "batch", "nstep", "stats", "returns"):
        text = _help(command)
        assert f"Usage: rolloutcli {command} [OPTIONS] FILE...\n" in text
        assert "\n  FILE...  Rollout files, directories or globs" in text and "<list[str]>" not in text
    assert "Usage: rolloutcli import [OPTIONS] SRC\n" in _help("import") and "\n  SRC  Recording:" in _help("import")
    assert "Usage: rolloutcli plot [OPTIONS] FILE\n" in _help("plot") and "<path>" not in _help("plot")
    for command in ("inspect", "stats"):
        assert not re.search(r"(?<![\w-])-o\b", _help(command))
    for command in ("stats", "plot"):
        text = _help(command)
        assert "--overwrite          Replace an earlier output file (never an input)." in text
        assert "folder" not in text


def test_every_help_ends_with_an_example_that_runs(tmp_path: Path, cli, monkeypatch) -> None:
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    for command in COMMAND_NAMES:
        lines = _help(command).rstrip().splitlines()
        assert lines[-2].strip() == "Example:", lines[-2:]
        argv = shlex.split(lines[-1])
        assert argv[:2] == ["rolloutcli", command]
        code, _, err = cli(*argv[1:])
        assert code == 0, (argv, err)


# ------------------------------------------------------------------------------------------------ usage errors


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["split", "{src}", "-o", "o.h5", "--pad-to", "x"], "error: --pad-to: expected rollout or longest, found 'x'."),
        (["gae", "{src}", "-o", "o.h5", "--last-values", "none"], "--last-values: expected recorded or zero"),
        (["batch", "{src}", "-o", "s", "-m", "2", "--compression", "zstd"], "expected lzf or gzip, found 'zstd'"),
        (["inspect", "{src}", "--max-memory", "9" * 400], "error: --max-memory: expected at most 1024T"),
        (["batch", "{src}", "-o", "s", "-m", "2", "--seed", str(2**64)], "'--seed'"),
        (["batch", "{src}", "-o", "s", "-m", str(10**30)], "'--num-mini-batches'"),
        (["batch", "{src}", "-o", "s", "-m", "2", "--history", str(10**30)], "'--history'"),
        (["batch", "{src}", "-o", "s", "-m", "2", "--epochs", "0"], "'--epochs'"),
        (["split", "{src}", "-o", "o.h5", "--max-length", str(10**30)], "'--max-length'"),
        (["gae", "{src}", "-o", "o.h5", "--gamma", "1.5"], "'--gamma'"),
        (["gae", "{src}", "-o", "o.h5", "--lam", "nan"], "'--lam'"),
        (["batch", "{src}", "-o", "s"], "--batch-size B, found neither"),
        (["inspect", "{src}", "--device", "cpu"], "No such option: --device"),
        (["inspect", "{src}", "--debug"], "No such option: --debug"),
        (["gae", "{src}", "-o", "-"], "error: -o: expected a path, found '-'"),
        (["batch", "{src}", "-o", "-", "-m", "2"], "error: -o: expected a path, found '-'"),
        (
            ["stats", "{src}", "--normalizer", "-"],  # issue 40.9: it wrote a file named "-"
            "error: --normalizer: expected a path, found '-' (the normalizer is a torch.save file, never stdout).",
        ),
    ],
)
def test_usage_errors_are_one_line_exit_2(tmp_path: Path, cli, monkeypatch, argv: list[str], words: str) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(*[a.replace("{src}", str(SAMPLE)) for a in argv])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert words in err
    assert os.listdir(tmp_path) == []  # nothing written, not even a file named "-"


# ---------------------------------------------------------------------------------------------- quiet and json


def test_quiet_prints_nothing_but_json(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=60, N=4, end_rate=0.5))  # split warns here
    runs = [
        ("inspect", source),
        ("gae", source, "-o", tmp_path / "g.h5"),
        ("split", source, "-o", tmp_path / "s.h5"),
        ("batch", tmp_path / "g.h5", "-o", tmp_path / "b", "-m", 2),
    ]
    for argv in runs:
        assert cli(*argv, "-q") == (0, "", ""), argv
    code, out, err = cli("inspect", source, "-q", "--json")
    assert code == 0 and err == "" and json.loads(out)["T"] == 60


def test_json_has_no_nan(tmp_path: Path, cli) -> None:
    source = make_rollout(tmp_path / "in.h5", attrs={"score": np.nan, "best": np.inf, "values": np.array([np.nan])})
    code, out, _ = cli("inspect", source, "--json")
    assert code == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    report = json.loads(out, parse_constant=refuse)
    assert report["attrs"]["score"] is None and report["attrs"]["best"] is None and report["attrs"]["values"] == [None]


def test_json_written_in_pieces_is_json_dumps_byte_for_byte() -> None:
    """``emit`` writes a result's JSON a top-level list item at a time (a dataset's report holds a row per file):
    the text is ``json.dumps`` of the plain result, whatever the values."""
    import torch

    from rolloutcli.cli.render import _plain, json_pieces, printable
    from rolloutcli.pipeline.lazy import Lazy

    rows = [{"file": Path(f"{i}.h5"), "n": np.int64(i), "mean": np.float32(0.5) if i else np.nan} for i in range(3)]
    results = [
        {},
        {"files": rows, "empty": [], "pair": (1, "b"), "nested": {"x": [1, [2, {3: np.inf}]], 4: None}},
        {"only": [np.arange(3), b"\xff", "é\n\u2028"], "array": np.array([[1.5, np.nan]]), "flag": np.bool_(True)},
        {1: "key", None: [None], False: [[]], "tensor": torch.ones(2)},
    ]
    for result in results:
        expected = json.dumps(_plain(result), default=str, allow_nan=False)
        assert "".join(json_pieces(result)) == expected
        json.loads(expected)
    # rows made as they are read (pipeline.lazy.Lazy): written, and made printable, as the list they stand for
    made = Lazy(3, lambda i: rows[i])
    assert len(made) == 3 and made[-1] is rows[2] and list(made) == rows
    with pytest.raises(IndexError):
        made[3]
    lazy, listed = {"files": made, "empty": Lazy(0, rows.__getitem__)}, {"files": rows, "empty": []}
    assert "".join(json_pieces(lazy)) == json.dumps(_plain(listed), default=str, allow_nan=False)
    assert printable(lazy) == printable(listed)


def test_time_is_the_whole_command_and_no_rate_for_small_outputs(tmp_path: Path, cli, monkeypatch) -> None:
    import types

    import rolloutcli.cli.common as cli_common
    import rolloutcli.pipeline.batch as batch_pipeline

    gae_out = tmp_path / "g.h5"
    assert cli("gae", SAMPLE, "-o", gae_out, "-q")[0] == 0
    real = batch_pipeline.run_batch
    clock = [1000.0]  # the command's clock, advanced by hand: no real time is measured

    def slow(*args, **kwargs):  # 0.5 s spent before the pipeline starts its own clock
        clock[0] += 0.5
        return real(*args, **kwargs)

    monkeypatch.setattr(cli_common, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(batch_pipeline, "run_batch", slow)
    code, out, _ = cli("batch", gae_out, "-o", tmp_path / "s", "-m", 2)
    assert code == 0
    seconds = float(re.search(r"done in ([0-9.]+) s", out).group(1))
    assert seconds == 0.5 and "GB/s" not in out


# --------------------------------------------------------------------------------------------- stdout faults


def test_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    for script in (f"rolloutcli inspect {SAMPLE} --json | head -c 10", "rolloutcli --help | head -1"):
        result = _shell(f"set -o pipefail; {script}", tmp_path)
        assert result.returncode in (0, 141), result.stderr
        assert result.stderr == "", result.stderr


def test_closed_stdout_descriptor(tmp_path: Path) -> None:
    result = _shell(f"rolloutcli inspect {SAMPLE} --json >&-", tmp_path)
    assert result.returncode == 3
    assert result.stderr == "error: cannot write the results to stdout: it is closed.\n"
    assert _shell(f"rolloutcli inspect {SAMPLE} -q >&-", tmp_path).returncode == 0


def test_failed_summary_after_publish_says_the_output_is_complete(tmp_path: Path) -> None:
    result = _shell(f"rolloutcli gae {SAMPLE} -o out.h5 --json >&-", tmp_path)
    assert result.returncode == 3
    assert result.stderr.strip().endswith("The output out.h5 is complete."), result.stderr
    assert (tmp_path / "out.h5").exists()


# ------------------------------------------------------------------------------------------- terminal safety


def test_markup_in_paths_prints_as_spelled(tmp_path: Path, cli) -> None:
    folder = tmp_path / "a[/red]"  # the folder "red]" inside "a["
    folder.mkdir(parents=True)
    src = folder / "[bold]x[/bold]:smile:.h5".replace("/", "")
    src.write_bytes(SAMPLE.read_bytes())
    for argv, output in [
        (("gae", src, "-o", folder / "[red]g.h5"), folder / "[red]g.h5"),
        (("split", src, "-o", folder / "s[i].h5"), folder / "s[i].h5"),
        (("batch", folder / "[red]g.h5", "-o", folder / "[b]s", "-m", 2), folder / "[b]s"),
    ]:
        code, out, err = cli(*argv)
        assert code == 0, err
        assert f"{argv[1]} -> {output}" in " ".join(out.split())  # wrapped at spaces to 80 columns (issue 41.5)


def test_untrusted_dataset_names_are_text(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays()
    shape = arrays["rewards"].shape
    arrays["extra[/bold]"] = np.zeros(shape, np.float32)
    arrays["title\x1b]0;owned\x07\x1b[2J"] = np.zeros(shape, np.float32)
    source = write_rollout(tmp_path / "in.h5", arrays, {"note[/red]": "x"})
    code, out, err = cli("inspect", source)
    assert code == 0, err
    assert "extra[/bold]" in out.replace("\n", "") or "extra[" in out
    assert "\x1b" not in out and "\x07" not in out
    assert "title\\x1b]0;owned\\x07\\x1b[2J" in out


# ----------------------------------------------------------------------------------------------------- signals


def test_sighup_is_like_sigterm(tmp_path: Path) -> None:
    source = make_rollout(tmp_path / "in.h5")
    run = run_rolloutcli(["gae", source, "-o", "out.h5"], cwd=tmp_path, signal_after_pause=signal.SIGHUP)
    assert run.paused and run.returncode == 129, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "hangup: no output was written (temporary files removed)."
    assert temporaries(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["in.h5"]
    assert any(line.startswith(PAUSE_MARKER) for line in run.stderr.splitlines())


def test_ctrl_c_during_start_up(tmp_path: Path) -> None:
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def interrupted(name, *args, **kwargs):\n"
        "    if name == 'rolloutcli.cli.app':\n"
        "        raise KeyboardInterrupt\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = interrupted\n"
        "from rolloutcli.__main__ import run\n"
        "run()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    assert result.returncode == 130
    assert result.stderr == "interrupted: no output was written.\n"


def test_swallowed_ctrl_c_still_exits_130(tmp_path: Path, cli, monkeypatch) -> None:
    """A KeyboardInterrupt swallowed inside a library (a ``__del__``, a suppress) still ends the run with 130."""
    import rolloutcli.pipeline.split as split_pipeline

    real = split_pipeline.run_split

    def swallowed(*args, **kwargs):
        summary = real(*args, **kwargs)
        note_signal(EXIT_INTERRUPTED)  # what the SIGINT handler records before its exception is lost
        return summary

    monkeypatch.setattr(split_pipeline, "run_split", swallowed)
    code, _, err = cli("split", SAMPLE, "-o", tmp_path / "s.h5")
    assert code == 130
    last = err.strip().splitlines()[-1]
    assert last == f"interrupted: the output {tmp_path / 's.h5'} was already published and is complete."


def test_no_import_cycle_between_cli_modules() -> None:
    code = "import sys, rolloutcli.cli.batch; assert 'rolloutcli.cli.app' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())
    with h5py.File(SAMPLE, "r"):  # the sample is a plain readable file (the tests above rely on it)
        pass


def test_a_library_that_cannot_be_mapped_is_out_of_memory(tmp_path, cli, monkeypatch) -> None:
    """Under a low ``ulimit -v`` a lazy import fails with ImportError ("failed to map segment"): exit 3."""
    import builtins

    from rolloutcli.errors import out_of_memory

    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "rolloutcli.pipeline.gae":
            raise ImportError("libhdf5.so: failed to map segment from shared object")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing)
    code, out, err = cli("gae", SAMPLE, "-o", tmp_path / "out.h5")
    assert code == 3 and out == ""
    assert err.strip() == "error: out of memory while loading a library; raise the memory limit (ulimit -v)."
    assert not out_of_memory(ModuleNotFoundError("No module named 'nope'"))
