"""Every code block of the README runs, in document order: the two setup commands, each command example, each
Python snippet (in a folder holding sample_data/)."""

from __future__ import annotations

import shlex
from pathlib import Path

from conftest import REPO
from doc_blocks import blocks, run_blocks

README = REPO / "README.md"


def _bash() -> list[str]:
    return [code for language, code in blocks(README) if language == "bash"]


def test_main_job_command_runs(tmp_path: Path, cli, monkeypatch) -> None:
    first = _bash()[0]
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
    second = _bash()[1]
    assert "python -m pytest" in second
    assert second in (REPO / ".ci" / "run").read_text()


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_every_example_runs(tmp_path: Path, cli, monkeypatch, request, ray_cluster) -> None:
    found = blocks(README)[2:]
    assert sum(language == "python" for language, _ in found) >= 3
    run_blocks(README, found, cli, tmp_path, monkeypatch, request)
    # the three engines of "Datasets and clusters" wrote the same bytes
    assert (
        _tree(tmp_path / "trajectories")
        == _tree(tmp_path / "trajectories_pool")
        == _tree(tmp_path / "trajectories_ray")
    )


def test_readme_is_short() -> None:
    assert len(README.read_bytes()) < 20_000  # details live in docs/ (tests/test_docs.py)


def test_the_cpu_torch_hint_comes_before_the_install() -> None:
    """A user reads the setup in order: the CPU build of torch goes in before ``pip install -e .`` (issue 41.1)."""
    text = README.read_text()
    assert text.index("https://download.pytorch.org/whl/cpu") < text.index("pip install -e .")
