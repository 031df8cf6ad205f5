"""Every block of docs/readme/h-import.md runs: the Python block (it writes the D4RL file), then each command,
in a folder holding sample_data/."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO

DOC = REPO / "docs" / "readme" / "h-import.md"


def _blocks(language: str) -> list[str]:
    return [block.strip() for block in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)]


def test_every_block_runs(tmp_path: Path, cli, monkeypatch) -> None:
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    python = _blocks("python")
    assert python
    for block in python:
        exec(compile(block, str(DOC), "exec"), {"__name__": "docs"})
    commands = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(commands) >= 3
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "rolloutcli", line
        code, out, err = cli(*argv[1:])
        assert code == 0, (line, err)
        assert out
    assert "rolloutcli import pendulum_d4rl.hdf5 -o OUT.h5" in out  # inspect of the D4RL file names the fix


def test_doc_is_short() -> None:
    assert len(DOC.read_bytes()) < 4_500
