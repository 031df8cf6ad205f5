"""``batch --transitions``: every row against a step-by-step reference, any budget, held-back rows, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from rollout_factory import identifiable, rollout_arrays, write_rollout
from test_nstep_core import naive


def _rollout(path: Path, *, finals: bool = True, last: bool = True, **kwargs) -> tuple[Path, dict[str, np.ndarray]]:
    arrays = rollout_arrays(**kwargs)
    T, N = arrays["rewards"].shape
    for key, dim in (("policy", 4), ("critic", 5)):
        if finals:
            arrays[f"final_observations/{key}"] = -identifiable(T, N, dim)  # negative: told apart from observations
        if last:
            arrays[f"last_observations/{key}"] = identifiable(T + 1, N, dim)[T] + (0.5 if key == "critic" else 0.0)
    return write_rollout(path, arrays), arrays


def _rows(folder: Path, epoch: int = 0) -> dict[str, np.ndarray]:
    """Every row of one epoch's shards, ordered by source row."""
    manifest = json.loads((folder / "manifest.json").read_text())
    parts: dict[str, list[np.ndarray]] = {}
    for shard in manifest["shards"]:
        if shard["epoch"] != epoch:
            continue
        with h5py.File(folder / shard["file"], "r") as handle:
            handle.visititems(
                lambda name, obj: parts.setdefault(name, []).append(obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
    rows = {name: np.concatenate(values) for name, values in parts.items()}
    order = np.argsort(rows["index"])
    return {name: value[order] for name, value in rows.items()}


def _expected_next(arrays, key: str, t: int, n: int, m: int, nxt: int) -> np.ndarray:
    T = arrays["rewards"].shape[0]
    if nxt == -1:
        name = f"final_observations/{key}"
        return arrays[name][t + m - 1, n] if name in arrays else np.zeros_like(arrays[f"observations/{key}"][0, n])
    if nxt == T:
        return arrays[f"last_observations/{key}"][n]
    return arrays[f"observations/{key}"][nxt, n]


@pytest.mark.parametrize("budget", ["1G", "8K"])
def test_every_transition_matches_a_step_by_step_reference(tmp_path: Path, cli, budget: str) -> None:
    source, arrays = _rollout(tmp_path / "in.h5", T=30, N=5, end_rate=0.15)
    out = tmp_path / "shards"
    code, _, err = cli(
        "batch",
        source,
        "-o",
        out,
        "-m",
        "3",
        "--transitions",
        "--n-step",
        "3",
        "--gamma",
        "0.9",
        "--epochs",
        "2",
        "--max-memory",
        budget,
        "-q",
    )
    assert code == 0, err
    rows = _rows(out)
    T, N = arrays["rewards"].shape
    assert rows["index"].tolist() == list(range(T * N))  # nothing held back: last_observations are known
    returns, discount, nxt = naive(arrays["rewards"], arrays["dones"], arrays["time_outs"], 3, 0.9)
    for index in range(T * N):
        t, n = divmod(index, N)
        m = next(
            k
            for k in range(1, 4)
            if t + k == T or k == 3 or arrays["dones"][t + k - 1, n] or arrays["time_outs"][t + k - 1, n]
        )
        assert rows["rewards"][index] == returns[t, n] and rows["discount"][index] == discount[t, n]
        for key in ("policy", "critic"):
            np.testing.assert_array_equal(rows[f"observations/{key}"][index], arrays[f"observations/{key}"][t, n])
            want = _expected_next(arrays, key, t, n, m, int(nxt[t, n]))
            np.testing.assert_array_equal(rows[f"next_observations/{key}"][index], want)
        np.testing.assert_array_equal(rows["actions"][index], arrays["actions"][t, n])
        ended = nxt[t, n] == -1
        timed_out = ended and bool(arrays["time_outs"][t + m - 1, n])
        assert rows["terminated"][index] == (ended and not timed_out) and rows["truncated"][index] == timed_out
    second = _rows(out, epoch=1)
    assert all(np.array_equal(second[k], rows[k]) for k in rows)  # every epoch holds every transition once


def test_same_shards_for_any_budget(tmp_path: Path, cli) -> None:
    source, _ = _rollout(tmp_path / "in.h5", T=40, N=6, end_rate=0.1)
    digests = []
    for budget in ("1G", "8K"):
        out = tmp_path / f"shards-{budget}"
        code, _, err = cli(
            "batch", source, "-o", out, "-m", "4", "--transitions", "--n-step", "5", "--max-memory", budget, "-q"
        )
        assert code == 0, err
        digests.append([s["sha256"] for s in json.loads((out / "manifest.json").read_text())["shards"]])
    assert digests[0] == digests[1]


def test_unknown_bootstrap_observations_are_held_back(tmp_path: Path, cli) -> None:
    source, arrays = _rollout(tmp_path / "in.h5", last=False, T=20, N=4, end_rate=0.2)
    code, out, err = cli("batch", source, "-o", tmp_path / "s", "-m", "2", "--transitions", "--n-step", "4", "--json")
    assert code == 0, err
    _, _, nxt = naive(arrays["rewards"], arrays["dones"], arrays["time_outs"], 4, 0.99)
    held = int((nxt == 20).sum())
    assert held > 0 and json.loads(out)["held_back"] == held
    rows = _rows(tmp_path / "s")
    assert rows["index"].tolist() == np.flatnonzero(nxt.reshape(-1) != 20).tolist()
    code, out, _ = cli("batch", source, "-o", tmp_path / "s2", "-m", "2", "--transitions", "--n-step", "4")
    assert code == 0 and f"{held} held back (bootstrap observation unknown)" in out


def test_time_outs_need_final_observations(tmp_path: Path, cli) -> None:
    source, _ = _rollout(tmp_path / "in.h5", finals=False, T=20, N=4, end_rate=0.3, time_out_rate=1.0)
    code, _, err = cli("batch", source, "-o", tmp_path / "s", "-m", "2", "--transitions", "-q")
    assert code == 1 and "field 'final_observations'" in err and "--timeouts ignore" in err
    code, _, err = cli("batch", source, "-o", tmp_path / "s", "-m", "2", "--transitions", "--timeouts", "ignore", "-q")
    assert code == 0, err
    rows = _rows(tmp_path / "s")
    ended = rows["terminated"] == 1
    assert ended.any() and (rows["discount"][ended] == 0).all() and (rows["next_observations/policy"][ended] == 0).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n-step", "2"], "--n-step: expected --transitions with it, found none."),
        (["--transitions", "--recurrent"], "--transitions: expected none of --recurrent"),
        (
            ["--transitions", "--rsl-parity", "--history", "2"],
            "--transitions: expected none of --rsl-parity, --history (transitions are a mode of their own).",
        ),
        (
            ["--history", "2", "--recurrent", "--shuffle-envs"],
            "--history: expected none of --recurrent, --shuffle-envs (history windows are a mode of their own).",
        ),
        (["--across-episodes"], "--across-episodes: expected --history K with it, found none."),
        (["--observations", "policy"], "--observations: expected --history K with it, found none."),
        (["--timeouts", "ignore"], "--timeouts: expected --transitions with it, found none."),
        (["--transitions", "--gamma", "2"], "Invalid value for '--gamma'"),
    ],
)
def test_bad_options(tmp_path: Path, cli, args: list[str], message: str) -> None:
    source, _ = _rollout(tmp_path / "in.h5", T=20, N=2)
    code, _, err = cli("batch", source, "-o", tmp_path / "s", "-m", "2", *args, "-q")
    assert code == 2 and message in err, err
    assert not (tmp_path / "s").exists()


def test_batch_size_and_a_k_over_t_are_taken_as_in_the_other_modes(tmp_path: Path, cli) -> None:
    """Issue 41.6: ``--transitions --batch-size B`` was refused (M = ceil(transitions / B), as feed-forward rows
    are cut); ``--n-step 21`` on T = 20 too (the windows stop at the rollout's end, as ``nstep`` does)."""
    source, arrays = _rollout(tmp_path / "in.h5", T=20, N=5, end_rate=0.1)
    out = tmp_path / "s"
    code, _, err = cli("batch", source, "-o", out, "--transitions", "--batch-size", "30", "--n-step", "21", "-q")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["batch_size"] == 30 and manifest["options"]["num_mini_batches"] == 4  # 100 rows
    assert sorted(shard["rows"] for shard in manifest["shards"]) == [25, 25, 25, 25]
    returns, _, _ = naive(arrays["rewards"], arrays["dones"], arrays["time_outs"], 21, 0.99)
    assert _rows(out)["rewards"].tolist() == returns.reshape(-1).tolist()
    code, _, err = cli("batch", source, "-o", tmp_path / "s2", "-m", "2", "--transitions", "-q")
    assert code == 0 and "batch_size" not in json.loads((tmp_path / "s2" / "manifest.json").read_text())["options"]
    code, _, err = cli("batch", source, "-o", tmp_path / "s3", "--transitions", "--batch-size", "101")
    assert code == 2 and err.strip() == (
        "error: --batch-size: expected at most 100 (the transitions whose bootstrap observation is known), found "
        "101; a mini-batch cannot hold more than the data."
    )
    assert not (tmp_path / "s3").exists()
