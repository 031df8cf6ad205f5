"""Byte-mutation fuzzing of ``import`` (issue 40): mutants of a source of every layout (D4RL, Minari, robomimic,
ikostrikov in HDF5, ikostrikov as a ``torch.save`` zip) through ``rolloutcli import``, as
``test_promises_fuzz`` does for rollout files. The promise: only ``RolloutError`` ends a run (one ``error:``
line; 2 only for a budget a mutant's declared sizes exceed), nothing left behind, the input unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
from fuzzing import run_fuzz
from import_factory import make_ikostrikov, make_robomimic, write_arrays
from promises import make_input, repack

SEED = 20261206
PER_LAYOUT = 40
CHECKSUMMED = {"compression": "gzip", "shuffle": True, "fletcher32": True, "chunks": "thirds"}
LAYOUTS = ("d4rl", "minari", "robomimic", "ikostrikov", "torch")


def _minari(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        for k, length in enumerate((3, 5, 4)):
            g = f.create_group(f"episode_{k}")
            g["observations"] = np.arange((length + 1) * 2, dtype=np.float32).reshape(length + 1, 2)
            g["actions"], g["rewards"] = np.ones((length, 1), np.int64), np.full(length, k, np.float64)
            g["terminations"], g["truncations"] = np.arange(length) == length - 1, np.zeros(length, bool)
            g["infos/x"] = np.zeros((length + 1, 2), np.float32)
    return path


def import_bases(folder: Path) -> dict[str, Path]:
    import torch

    made = {
        "d4rl": make_input("d4rl", folder / "d4rl.h5", T=24, N=4, end_rate=0.25),
        "minari": _minari(folder / "minari.h5"),
        "robomimic": make_robomimic(folder / "robomimic.h5", [3, 5, 2]),
        "ikostrikov": write_arrays(folder / "ikostrikov.h5", make_ikostrikov(6, 3)),
    }
    bases = {layout: repack(path, **CHECKSUMMED) for layout, path in made.items()}
    bases["torch"] = folder / "storage.pt"
    torch.save({k: torch.as_tensor(v) for k, v in make_ikostrikov(6, 3).items()}, bases["torch"])
    return bases


def test_import_mutants_of_every_layout_fail_cleanly(tmp_path: Path) -> None:
    argv = ["import", "{src}", "-o", "{dst}", "-q", "--max-memory", "64K"]
    commands = [{"name": f"import {s}", "argv": argv, "source": s, "writes": True, "in_place": False} for s in LAYOUTS]
    report = run_fuzz(
        import_bases(tmp_path),
        commands,
        count=PER_LAYOUT * len(LAYOUTS),
        seed=SEED,
        timeout=60,
        workers=min(2, os.cpu_count() or 1),
        workdir=tmp_path,
    )
    print(report.summary())  # pytest -s shows the figures
    assert len(report.results) == PER_LAYOUT * len(LAYOUTS)
    assert report.problems == [], "\n".join(report.problems[:20])
    codes = {r["code"] for r in report.results}
    assert codes <= {0, 1, 2, 3, 4}, codes
    assert 0 in codes and 1 in codes  # the mutants do reach both sides
