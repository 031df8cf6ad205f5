"""``rolloutcli import``: each layout round-trips (every episode back from ``split``, counted by ``inspect``),
bad input is refused with one line and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from import_factory import make_d4rl, make_ikostrikov, make_minari, make_robomimic, obs_rows, write_arrays

from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.split import SplitOptions, run_split


def _import(cli, src: Path, out: Path, *extra: str) -> dict:
    code, stdout, err = cli("import", src, "-o", out, "--json", *extra)
    assert code == 0, err
    return json.loads(stdout)


def _episodes_back(out: Path, tmp_path: Path) -> list[dict[str, np.ndarray]]:
    """Every trajectory ``split`` gives back from ``out``, as {field: rows}."""
    split = tmp_path / "split.h5"
    run_split(out, split, SplitOptions("longest"), RunOptions())
    with h5py.File(split) as f:
        lengths = f["trajectory_length"][:]
        names = [n for n in ("observations/policy", "observations/pos", "actions", "rewards") if n in f]
        return [{n: f[n][: lengths[m], m] for n in names} for m in range(len(lengths))]


def _inspect(cli, out: Path) -> dict:
    code, stdout, err = cli("inspect", out, "--json", "-q")
    assert code == 0, err
    return json.loads(stdout)


def test_d4rl_round_trip(tmp_path: Path, cli) -> None:
    lengths = [3, 4, 2, 5]
    src = make_d4rl(tmp_path / "d4rl.hdf5", lengths, timeout_at=(1,))
    summary = _import(cli, src, tmp_path / "out.h5")
    assert (summary["layout"], summary["T"], summary["N"], summary["episodes"]) == ("d4rl", 14, 1, 4)
    with h5py.File(tmp_path / "out.h5") as f:
        ends = np.cumsum(lengths) - 1
        assert np.flatnonzero(f["dones"][:, 0]).tolist() == ends.tolist()
        assert np.flatnonzero(f["time_outs"][:, 0]).tolist() == [ends[1]]
        assert np.array_equal(f["final_observations/policy"][ends, 0], obs_rows(0, 14)[ends] + 5)
        assert np.array_equal(f["last_observations/policy"][0], obs_rows(13, 1)[0] + 5)
        assert f["infos/qpos"].shape == (14, 1, 2) and f["metadata/algorithm"][()] == b"SAC"
        assert f.attrs["recorded_from_reset"] and f.attrs["imported_from"] == "d4rl"
    back = _episodes_back(tmp_path / "out.h5", tmp_path)
    starts = np.cumsum([0, *lengths[:-1]])
    assert [len(e["rewards"]) for e in back] == lengths
    for episode, start, length in zip(back, starts, lengths, strict=True):
        assert np.array_equal(episode["observations/policy"], obs_rows(start, length))
    report = _inspect(cli, tmp_path / "out.h5")
    assert report["episodes"]["completed"] == 4 and report["episodes"]["started_before_recording"] == 0
    assert report["episodes"]["lengths"]["count"] == 4


def test_d4rl_last_episode_cut_is_kept(tmp_path: Path, cli) -> None:
    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4], cut_last=True, next_obs=False)
    summary = _import(cli, src, tmp_path / "out.h5")
    assert summary["episodes"] == 2 and summary["T"] == 7
    assert [len(e["rewards"]) for e in _episodes_back(tmp_path / "out.h5", tmp_path)] == [3, 4]


def test_robomimic_round_trip(tmp_path: Path, cli) -> None:
    lengths = [3, 2, 4]
    src = make_robomimic(tmp_path / "demo.hdf5", lengths)
    summary = _import(cli, src, tmp_path / "out.h5")
    assert (summary["layout"], summary["T"], summary["episodes"]) == ("robomimic", 9, 3)
    ends = np.cumsum(lengths) - 1
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.flatnonzero(f["dones"][:, 0]).tolist() == ends.tolist()
        assert f["time_outs"][ends, 0].tolist() == [0, 1, 0]  # demo 1 stops without its done flag
        assert np.array_equal(f["final_observations/pos"][ends, 0], obs_rows(0, 9)[ends] + 5)
        assert f["final_observations/img"][ends, 0, 0, 0].tolist() == [100, 101, 102]
        assert f["states"].shape == (9, 1, 4) and f["initial_state/joint"][[0, 3, 5], 0, 0].tolist() == [0, 1, 2]
        assert f["mask/train"][:].tolist() == [b"demo_0", b"demo_1", b"demo_2"]
        assert f.attrs["source_env_args"] == '{"env_name": "Lift"}'
    back = _episodes_back(tmp_path / "out.h5", tmp_path)
    assert [len(e["actions"]) for e in back] == lengths
    assert np.array_equal(back[2]["observations/pos"], obs_rows(5, 4))
    assert _inspect(cli, tmp_path / "out.h5")["episodes"]["completed"] == 3


def test_isaac_lab_demo_without_rewards(tmp_path: Path, cli) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [2, 3], rewards=False, next_obs=False)
    _import(cli, src, tmp_path / "out.h5", "--from", "robomimic")
    with h5py.File(tmp_path / "out.h5") as f:
        assert not f.attrs["rewards_recorded"] and f["rewards"].shape == (5, 1)
        assert "final_observations" not in f


@pytest.mark.parametrize("dict_obs", [False, True])
def test_minari_round_trip(tmp_path: Path, cli, dict_obs: bool) -> None:
    folder, dataset = make_minari(tmp_path / "minari", 4, dict_obs=dict_obs)
    summary = _import(cli, folder, tmp_path / "out.h5")
    episodes = list(dataset.iterate_episodes())
    lengths = [len(e.rewards) for e in episodes]
    assert (summary["layout"], summary["episodes"], summary["T"]) == ("minari", 4, sum(lengths))
    key = "observations/pos" if dict_obs else "observations/policy"
    with h5py.File(tmp_path / "out.h5") as f:
        ends = np.cumsum(lengths) - 1
        final = f["final_observations/pos" if dict_obs else "final_observations/policy"][ends, 0]
        if dict_obs:
            assert f["observations/vel/v"].shape == (sum(lengths), 1, 2)
        for m, episode in enumerate(episodes):
            obs = episode.observations["pos"] if dict_obs else episode.observations
            assert np.array_equal(final[m], obs[-1])
            assert bool(f["time_outs"][ends[m], 0]) == bool(episode.truncations[-1] and not episode.terminations[-1])
        assert json.loads(f.attrs["source_metadata"])["total_episodes"] == 4
    back = _episodes_back(tmp_path / "out.h5", tmp_path)
    for episode, got in zip(episodes, back, strict=True):
        obs = episode.observations["pos"] if dict_obs else episode.observations
        assert np.array_equal(got[key], obs[:-1])
        assert np.array_equal(got["rewards"], episode.rewards)
    assert _inspect(cli, tmp_path / "out.h5")["episodes"]["completed"] == 4
    # the data file alone imports the same
    _import(cli, folder / "data" / "main_data.hdf5", tmp_path / "file.h5")
    with h5py.File(tmp_path / "out.h5") as a, h5py.File(tmp_path / "file.h5") as b:
        assert np.array_equal(a[key][:], b[key][:])


@pytest.mark.parametrize("saved", ["hdf5", "torch"])
def test_ikostrikov_round_trip(tmp_path: Path, cli, saved: str) -> None:
    T, N = 6, 3
    arrays = make_ikostrikov(T, N)
    if saved == "torch":
        import torch

        src = tmp_path / "storage.pt"
        torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, src)
    else:
        src = write_arrays(tmp_path / "storage.h5", arrays)
    summary = _import(cli, src, tmp_path / "out.h5")
    assert (summary["layout"], summary["T"], summary["N"]) == ("ikostrikov", T, N)
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["dones"][:], 1 - arrays["masks"][1:, :, 0])
        assert np.array_equal(f["time_outs"][:], 1 - arrays["bad_masks"][1:, :, 0])
        assert np.array_equal(f["last_values"][:], arrays["value_preds"][T])
        assert np.array_equal(f["values"][:], arrays["value_preds"][:T])
        assert np.array_equal(f["observations/policy"][:], arrays["obs"][:T])
        assert np.array_equal(f["last_observations/policy"][:], arrays["obs"][T])
        assert np.array_equal(f["hidden_states/actor/0"][:, 0], arrays["recurrent_hidden_states"][:T])
        assert np.array_equal(f["last_hidden_states"][:], arrays["recurrent_hidden_states"][T])
        assert np.array_equal(f["actions_log_prob"][:], arrays["action_log_probs"])
    code, _, err = cli("gae", tmp_path / "out.h5", "-o", tmp_path / "gae.h5", "-q")
    assert code == 0, err


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    timeouts=st.sets(st.integers(0, 5)),
    cut_last=st.booleans(),
)
def test_d4rl_episodes_come_back_whole(tmp_path_factory, lengths: list[int], timeouts: set, cut_last: bool) -> None:
    """Property: any episode lengths, ends and a cut last episode: split gives back each episode exactly."""
    folder = tmp_path_factory.mktemp("d4rl")
    src = make_d4rl(folder / "d4rl.hdf5", lengths, timeout_at=tuple(timeouts), cut_last=cut_last)
    from rolloutcli.pipeline.importer import run_import

    summary = run_import(src, folder / "out.h5", "auto", RunOptions(max_memory=1024))
    assert summary["episodes"] == len(lengths) and summary["T"] == sum(lengths)
    back = _episodes_back(folder / "out.h5", folder)
    starts = np.cumsum([0, *lengths[:-1]])
    assert [len(e["rewards"]) for e in back] == lengths
    for episode, start, length in zip(back, starts, lengths, strict=True):
        assert np.array_equal(episode["observations/policy"], obs_rows(start, length))
        assert np.array_equal(episode["rewards"], np.arange(start, start + length, dtype=np.float32))


def test_small_budget_gives_same_bytes(tmp_path: Path, cli) -> None:
    src = make_d4rl(tmp_path / "d4rl.hdf5", [30, 40, 20])
    _import(cli, src, tmp_path / "a.h5")
    _import(cli, src, tmp_path / "b.h5", "--max-memory", "1K")
    assert (tmp_path / "a.h5").read_bytes() == (tmp_path / "b.h5").read_bytes()


def test_stored_dtypes_come_through_every_block_size(tmp_path: Path, cli) -> None:
    """Blocks read into one reused buffer keep each dataset's dtype and values: big-endian, half, bool, enum,
    complex and string rows, whatever ``--max-memory`` cuts them into."""
    T = 40
    enum = h5py.enum_dtype({"OFF": 0, "ON": 1}, basetype="i1")
    src = make_d4rl(tmp_path / "d4rl.hdf5", [15, 25])
    with h5py.File(src, "a") as f:
        obs = f["observations"][:]
        del f["observations"]
        f.create_dataset("observations", data=obs.astype(">f8"))
        f["infos/half"] = np.arange(T, dtype=np.float16)
        f["infos/flag"] = np.arange(T) % 3 == 0
        f.create_dataset("infos/state", data=(np.arange(T) % 2).astype(np.int8), dtype=enum)
        f["infos/wave"] = np.arange(T) * (1 - 2j)
        f["infos/name"] = np.array([f"s{t}".encode() for t in range(T)])
    _import(cli, src, tmp_path / "a.h5")
    _import(cli, src, tmp_path / "b.h5", "--max-memory", "1K")
    assert (tmp_path / "a.h5").read_bytes() == (tmp_path / "b.h5").read_bytes()
    with h5py.File(src) as f, h5py.File(tmp_path / "b.h5") as out:
        assert out["observations/policy"].dtype == np.dtype(">f8")
        assert np.array_equal(out["observations/policy"][:, 0], obs.astype(np.float64))
        for key in ("half", "flag", "state", "wave", "name"):
            assert out[f"infos/{key}"].dtype == f[f"infos/{key}"].dtype, key
            assert np.array_equal(out[f"infos/{key}"][:, 0], f[f"infos/{key}"][:]), key
        assert h5py.check_enum_dtype(out["infos/state"].dtype) == {"OFF": 0, "ON": 1}


# ------------------------------------------------------------------------------------------------ bad input


def _refused(cli, tmp_path: Path, src: Path, code: int, *words: str, extra: tuple[str, ...] = ()) -> str:
    out = tmp_path / "out.h5"
    got, _, err = cli("import", src, "-o", out, "-q", *extra)
    assert got == code, err
    assert len(err.strip().splitlines()) == 1 and all(w in err for w in words), err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "rolloutcli-tmp" in p.name]
    return err


def test_unrecognised_layout(tmp_path: Path, cli) -> None:
    src = write_arrays(tmp_path / "x.h5", {"foo": np.zeros(3), "bar/baz": np.zeros(2)})
    err = _refused(cli, tmp_path, src, 1, "unrecognised layout", "d4rl:", "minari:", "robomimic:", "found bar, foo")
    assert "ikostrikov:" in err
    err = _refused(cli, tmp_path, src, 1, "looked for d4rl:", extra=("--from", "d4rl"))
    assert err.strip().endswith("found bar, foo. Leave out --from (or pass --from auto) to recognise the layout.")


def test_a_rollout_file_is_not_imported(tmp_path: Path, cli) -> None:
    """A user who runs ``import`` on a file that already is a rollout (the sample) is told so (exit 1: the file
    decides it, and exit 2 never comes from a file)."""
    src = Path(__file__).resolve().parents[1] / "sample_data" / "cartpole_gru.h5"
    err = _refused(cli, tmp_path, src, 1)
    assert err.strip() == (
        f"error: {src}: already a rollout file (rolloutcli_format = rollout): nothing to import. "
        "Pass it to the other commands as it is."
    )


def test_episode_lengths_disagree(tmp_path: Path, cli) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [3, 2])
    with h5py.File(src, "a") as f:
        del f["data/demo_1/states"]
        f["data/demo_1/states"] = np.zeros((5, 4))
    _refused(cli, tmp_path, src, 1, "episode 'data/demo_1'", "data/demo_1/states", "5 rows, expected 2")


def test_robomimic_next_obs_length_disagrees(tmp_path: Path, cli) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [3, 4])
    with h5py.File(src, "a") as f:
        del f["data/demo_1/next_obs/pos"]
        f["data/demo_1/next_obs/pos"] = np.zeros((2, 3), np.float32)
    _refused(cli, tmp_path, src, 1, "episode 'data/demo_1'", "next_obs/pos' has 2 rows, expected 4")


def test_minari_empty_episode(tmp_path: Path, cli) -> None:
    folder, _ = make_minari(tmp_path / "minari", 2)
    with h5py.File(folder / "data" / "main_data.hdf5", "a") as f:
        for name in ("actions", "rewards", "terminations", "truncations", "observations"):
            del f[f"episode_1/{name}"]
            f[f"episode_1/{name}"] = np.zeros((1, 4) if name == "observations" else (0,))
    _refused(cli, tmp_path, folder, 1, "episode 'episode_1': expected at least one step, found 0")


def test_minari_episode_lengths_disagree(tmp_path: Path, cli) -> None:
    folder, _ = make_minari(tmp_path / "minari", 2)
    with h5py.File(folder / "data" / "main_data.hdf5", "a") as f:
        del f["episode_1/rewards"]
        f["episode_1/rewards"] = np.zeros(2)
    _refused(cli, tmp_path, folder, 1, "episode 'episode_1'", "disagree in length")


def test_minari_folder_without_metadata(tmp_path: Path, cli) -> None:
    folder, _ = make_minari(tmp_path / "minari", 2)
    (folder / "data" / "metadata.json").unlink()
    _refused(cli, tmp_path, folder, 1, "without data/metadata.json")


def test_d4rl_lengths_disagree(tmp_path: Path, cli) -> None:
    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4])
    with h5py.File(src, "a") as f:
        del f["actions"]
        f["actions"] = np.zeros((6, 2))
    _refused(cli, tmp_path, src, 1, "field 'actions'", "7 rows", "found 6 rows")


def test_ikostrikov_inconsistent_rows(tmp_path: Path, cli) -> None:
    arrays = make_ikostrikov(5, 2)
    arrays["masks"] = arrays["masks"][:5]
    src = write_arrays(tmp_path / "storage.h5", arrays)
    _refused(cli, tmp_path, src, 1, "field 'masks'", "T+1 = 6 rows", "found 5 rows")


def test_plugin_filter_is_unsafe(tmp_path: Path, cli) -> None:
    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4])
    with h5py.File(src, "a") as f:
        del f["actions"]
        f.create_dataset("actions", data=np.zeros((7, 2)), chunks=(7, 2), compression=32001, allow_unknown_filter=True)
    _refused(cli, tmp_path, src, 4, "blosc", "h5repack -f NONE")


def test_gae_on_an_import_names_returns(tmp_path: Path, cli) -> None:
    """An imported recording has no critic: gae refuses it and names the command that does work."""
    out = tmp_path / "out.h5"
    _import(cli, make_d4rl(tmp_path / "d4rl.hdf5", [3, 4]), out)
    code, _, err = cli("gae", out, "-o", tmp_path / "g.h5", "--last-values", "zero")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"rolloutcli returns {out} -o OUT.h5" in err, err
    assert not (tmp_path / "g.h5").exists()


def test_an_imported_minari_dataset_says_what_runs_on_it(tmp_path: Path, cli) -> None:
    """What a user sees after ``import``: the summary's counts on a line of their own (a long path does not break
    them), and on ``inspect`` one warning for the missing critic, naming what does run: no advice about
    ``last_values`` for a gae that cannot run, and no time-out rule for it (issue 41's Minari walk)."""
    folder, dataset = make_minari(tmp_path / "minari", 3)
    out = tmp_path / "a_long_output_name_that_takes_most_of_an_80_column_line.h5"
    code, stdout, err = cli("import", folder, "-o", out)
    T = sum(len(e.rewards) for e in dataset.iterate_episodes())
    assert code == 0 and f"  3 episodes, T={T} steps x N=1 envs, 7 fields" in stdout.splitlines(), stdout + err
    warning = (
        f"{out}: no 'values' (no critic): gae cannot run on this file; returns, nstep and batch --transitions "
        "need none."
    )
    assert _inspect(cli, out)["warnings"] == [warning]
    code, stdout, err = cli("inspect", out)
    assert code == 0 and "time-out rule" not in stdout and "last_values" not in stdout, stdout
    code, stdout, err = cli("returns", out, "-o", tmp_path / "r.h5")
    assert code == 0, err
