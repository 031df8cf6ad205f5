"""A dataset run talks as a single file does: progress over files and bytes on a terminal, then the command's own
summary over all files (``--json``: per file and in total), and one line for the files ``gae`` gave the default
time-out rule (issue 41, item 4)."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from rich.console import Console
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.cli import render
from rolloutcli.core.moments import Moments
from rolloutcli.pipeline.dataset_totals import Totals


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # short relative paths: exact lines at 80 columns
    (tmp_path / "runs" / "a").mkdir(parents=True)
    write_rollout(tmp_path / "runs" / "a" / "r1.h5", rollout_arrays(T=12, N=3, seed=1))
    write_rollout(tmp_path / "runs" / "r0.h5", rollout_arrays(T=20, N=2, seed=2))
    write_rollout(tmp_path / "runs" / "r2.h5", rollout_arrays(T=12, N=4, seed=3), {"timeouts_rule": "rsl"})
    return Path("runs")


NAMES = ["a/r1.h5", "r0.h5", "r2.h5"]


def test_gae_on_a_dataset_prints_its_summary_over_all_files(cli, runs: Path, tmp_path: Path) -> None:
    code, out, err = cli("gae", runs, "-o", "out")
    assert code == 0, err
    # one line for the files without a rule; no progress bar into a pipe
    assert err == "warning: 2 of 3 files lack timeouts_rule: applied --timeouts rsl to them\n"
    lines = out.splitlines()
    assert lines[:3] == [
        "Wrote 3 files and dataset.json to out",
        "gae 3 files -> out  (T=12-20, N=9, 3 env block(s))",
        "gamma 0.99  lambda 0.95  normalized True  last values: recorded",
    ]
    assert lines[3] == "time-outs: rsl (default: the file names none) in 2 files; rsl (the file's"
    assert lines[4] == "  timeouts_rule) in 1 file; 10 rewards bootstrapped"
    assert lines[5].startswith("advantages: mean ") and lines[6].startswith("returns: mean ")
    assert lines[7].startswith("done in ") and len(lines) == 8
    assert all(len(line) <= 80 for line in lines)
    # the statistics are those of all files' values together
    values = {k: np.concatenate([h5py.File(tmp_path / "out" / n)[k][()].ravel() for n in NAMES]) for k in ("returns",)}
    expected = values["returns"].astype(np.float64)
    assert lines[6].startswith(f"returns: mean {expected.mean():.4g}  std {expected.std(ddof=1):.4g}  ")
    code, _, err = cli("gae", runs, "-o", tmp_path / "explicit", "--timeouts", "rsl")
    assert code == 0 and err == ""


def test_json_gives_each_file_and_the_total(cli, runs: Path, tmp_path: Path) -> None:
    code, out, _ = cli("gae", runs, "-o", tmp_path / "out", "--json")
    assert code == 0
    report = json.loads(out)
    rows, total = report["per_file"], report["total"]
    assert [row["name"] for row in rows] == NAMES
    assert all(len(json.dumps(row)) < 200 for row in rows)  # a row per file stays small (10,000 files)
    singles = []
    for name in NAMES:
        code, single, _ = cli("gae", runs / name, "-o", tmp_path / "single.h5", "--overwrite", "--json")
        singles.append(json.loads(single))
    for row, single in zip(rows, singles, strict=True):
        for key in ("T", "N", "bootstrapped_rewards"):
            assert row[key] == single[key]
    assert total["bootstrapped_rewards"] == sum(s["bootstrapped_rewards"] for s in singles) == 10
    assert total["steps"] == sum(s["T"] * s["N"] for s in singles) == 124
    assert (total["T"], total["N"], total["input"]) == ("12-20", 9, "3 files")
    assert total["timeouts_files"] == {"rsl (default: the file names none)": 2, "rsl (the file's timeouts_rule)": 1}
    assert total["returns"]["count"] == 124
    assert total["returns"]["min"] == min(s["returns"]["min"] for s in singles)
    assert sum(row["bytes_written"] for row in rows) == report["bytes_written"]


def test_split_on_a_dataset_prints_its_summary_over_all_files(cli, runs: Path, tmp_path: Path) -> None:
    code, out, _ = cli("split", runs, "-o", "out", "--workers", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[:-1] == [
        "Wrote 3 files and dataset.json to out",
        "split 3 files -> out: 28 trajectories from N=9 envs, padded to L=12-20 (rollout)",
        "trajectory length: min 1  mean 4.429  median -  p95 -  max 12",
        "padding overhead: 29.9 KiB from 9.0 KiB (3.33x)  10 fields, 3 env block(s)",
    ]
    assert lines[-1].startswith("done in ")


def test_the_progress_bar_counts_files_and_bytes_on_a_terminal(cli, runs, tmp_path, monkeypatch) -> None:
    screen = io.StringIO()
    terminal = Console(
        file=screen, force_terminal=True, color_system=None, width=80, highlight=False, markup=False, emoji=False
    )
    monkeypatch.setattr(render, "stderr", terminal)
    code, _, _ = cli("split", runs, "-o", tmp_path / "out")
    assert code == 0
    drawn, size = screen.getvalue(), sum(p.stat().st_size for p in runs.rglob("*.h5")) / 1024
    assert "split: 0/3 files" in drawn and f" 0.0/{size:.1f} KiB " in drawn
    assert "split: 3/3 files" in drawn and f" {size:.1f}/{size:.1f} KiB " in drawn
    frames = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn))
    assert max(len(frame.rstrip()) for frame in frames) <= 80
    screen.truncate(0)
    assert cli("split", runs, "-o", tmp_path / "quiet", "--quiet")[0] == 0
    assert screen.getvalue() == ""


def test_totals_stay_flat_and_merge_exactly() -> None:
    totals, everything = Totals(), Moments()
    rng = np.random.default_rng(0)
    for i in range(10_000):
        values = rng.normal(i % 7, 1 + i % 3, size=5)
        moments = Moments.of(values)
        everything = everything.merge(moments)
        summary = {"T": 5, "N": 1, "blocks": 1, "gamma": 0.99, "returns": moments.as_dict(), "fields": ["a"] * 30}
        totals.add(i, f"runs/file_{i:05d}.h5", 1000, summary)
    result = totals.result("out")
    assert result["steps"] == 50_000 and result["N"] == 10_000 and result["T"] == "5" and result["gamma"] == 0.99
    assert result["returns"]["count"] == 50_000
    assert math.isclose(result["returns"]["mean"], everything.mean, rel_tol=1e-12)
    assert math.isclose(result["returns"]["std"], everything.std, rel_tol=1e-9)
    assert max(len(json.dumps(row)) for row in totals.per_file()) < 200
