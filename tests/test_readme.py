"""Every code block of the README runs: the two setup commands, each command example, each Python snippet."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO


def _blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    return [block.strip() for block in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)]


def test_main_job_command_runs(tmp_path: Path, cli, monkeypatch) -> None:
    first = _blocks("bash")[0]
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && ")
    monkeypatch.chdir(REPO)
    steps = [step.strip() for step in first.split("&&") if step.strip().startswith("rolloutcli ")]
    assert [shlex.split(step)[1] for step in steps] == ["inspect", "gae", "batch"]
    for step in steps:
        argv = [arg.replace("/tmp/", f"{tmp_path}/") for arg in shlex.split(step)[1:]]
        code, out, err = cli(*argv)
        assert code == 0, (step, err)
        assert out
    manifest = (tmp_path / "cartpole_shards" / "manifest.json").read_text()
    assert '"mode": "recurrent"' in manifest


def test_ci_runs_the_readme_test_command() -> None:
    second = _blocks("bash")[1]
    assert "python -m pytest" in second
    assert second in (REPO / ".ci" / "run").read_text()


def test_every_example_runs(tmp_path: Path, cli, monkeypatch) -> None:
    """The command blocks in order, then the Python blocks (each on its own), in a folder with sample_data/."""
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    commands = [line for block in _blocks("bash")[2:] for line in block.splitlines() if line.strip()]
    assert len(commands) >= 6
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "rolloutcli", line
        code, out, err = cli(*argv[1:])
        assert code == 0, (line, err)
        assert out
    python = _blocks("python")
    assert len(python) >= 3
    for block in python:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})


def test_readme_is_short() -> None:
    assert len((REPO / "README.md").read_bytes()) < 24_000
