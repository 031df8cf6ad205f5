"""Every block of docs/readme/h-record.md runs, in order, in a scratch folder holding sample_data/."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO

DOC = REPO / "docs" / "readme" / "h-record.md"


def test_every_block_runs(tmp_path: Path, cli, monkeypatch) -> None:
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```(python|bash)\n(.*?)```", DOC.read_text(), flags=re.S)
    assert [kind for kind, _ in blocks].count("python") == 4
    for kind, block in blocks:
        if kind == "python":
            exec(compile(block, str(DOC), "exec"), {"__name__": "docs"})
            continue
        for line in filter(str.strip, block.splitlines()):
            argv = shlex.split(line)
            assert argv[0] == "rolloutcli", line
            code, _, err = cli(*argv[1:])
            assert code == 0, (line, err)


def test_doc_is_short() -> None:
    assert len(DOC.read_bytes()) < 4500
