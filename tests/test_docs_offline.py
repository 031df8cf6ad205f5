"""Every code block of docs/readme/h-offline.md runs (the approach of test_readme.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO

DOC = REPO / "docs" / "readme" / "h-offline.md"


def _blocks(language: str) -> list[str]:
    return [b.strip() for b in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)]


def test_every_block_runs(tmp_path: Path, cli, monkeypatch) -> None:
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    commands = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(commands) == 3
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "rolloutcli", line
        code, out, err = cli(*argv[1:])
        assert code == 0, (line, err)
        assert out
    python = _blocks("python")
    assert len(python) == 1
    for block in python:
        exec(compile(block, str(DOC), "exec"), {"__name__": "doc"})
    assert (tmp_path / "ikostrikov.h5").exists() and (tmp_path / "offline_windows" / "manifest.json").exists()


def test_doc_is_short() -> None:
    assert len(DOC.read_bytes()) < 3_500
