"""``rolloutcli inspect``: exact episode statistics on a hand-built file, the sample, blockwise == whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import SAMPLE
from rollout_factory import rollout_arrays, write_rollout


def _known_file(tmp_path: Path) -> Path:
    """T=10, N=3. env 0: dones at 2, 5 (time-out), 9; env 1: none; env 2: every step."""
    arrays = rollout_arrays(T=10, N=3)
    dones = np.zeros((10, 3), np.uint8)
    dones[[2, 5, 9], 0] = 1
    dones[:, 2] = 1
    time_outs = np.zeros_like(dones)
    time_outs[5, 0] = 1
    time_outs[4, 2] = 1
    arrays["dones"], arrays["time_outs"] = dones, time_outs
    arrays["rewards"] = np.arange(30, dtype=np.float32).reshape(10, 3)
    return write_rollout(tmp_path / "known.h5", arrays)


def test_known_episode_counts(tmp_path: Path, cli) -> None:
    path = _known_file(tmp_path)
    code, out, err = cli("inspect", path, "--json", "--quiet")
    assert code == 0, err
    report = json.loads(out)
    assert report["T"] == 10 and report["N"] == 3
    episodes = report["episodes"]
    assert episodes["completed"] == 13
    assert episodes["time_outs"] == 2 and episodes["terminations"] == 11
    assert episodes["started_before_recording"] == 2  # env 0's first (t=0..2) and env 2's first (t=0)
    assert episodes["unfinished"] == 1  # env 1 never ends
    assert episodes["per_env"]["counts"] == [3, 0, 10]
    # fully recorded lengths: env 0: 3 (3..5), 4 (6..9); env 2: nine episodes of length 1
    assert episodes["lengths"] == {
        "count": 11,
        "min": 1,
        "mean": 16 / 11,
        "max": 4,
        "p5": 1,
        "p25": 1,
        "p50": 1,
        "p75": 1,
        "p95": 4,
    }
    assert report["rewards"]["mean"] == 14.5 and report["rewards"]["min"] == 0 and report["rewards"]["max"] == 29
    assert abs(report["rewards"]["std"] - np.arange(30).std(ddof=1)) < 1e-9
    # RSL-RL's split: dones[:-1] count + N = (2 + 0 + 9) + 3
    assert report["split"]["trajectories"] == 14
    assert {f["name"] for f in report["fields"]} >= {"rewards", "dones", "observations/policy"}
    for key in ("T", "N", "fields", "episodes", "rewards"):
        assert key in report


def test_tiny_memory_budget_gives_same_report(tmp_path: Path, cli) -> None:
    path = write_rollout(tmp_path / "big.h5", rollout_arrays(T=50, N=40, end_rate=0.1))
    _, whole, _ = cli("inspect", path, "--json")
    _, blocked, _ = cli("inspect", path, "--json", "--max-memory", "1K")
    whole_report, blocked_report = json.loads(whole), json.loads(blocked)
    for key in ("rewards", "values", "returns"):
        if whole_report[key]:
            for stat in ("count", "min", "max", "nonfinite"):
                assert whole_report[key][stat] == blocked_report[key][stat]
            assert abs(whole_report[key]["mean"] - blocked_report[key]["mean"]) < 1e-9
            assert abs(whole_report[key]["std"] - blocked_report[key]["std"]) < 1e-9
    assert whole_report["episodes"] == blocked_report["episodes"]


def test_inspect_sample_text(cli) -> None:
    code, out, _ = cli("inspect", SAMPLE)
    assert code == 0
    assert "T=256 steps x N=16 envs" in out
    assert "hidden state (actor): GRU, 1 layer(s), size 16" in out
    assert "episodes: 73 completed (31 terminations, 42 time-outs)" in out


def test_warnings(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=40, N=2, end_rate=0.6)
    arrays.pop("last_values")
    path = write_rollout(tmp_path / "w.h5", arrays)
    report = json.loads(cli("inspect", path, "--json")[1])
    text = " ".join(report["warnings"])
    assert "no 'last_values'" in text and "--last-values zero" in text
    assert "split would pad the per-step data" in text and "--pad-to longest" in text


def test_gae_traces_without_advantages_warn(tmp_path: Path, cli) -> None:
    """gae's attributes without ``advantages`` warn; ``timeouts_bootstrapped`` alone (a recorder's flag) does not."""
    warning = "'advantages' and the gae attributes disagree (one without the other)"
    for attrs, warns in (({"timeouts_bootstrapped": True}, False), ({"gae_gamma": 0.99}, True)):
        path = write_rollout(tmp_path / f"{warns}.h5", rollout_arrays(T=8, N=2), attrs)
        report = json.loads(cli("inspect", path, "--json")[1])
        assert any(warning in line for line in report["warnings"]) == warns, report["warnings"]


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); from rolloutcli.cli.app import main; "
        "rc = main(['--help']); assert rc == 0, rc; "
        "assert 'torch' not in sys.modules and 'h5py' not in sys.modules, 'heavy import'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "inspect" in result.stdout


def test_python_dash_m(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rolloutcli", "inspect", str(SAMPLE), "--json", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["N"] == 16


def test_episode_stats_leave_autoreset_steps_out() -> None:
    from rolloutcli.core.stats import EpisodeStats

    # env 0: episodes of 2 and 3 steps around an autoreset step; env 1: an autoreset step first (the file
    # starts after an episode end), then one whole episode of 2 steps and one unfinished
    dones = np.array([[0, 1], [1, 0], [1, 1], [0, 0], [0, 0], [1, 0]], np.uint8)
    reset = np.array([[0, 1], [0, 0], [1, 0], [0, 0], [0, 0], [0, 0]], np.uint8)
    stats = EpisodeStats.of(dones, None, from_reset=False, autoreset=reset)
    assert (stats.completed, stats.autoreset_steps, stats.first_completed, stats.unfinished) == (3, 2, 1, 1)
    assert stats.per_env == [2, 1] and np.flatnonzero(stats.length_counts).tolist() == [2, 3]
    assert stats.length_counts[2] == 1 and stats.length_counts[3] == 1  # env 0's first episode is partial
    assert stats.trajectories == EpisodeStats.of(dones).trajectories  # split still cuts there
