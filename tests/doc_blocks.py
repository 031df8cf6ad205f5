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
    """Run ``found`` in ``folder`` (which gets ``sample_data/``); ``--address auto`` goes to the test cluster."""
    (folder / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(folder)
    address = None
    if any("--address auto" in code for _, code in found):
        address = request.getfixturevalue("ray_cluster")[1]
    for language, code in found:
        if language == "python":
            exec(compile(code, str(page), "exec"), {"__name__": "docs"})
            continue
        for line in filter(str.strip, code.splitlines()):
            argv = shlex.split(line.replace("--address auto", f"--address {address}"))
            assert argv[0] == "rolloutcli", line
            status, _, err = cli(*argv[1:])
            assert status == 0, (line, err)
