"""The command line makes glibc return freed blocks of 1 MiB and more at once (``__main__.return_freed_memory``):
otherwise freed export blocks stayed in the heap and the 1e8-row export went past ``--max-memory`` + 300 MB."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHILD = """
import sys
import numpy as np
if sys.argv[1] == "fixed":
    from rolloutcli.__main__ import return_freed_memory
    return_freed_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
big = np.ones(16 << 20, np.uint8)
del big  # glibc's default: the mmap threshold rises to 16 MiB, so the blocks below come from the heap
blocks = [np.ones(2 << 20, np.uint8) for _ in range(64)]  # 128 MiB
top = np.ones(2 << 20, np.uint8)  # still in use, above them in the heap
before = rss()
del blocks
print(before - rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_blocks_go_back_to_the_system() -> None:
    def freed(mode: str) -> int:
        child = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
        return int(child.stdout)

    released = {mode: freed(mode) for mode in ("default", "fixed")}
    assert released["fixed"] > 120 << 20, released
    assert released["default"] < 16 << 20, released  # why the setting exists: glibc alone keeps them
