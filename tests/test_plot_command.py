"""``rolloutcli plot``: files written, every panel titled and labelled, rows filled, episodes cut by the recording
(an RSL-RL rollout of T=24 steps), files without episodes, without matplotlib."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from rollout_factory import rollout_arrays, write_rollout

from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.plot import rollout_figure
from rolloutcli.pipeline.plot_figure import row_sizes

PANELS = {
    "episode returns",
    "episode lengths",
    "reward per step",
    "rewards distribution",
    "values distribution",
    "advantages distribution",
    "returns distribution",
    "dones and time-outs per env",
    "split padding blow-up by --max-length",
    "observations/policy: range per dimension",
    "observations/critic: range per dimension",
    "action[0] histogram",
    "action[1] histogram",
}


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("suffix", [".png", ".svg", ".html"])
def test_writes_the_report(tmp_path: Path, cli, suffix: str) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=40, N=6, end_rate=0.1))
    out = tmp_path / f"report{suffix}"
    code, stdout, err = cli("plot", source, "-o", out, "--max-memory", "4K")
    assert code == 0, err
    assert out.stat().st_size > 1000 and "13 panels" in stdout
    head = out.read_bytes()[:64]
    assert {".png": b"\x89PNG", ".svg": b"<?xml", ".html": b"<!doctype html>"}[suffix] in head


def test_every_panel_is_titled_and_blocks_do_not_matter(tmp_path: Path) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=40, N=6, end_rate=0.1))
    fig, data = rollout_figure(source, RunOptions(max_memory=4096))
    assert all(ax.get_title() for ax in fig.axes)
    assert {ax.get_title() for ax in fig.axes} == PANELS
    assert "no advantages in the file" in _texts(
        next(a for a in fig.axes if a.get_title() == "advantages distribution")
    )
    _, whole = rollout_figure(source)
    for key in ("returns", "lengths"):
        np.testing.assert_array_equal(np.sort(data["episodes"][key]), np.sort(whole["episodes"][key]))
    assert data["blowup"] == whole["blowup"]
    assert (data["distributions"]["rewards"].counts == whole["distributions"]["rewards"].counts).all()


def test_episode_returns_and_lengths_are_those_of_a_loop(tmp_path: Path) -> None:
    arrays = rollout_arrays(T=30, N=4, end_rate=0.2)
    source = write_rollout(tmp_path / "in.h5", arrays)
    _, data = rollout_figure(source)
    want = []
    for n in range(4):
        ends = np.flatnonzero(arrays["dones"][:, n])
        for a, b in itertools.pairwise(ends):  # episodes that start inside the recording
            want.append((b - a, float(arrays["rewards"][a + 1 : b + 1, n].astype(np.float64).sum())))
    got = sorted(zip(data["episodes"]["lengths"].tolist(), data["episodes"]["returns"].tolist(), strict=True))
    assert [g[0] for g in got] == [w[0] for w in sorted(want)]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in sorted(want)], rtol=1e-12)


def _rsl_rollout(path: Path, action_dim: int = 12) -> Path:
    """A typical RSL-RL rollout: T=24, N=64, episodes far longer than T (a few end), recorded mid-run."""
    arrays = rollout_arrays(T=24, N=64, end_rate=0.004, obs_dim=48, critic_dim=51, action_dim=action_dim, seed=3)
    arrays["advantages"] = arrays["values"] + 1
    arrays["returns"] = arrays["values"] + 2
    return write_rollout(path, arrays)


def _rows(fig) -> dict[int, list[range]]:
    rows: dict[int, list[range]] = {}
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        rows.setdefault(spec.rowspan.start, []).append(spec.colspan)
    return rows


def test_a_short_rsl_rollout_fills_every_panel_labels_every_axis_and_every_row(tmp_path: Path, cli) -> None:
    source = _rsl_rollout(tmp_path / "rsl.h5")
    fig, data = rollout_figure(source)
    episodes = data["episodes"]
    assert episodes["lengths"].size == 3 and episodes["partial_lengths"].size == 72 and episodes["ended"] == 11
    for ax in fig.axes:
        assert ax.has_data() and not _texts(ax), ax.get_title()
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
    for row, spans in _rows(fig).items():  # no lone panel: each row holds 2+ panels sharing its whole width
        assert len(spans) >= 2 and sorted(c for span in spans for c in span) == list(range(12)), row
    code, stdout, err = cli("plot", source, "-o", tmp_path / "r.png")
    assert code == 0, err
    assert "23 panels; episodes: 3 whole, 72 cut by the recording, 11 ended" in stdout
    assert all(len(line) <= 80 for line in stdout.splitlines())


def test_a_single_action_joins_the_main_grid(tmp_path: Path) -> None:
    fig, _ = rollout_figure(_rsl_rollout(tmp_path / "rsl.h5", action_dim=1))
    assert all(len(spans) >= 2 for spans in _rows(fig).values())


@pytest.mark.parametrize("most", [3, 4])
def test_rows_are_even_and_never_hold_one_panel_alone(most: int) -> None:
    for panels in range(2, 41):
        sizes = row_sizes(panels, most)
        assert sum(sizes) == panels and max(sizes) <= most and max(sizes) - min(sizes) <= 1 and min(sizes) >= 2


@pytest.mark.parametrize("from_reset", [False, True])
def test_cut_episodes_are_those_of_a_loop(tmp_path: Path, from_reset: bool) -> None:
    arrays = rollout_arrays(T=24, N=16, end_rate=0.05, seed=5)
    arrays["dones"][:, 0] = 0  # one env without a done: one episode cut at both ends
    arrays["dones"][-1, 1] = 1  # one env ending on the last step: no running tail
    arrays["time_outs"] &= arrays["dones"]
    source = write_rollout(tmp_path / "in.h5", arrays, {"recorded_from_reset": from_reset})
    _, data = rollout_figure(source)
    rewards, want = arrays["rewards"].astype(np.float64), []
    for n in range(16):
        ends = np.flatnonzero(arrays["dones"][:, n])
        if ends.size and not from_reset:
            want.append((ends[0] + 1, rewards[: ends[0] + 1, n].sum()))
        tail = ends[-1] + 1 if ends.size else 0
        if tail < 24:
            want.append((24 - tail, rewards[tail:, n].sum()))
    got = sorted(zip(data["episodes"]["partial_lengths"].tolist(), data["episodes"]["partial_returns"], strict=True))
    assert [g[0] for g in got] == [w[0] for w in sorted(want)]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in sorted(want)], rtol=1e-12)
    assert data["episodes"]["ended"] == int(arrays["dones"].sum())
    per_step = data["reward_per_step"]
    np.testing.assert_allclose(per_step["mean"], rewards.mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(per_step["std"], rewards.std(axis=1), rtol=1e-9)
    np.testing.assert_array_equal(per_step["max"], rewards.max(axis=1))


def test_a_gae_output_plots_the_raw_rewards_its_episodes_earned(tmp_path: Path, cli) -> None:
    source = _rsl_rollout(tmp_path / "rsl.h5")
    code, _, err = cli("gae", source, "-o", tmp_path / "gae.h5", "--timeouts", "rsl", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "gae.h5") as handle:  # the rsl rule bootstraps the time-outs in rewards
        assert handle.attrs["timeouts_bootstrapped"] and "rewards_raw" in handle
    fig, data = rollout_figure(tmp_path / "gae.h5")
    _, raw = rollout_figure(source)
    assert data["rewards_field"] == "rewards_raw" and raw["rewards_field"] == "rewards"
    for key in ("returns", "partial_returns"):
        np.testing.assert_array_equal(data["episodes"][key], raw["episodes"][key])
    np.testing.assert_array_equal(data["reward_per_step"]["mean"], raw["reward_per_step"]["mean"])
    assert all(ax.has_data() and not _texts(ax) for ax in fig.axes)  # advantages and returns too


def test_a_file_without_completed_episodes_shows_the_cut_ones(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=20, N=3)
    arrays["dones"][:] = 0
    arrays["time_outs"][:] = 0
    source = write_rollout(tmp_path / "in.h5", arrays)
    fig, data = rollout_figure(source)
    for title in ("episode returns", "episode lengths"):
        ax = next(a for a in fig.axes if a.get_title() == title)
        assert ax.has_data() and not _texts(ax)
    np.testing.assert_array_equal(data["episodes"]["partial_lengths"], [20, 20, 20])
    code, _, err = cli("plot", source, "-o", tmp_path / "r.png", "-q")
    assert code == 0, err


def test_without_matplotlib_exits_2(tmp_path: Path, cli, monkeypatch) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=5, N=2))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = cli("plot", source, "-o", tmp_path / "r.png")
    assert code == 2
    assert (
        err.strip()
        == 'error: plot: matplotlib is not installed; install the plot extra: pip install "rolloutcli[plot]".'
    )
    assert not (tmp_path / "r.png").exists()


def test_bad_suffix_exits_2(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=5, N=2))
    code, _, err = cli("plot", source, "-o", tmp_path / "r.jpg")
    assert code == 2 and "expected a file ending in .png, .svg, .html, found 'r.jpg'" in err


def test_streams_in_bounded_memory(tmp_path: Path) -> None:
    """A 96 MiB file under --max-memory 8M peaks at most 48 MiB above a tiny file's plot (the data is never whole)."""
    from test_memory_bounds import _peak_child

    peaks = []
    for name, (T, N) in (("tiny", (16, 4)), ("large", (3072, 64))):
        src = tmp_path / f"{name}.h5"
        with h5py.File(src, "w") as handle:
            rng = np.random.default_rng(0)
            handle["observations/policy"] = rng.standard_normal((T, N, 128), dtype=np.float32)
            handle["actions"] = rng.standard_normal((T, N, 2), dtype=np.float32)
            handle["rewards"] = rng.standard_normal((T, N), dtype=np.float32)
            handle["dones"] = (rng.random((T, N)) < 0.02).astype(np.uint8)
        code, err, peak = _peak_child(["plot", str(src), "-o", str(tmp_path / f"{name}.png"), "--max-memory", "8M"])
        assert code == 0, err
        peaks.append(peak)
    assert peaks[1] - peaks[0] < 48 * 1024, peaks
