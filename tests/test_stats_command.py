"""``inspect --per-dim`` and ``stats --normalizer``: numpy's numbers, any budget, RSL-RL's EmpiricalNormalization."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from rollout_factory import rollout_arrays, write_rollout


def test_inspect_per_dim_matches_numpy_for_any_budget(tmp_path: Path, cli) -> None:
    arrays = rollout_arrays(T=30, N=7)
    arrays["observations/policy"][3, 2, 1] = np.nan
    arrays["observations/policy"][5, 0, 1] = np.inf
    source = write_rollout(tmp_path / "in.h5", arrays)
    reports = []
    for budget in ("1G", "2K"):
        code, out, err = cli("inspect", source, "--per-dim", "--json", "--max-memory", budget)
        assert code == 0, err
        reports.append(json.loads(out)["per_dim"])
    assert reports[0] == reports[1]
    policy = reports[0]["observations/policy"]
    values = arrays["observations/policy"].reshape(-1, 4).astype(np.float64)
    finite = np.where(np.isfinite(values), values, np.nan)
    np.testing.assert_allclose(policy["mean"], np.nanmean(finite, 0), rtol=1e-12)
    np.testing.assert_allclose(policy["std"], np.nanstd(finite, 0, ddof=1), rtol=1e-9)
    assert policy["min"] == np.nanmin(finite, 0).tolist() and policy["max"] == np.nanmax(finite, 0).tolist()
    assert policy["nonfinite"] == [0, 2, 0, 0] and policy["nonfinite_total"] == 2
    assert reports[0]["actions"]["shape"] == [2] and set(reports[0]) == {
        "observations/policy",
        "observations/critic",
        "actions",
    }
    code, out, _ = cli("inspect", source, "--per-dim")
    assert code == 0 and "observations/policy [4] per dimension" in out
    assert "observations/policy: 2 non-finite values counted, not averaged in" in out


def test_normalizer_loads_into_rsl_rl_and_normalizes_as_numpy(tmp_path: Path, cli) -> None:
    from rsl_rl.modules.normalization import EmpiricalNormalization

    arrays = rollout_arrays(T=25, N=6)
    rng = np.random.default_rng(1)
    arrays["observations/critic"] = (rng.standard_normal((25, 6, 5)) * [1, 10, 0.1, 3, 100] + 7).astype(np.float32)
    source = write_rollout(tmp_path / "in.h5", arrays)
    out_path = tmp_path / "norm.pt"
    code, out, err = cli("stats", source, "--normalizer", out_path, "--group", "critic", "--json", "--max-memory", "2K")
    assert code == 0, err
    assert json.loads(out)["count"] == 150
    module = EmpiricalNormalization(5)
    module.load_state_dict(torch.load(out_path))
    module.eval()
    x = arrays["observations/critic"].reshape(-1, 5)
    exact = x.astype(np.float64)
    want = (x - exact.mean(0).astype(np.float32)) / (np.sqrt(exact.var(0)).astype(np.float32) + np.float32(0.01))
    got = module(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert int(module.count) == 150


def test_normalizer_needs_a_known_group(tmp_path: Path, cli) -> None:
    source = write_rollout(tmp_path / "in.h5", rollout_arrays(T=5, N=2))
    code, _, err = cli("stats", source, "--normalizer", tmp_path / "n.pt", "--group", "images")
    assert code == 2
    assert err.strip() == (
        f"error: {source}: --group: expected one of the observation groups critic, policy, found 'images'. "
        "Pass --group NAME."
    )
    assert not (tmp_path / "n.pt").exists()


def test_per_dim_and_normalizer_over_a_dataset_are_those_of_all_rows(tmp_path: Path, cli) -> None:
    parts = [rollout_arrays(T=9, N=3, seed=1), rollout_arrays(T=14, N=2, seed=2)]
    folder = tmp_path / "runs"
    folder.mkdir()
    for i, arrays in enumerate(parts):
        write_rollout(folder / f"r{i}.h5", arrays)
    code, out, err = cli("inspect", folder, "--per-dim", "--json", "--max-memory", "2K")
    assert code == 0, err
    policy = json.loads(out)["per_dim"]["observations/policy"]
    rows = np.concatenate([a["observations/policy"].reshape(-1, 4) for a in parts]).astype(np.float64)
    np.testing.assert_allclose(policy["mean"], rows.mean(0), rtol=1e-12)
    np.testing.assert_allclose(policy["std"], rows.std(0, ddof=1), rtol=1e-9)
    assert policy["min"] == rows.min(0).tolist() and policy["max"] == rows.max(0).tolist()
    code, out, err = cli("stats", folder, "--normalizer", tmp_path / "n.pt", "--json")
    assert code == 0, err
    state = torch.load(tmp_path / "n.pt")
    assert int(state["count"]) == 9 * 3 + 14 * 2 == json.loads(out)["count"]
    assert torch.equal(state["_mean"], torch.tensor(rows.mean(0), dtype=torch.float64).reshape(1, 4).float())
    write_rollout(folder / "r2.h5", {**parts[0], "observations/policy": np.zeros((9, 3, 5), np.float32)})
    code, _, err = cli("stats", folder, "--normalizer", tmp_path / "m.pt")
    assert code == 1 and "r2.h5" in err and "observations/policy" in err and not (tmp_path / "m.pt").exists()


def test_stats_without_normalizer_prints_the_statistics_and_writes_nothing(tmp_path: Path, cli) -> None:
    """Issue 41.6: ``stats FILE`` alone was a usage error; it prints the statistics (``--normalizer`` writes)."""
    arrays = rollout_arrays(T=25, N=6)
    source = write_rollout(tmp_path / "in.h5", arrays)
    code, out, err = cli("stats", source)
    assert code == 0, err
    assert "observations/policy [4] per dimension" in out
    assert out.rstrip().splitlines()[-1] == "statistics of observations/policy [4] over 150 rows"
    code, out, err = cli("stats", source, "--json", "--group", "critic")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["output"] is None and summary["count"] == 150 and summary["group"] == "critic"
    rows = arrays["observations/critic"].reshape(150, -1).astype(np.float64)
    np.testing.assert_allclose(summary["per_dim"]["observations/critic"]["mean"], rows.mean(0), rtol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]
    code, out, err = cli("stats", source, "--normalizer", tmp_path / "n.pt")
    assert code == 0 and " ".join(out.split()).endswith(f"over 150 rows -> {tmp_path / 'n.pt'}")  # 80 columns
