"""Every code block of docs/*.md runs, in document order, in a folder holding sample_data/."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO
from doc_blocks import blocks, run_blocks

PAGES = sorted((REPO / "docs").glob("*.md"))
WRITES = {
    "recording.md": ["my_rollout.h5", "rsl_rollouts/rollout_000000.h5", "sb3_gae.h5", "torchrl_gae.h5", "gym_gae.h5"]
}


ON_RAY = [p for p in PAGES if "--engine ray" in p.read_text()]  # run with the other tests on the cluster


@pytest.mark.parametrize("page", [p for p in PAGES if p not in ON_RAY], ids=lambda p: p.name)
def test_every_block_runs(page: Path, tmp_path: Path, cli, monkeypatch, request) -> None:
    run_blocks(page, blocks(page), cli, tmp_path, monkeypatch, request)
    for name in WRITES.get(page.name, []):  # the examples wrote what they say
        assert (tmp_path / name).is_file(), name


@pytest.mark.parametrize("page", ON_RAY, ids=lambda p: p.name)
def test_every_block_runs_on_the_test_cluster(page: Path, tmp_path: Path, cli, monkeypatch, request, ray_cluster):
    test_every_block_runs(page, tmp_path, cli, monkeypatch, request)
