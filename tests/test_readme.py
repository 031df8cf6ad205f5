"""The README's two setup commands: the first runs (its rolloutcli part), the second is what CI runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import REPO


def _bash_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_main_job_command_runs(tmp_path: Path, cli, monkeypatch) -> None:
    first = _bash_blocks()[0]
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && ")
    monkeypatch.chdir(REPO)
    steps = [step.strip() for step in first.split("&&") if step.strip().startswith("rolloutcli ")]
    assert [shlex.split(step)[1] for step in steps] == ["inspect", "gae", "batch"]
    for step in steps:
        argv = [arg.replace("/tmp/", f"{tmp_path}/") for arg in shlex.split(step)[1:]]
        code, out, err = cli(*argv, "--quiet")
        assert code == 0, (step, err)
        assert out
    manifest = (tmp_path / "cartpole_shards" / "manifest.json").read_text()
    assert '"mode": "recurrent"' in manifest


def test_ci_runs_the_readme_test_command() -> None:
    second = _bash_blocks()[1]
    assert "python -m pytest" in second
    assert second in (REPO / ".ci" / "run").read_text()
