"""``rolloutcli export --to robomimic|d4rl`` end to end: one long recording cut into consecutive files, exported
with a small memory budget (1K: episodes arrive in several chunks); every exported episode equals the long recording's
rows of its lane, and ``import`` reads the export back."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from rollout_factory import make_rollout
from test_episodes import cut, long_recording

from rolloutcli.pipeline.episodes import plan_episodes

KEYS = ("policy", "critic")


def after(arrays: dict[str, np.ndarray], ep) -> dict[str, np.ndarray]:
    """The observation after each step of ``ep``: the next one, after its last step the recorded one."""
    end = ep.start + ep.steps - 1
    out = {}
    for key in KEYS:
        rows = arrays[f"observations/{key}"][ep.start + 1 : end + 1, ep.lane]
        last = (
            arrays[f"last_observations/{key}"][ep.lane]
            if ep.partial_end
            else arrays[f"final_observations/{key}"][end, ep.lane]
        )
        out[key] = np.concatenate([rows, last[None]])
    return out


def episodes_of(path: Path, target: str) -> list[dict[str, np.ndarray]]:
    """The exported episodes, in order, as {name: rows}."""
    with h5py.File(path, "r") as f:
        if target == "robomimic":
            demos = sorted(f["data"], key=lambda d: int(d[5:]))
            return [
                {
                    **{f"obs/{k}": f[f"data/{d}/obs/{k}"][()] for k in KEYS},
                    **{f"next/{k}": f[f"data/{d}/next_obs/{k}"][()] for k in KEYS},
                    **{n: f[f"data/{d}/{n}"][()] for n in ("actions", "rewards", "dones")},
                }
                for d in demos
            ]
        flat = {n: f[n][()] for n in ("actions", "rewards", "terminals", "timeouts")}
        flat.update({f"obs/{k}": f[f"observations/{k}"][()] for k in KEYS})
        flat.update({f"next/{k}": f[f"next_observations/{k}"][()] for k in KEYS})
    ends = np.flatnonzero(flat["terminals"] | flat["timeouts"]) + 1
    return [{n: v[a:b] for n, v in flat.items()} for a, b in zip([0, *ends[:-1]], ends, strict=True)]


@pytest.mark.parametrize("target", ["robomimic", "d4rl"])
def test_export_equals_the_long_recording(tmp_path: Path, cli, target: str) -> None:
    arrays = long_recording(40, 3, seed=5)
    files = cut(tmp_path / "run", arrays, [7, 10, 13, 10])
    out = tmp_path / f"out.{target}.hdf5"
    code, _, err = cli(
        "export", tmp_path / "run", "--to", target, "-o", out, "--partial-episodes", "--max-memory", "1K"
    )
    assert code == 0, err
    plan = plan_episodes(files, [f.name for f in files], partial=True)
    got = episodes_of(out, target)
    assert len(got) == len(plan.episodes) and all(ep.has_next for ep in plan.episodes)
    for ep, episode in zip(plan.episodes, got, strict=True):
        rows = slice(ep.start, ep.start + ep.steps)
        nexts = after(arrays, ep)
        for key in KEYS:
            np.testing.assert_array_equal(episode[f"obs/{key}"], arrays[f"observations/{key}"][rows, ep.lane])
            np.testing.assert_array_equal(episode[f"next/{key}"], nexts[key])
        np.testing.assert_array_equal(episode["actions"], arrays["actions"][rows, ep.lane])
        np.testing.assert_array_equal(episode["rewards"], arrays["rewards"][rows, ep.lane].reshape(-1))
        end = "dones" if target == "robomimic" else "terminals"
        assert bool(episode[end][-1]) == ep.terminated
    code, _, err = cli("import", out, "-o", tmp_path / "back.h5", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "back.h5", "r") as f:
        assert f["dones"][()].sum() == len(plan.episodes)
        np.testing.assert_array_equal(f["observations/policy"][:, 0], np.concatenate([e["obs/policy"] for e in got]))


@pytest.mark.parametrize("target", ["minari", "robomimic", "d4rl"])
def test_nothing_to_export_is_refused(tmp_path: Path, cli, target: str) -> None:
    """One step whose next observation was not recorded: no target can hold it, and no empty output is made
    (found by the hypothesis table of tests/test_promises_input.py: robomimic tracebacked on an empty file)."""
    src = make_rollout(tmp_path / "in.h5", T=1, N=1, hidden=None)
    code, _, err = cli("export", src, "--to", target, "-o", tmp_path / "out-v0", "--partial-episodes")
    assert code == 1 and err.strip() == (
        f"error: {src}: field 'observations': expected an episode with a step to export (two steps, or the "
        "observation after its step recorded), found 1 one-step episodes without it. Record final_observations "
        "and last_observations, or longer episodes."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]
