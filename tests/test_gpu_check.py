"""``benchmarks/gpu_check.py --quick`` runs its CPU side and exits 0 here; on a CUDA machine, every check passes."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import REPO


def test_gpu_check_quick_runs_and_reports() -> None:
    script = REPO / "benchmarks" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.splitlines()[0].startswith("check ") and "compute_gae cpu vs RSL-RL loop" in out
    assert "loop ShardDataset" in out and "loop RolloutDataset" in out and "| NO" not in out
    if torch.cuda.is_available():
        assert "compute_gae cuda vs cpu kernel" in out and "split/pad cuda vs cpu" in out
    else:
        assert "no CUDA device: ran the CPU side only" in out
