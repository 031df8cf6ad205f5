"""Run the code blocks of a Markdown page in document order: each line of a ```bash block is one `rolloutcli`
command (run in-process), each ```python block is executed on its own. Used for README.md and docs/*.md."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO


def blocks(page: Path) -> list[tuple[str, str]]:
    """``(language, code)`` of every bash and python block, in document order."""
    return [(lang, code.strip()) for lang, code in re.findall(r"```(bash|python)\n(.*?)```", page.read_text(), re.S)]


def run_blocks(
    page: Path,
    found: list[tuple[str, str]],
    cli: Callable[..., tuple[int, str, str]],
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Run ``found`` in ``folder`` (which gets ``sample_data/``). ``# comment`` lines are skipped. A page that says
    ``--engine ray`` runs on the test cluster: ``--address auto`` and ``--address head:6379`` (a cluster's first
    machine) name it, and ``ray start`` lines (other machines) are checked with Ray's own parser, not run."""
    (folder / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(folder)
    address = None
    if any("--engine ray" in code for _, code in found):
        address = request.getfixturevalue("ray_cluster")[1]
    for language, code in found:
        if language == "python":
            exec(compile(code, str(page), "exec"), {"__name__": "docs"})
            continue
        for line in code.splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["ray", "start"]:
                _check_ray_start(argv[2:])
                continue
            if not argv:
                continue
            for i in range(1, len(argv)):
                if argv[i - 1] == "--address" and argv[i] in CLUSTER_ADDRESSES:
                    argv[i] = address
            assert argv[0] == "rolloutcli", line
            status, _, err = cli(*argv[1:])
            assert status == 0, (line, err)


CLUSTER_ADDRESSES = ("auto", "head:6379")  # what the pages call the cluster


def _check_ray_start(args: list[str]) -> None:
    """``ray start ARGS`` parses (options Ray knows), and joins the cluster the pages name."""
    from ray.scripts.scripts import start

    params = start.make_context("start", args).params
    assert params["head"] or params["address"] in CLUSTER_ADDRESSES, args
