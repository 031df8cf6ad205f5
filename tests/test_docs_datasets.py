"""Every block of docs/readme/h-datasets.md runs (commands in order in a folder holding sample_data/)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO

DOC = REPO / "docs" / "readme" / "h-datasets.md"


def _blocks(language: str) -> list[str]:
    return [block.strip() for block in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_every_block_runs(tmp_path: Path, cli, monkeypatch, ray_cluster) -> None:
    """``--address auto`` is pointed at the session's two-node test cluster."""
    _, address = ray_cluster
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    lines = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(lines) == 7
    for line in lines:
        argv = shlex.split(line.replace("--address auto", f"--address {address}"))
        assert argv[0] == "rolloutcli", line
        code, out, err = cli(*argv[1:])
        assert code == 0 and out, (line, err)
    assert (tmp_path / "shards" / "manifest.json").is_file()
    assert (
        tree(tmp_path / "trajectories") == tree(tmp_path / "trajectories_pool") == tree(tmp_path / "trajectories_ray")
    )
    for block in _blocks("python"):
        exec(compile(block, str(DOC), "exec"), {"__name__": "doc"})


def test_doc_is_short() -> None:
    assert len(DOC.read_bytes()) < 3_200
