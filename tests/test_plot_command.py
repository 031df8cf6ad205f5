"""``rolloutcli plot``: files written, every panel titled, files without episodes, without matplotlib."""

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

PANELS = {
    "episode returns",
    "episode lengths",
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
    assert out.stat().st_size > 1000 and "12 panels" in stdout
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


def test_a_file_without_completed_episodes_says_so(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=20, N=3)
    arrays["dones"][:] = 0
    arrays["time_outs"][:] = 0
    source = write_rollout(tmp_path / "in.h5", arrays)
    fig, _ = rollout_figure(source)
    for title in ("episode returns", "episode lengths"):
        assert _texts(next(a for a in fig.axes if a.get_title() == title)) == ["no completed episode"]
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
