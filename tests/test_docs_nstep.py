"""Every block of docs/readme/h-nstep.md runs (commands in a folder holding sample_data/, Python on its own)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO

DOC = REPO / "docs" / "readme" / "h-nstep.md"


def _blocks(language: str) -> list[str]:
    return [block.strip() for block in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)]


def test_every_block_runs(tmp_path: Path, cli, monkeypatch) -> None:
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    commands = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(commands) == 5
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "rolloutcli", line
        code, out, err = cli(*argv[1:])
        assert code == 0, (line, err)
        assert out
    for block in _blocks("python"):
        exec(compile(block, str(DOC), "exec"), {"__name__": "docs"})


def test_the_picture_is_there_and_the_text_is_short() -> None:
    assert (REPO / "docs" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert len(DOC.read_bytes()) < 3_500
