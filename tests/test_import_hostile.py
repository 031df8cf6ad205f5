"""``rolloutcli import`` on malformed and hostile sources of every layout: one line, the right exit code, nothing
written; and nothing published that another command would refuse (issue 40, import items 1-2)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from import_factory import make_d4rl, make_ikostrikov, make_robomimic, write_arrays


def _refused(cli, tmp_path: Path, src: Path, code: int = 1) -> str:
    out = tmp_path / "out.h5"
    got, _, err = cli("import", src, "-o", out, "-q")
    assert got == code, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "rolloutcli-tmp" in p.name]
    return err.strip().removeprefix("error: ")


def _d4rl(tmp_path: Path, **replace: object) -> Path:
    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4])
    with h5py.File(src, "a") as f:
        for name, value in replace.items():
            del f[name]
            f[name] = value
    return src


def _torch(tmp_path: Path, **replace: object) -> Path:
    state = {k: torch.as_tensor(v) for k, v in make_ikostrikov(5, 2).items()}
    state.update(replace)
    torch.save(state, tmp_path / "storage.pt")
    return tmp_path / "storage.pt"


def _minari(tmp_path: Path, metadata: str) -> Path:
    folder = tmp_path / "minari"
    (folder / "data").mkdir(parents=True)
    with h5py.File(folder / "data" / "main_data.hdf5", "w") as f:
        f["episode_0/observations"] = np.zeros((4, 2), np.float32)
        f["episode_0/actions"], f["episode_0/rewards"] = np.zeros((3, 1)), np.zeros(3)
        f["episode_0/terminations"], f["episode_0/truncations"] = np.array([0, 0, 1], bool), np.zeros(3, bool)
    (folder / "data" / "metadata.json").write_text(metadata)
    return folder


FLAG = "one flag per step: shape [rows] or [rows, ...] of numbers, at least one per row"


def test_d4rl_terminals_without_columns(tmp_path: Path, cli) -> None:
    src = _d4rl(tmp_path, terminals=np.zeros((7, 0), bool))
    assert _refused(cli, tmp_path, src) == (
        f"{src}: field 'terminals': expected {FLAG}, found shape [7, 0], dtype bool. "
        "Re-export the recording with its episode-end flags."
    )


def test_ikostrikov_masks_without_columns(tmp_path: Path, cli) -> None:
    arrays = make_ikostrikov(5, 2)
    arrays["masks"] = np.zeros((6, 2, 0), np.float32)
    src = write_arrays(tmp_path / "storage.h5", arrays)
    assert f"field 'masks': expected {FLAG}, found shape [6, 2, 0], dtype float32." in _refused(cli, tmp_path, src)


def test_robomimic_scalar_actions(tmp_path: Path, cli) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [3, 2])
    with h5py.File(src, "a") as f:
        del f["data/demo_0/actions"]
        f["data/demo_0/actions"] = np.float32(1)
    assert _refused(cli, tmp_path, src) == (
        f"{src}: field 'data/demo_0/actions': expected one row per step, found a scalar dataset. "
        "Re-export the recording."
    )


def test_episode_number_of_5000_digits(tmp_path: Path, cli) -> None:
    """An episode number past Python's int-string limit orders like any other (by its digits)."""
    src = make_robomimic(tmp_path / "demo.hdf5", [3, 2])
    with h5py.File(src, "a") as f:
        f.move("data/demo_1", "data/demo_" + "9" * 5000)
    code, out, err = cli("import", src, "-o", tmp_path / "out.h5", "--json")
    assert code == 0, err
    assert json.loads(out)["episodes"] == 2


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("[1, 2]", "expected Minari metadata as a JSON object, found a JSON list."),
        ("[" * 100_000 + "]" * 100_000, "expected Minari metadata nested at most 64 deep, found 100000 levels."),
        ('{"a": "' + "x" * (17 * 2**20) + '"}', "expected Minari metadata of at most 16 MiB, found 17825801 bytes."),
    ],
)
def test_minari_metadata_bounded(tmp_path: Path, cli, text: str, found: str) -> None:
    folder = _minari(tmp_path, text)
    assert _refused(cli, tmp_path, folder) == (
        f"{folder / 'data' / 'metadata.json'}: {found} Check that this is the metadata.json Minari wrote."
    )


TENSOR = "a dense CPU tensor of a numpy dtype (bool, integers, float16/32/64, complex)"
TENSOR_FIX = "Convert it before saving (tensor.to_dense().float().cpu()), or leave it out of the dict."


@pytest.mark.parametrize(
    ("key", "value", "found"),
    [
        ("obs", torch.zeros(6, 2, 4, dtype=torch.bfloat16), "dtype bfloat16"),
        ("rewards", torch.zeros(5, 2, 1).to_sparse(), "a sparse_coo tensor"),
        ("obs", torch.empty(6, 2, 4, device="meta"), "a tensor on device 'meta' (no data)"),
        ("extra", {"a": torch.zeros(2)}, "a dict"),
    ],
)
def test_torch_source_tensors_refused(tmp_path: Path, cli, key: str, value: object, found: str) -> None:
    src = _torch(tmp_path, **{key: value})
    assert _refused(cli, tmp_path, src) == f"{src}: field '{key}': expected {TENSOR}, found {found}. {TENSOR_FIX}"


@pytest.mark.parametrize("key", ["", "../x", "/abs", "a/b"])
def test_torch_source_keys_refused(tmp_path: Path, cli, key: str) -> None:
    src = _torch(tmp_path, **{key: torch.zeros(3)})
    assert _refused(cli, tmp_path, src) == (
        f"{src}: key {key!r}: expected a plain name (letters, digits, _ . -), found another; it cannot name a "
        "dataset. Save the tensors under plain keys."
    )


def test_torch_source_requires_grad_is_read(tmp_path: Path, cli) -> None:
    obs = torch.as_tensor(make_ikostrikov(5, 2)["obs"]).requires_grad_(True)
    src = _torch(tmp_path, obs=obs)
    code, _, err = cli("import", src, "-o", tmp_path / "out.h5", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["observations/policy"][:], obs.detach().numpy()[:5])


def test_torch_source_conjugated_complex_is_refused_by_the_contract(tmp_path: Path, cli) -> None:
    src = _torch(tmp_path, obs=torch.zeros(6, 2, 4, dtype=torch.complex64).conj())
    err = _refused(cli, tmp_path, src)
    assert (
        "field 'observations/policy': expected a numeric dtype (bool, integer or float), found dtype complex64" in err
    )


REFUSE = "would import as a rollout file the other commands refuse; nothing written."


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        (
            "rewards",
            np.full(7, np.nan, np.float32),
            "field 'rewards': expected finite numbers, found 7 NaN/Inf values.",
        ),
        (
            "rewards",
            np.array([b"a"] * 7),
            "field 'rewards': expected a numeric dtype (bool, integer or float), found dtype |S1.",
        ),
        ("rewards", np.zeros((7, 3), np.float32), "field 'rewards': expected shape [T, N] = [7, 1] (or [7, 1, 1]), "),
        (
            "observations",
            np.zeros((7, 3), np.complex64),
            "field 'observations/policy': expected a numeric dtype (bool, integer or float), found dtype complex64.",
        ),
    ],
)
def test_contract_runs_before_publishing(tmp_path: Path, cli, name: str, value: np.ndarray, problem: str) -> None:
    src = _d4rl(tmp_path, **{name: value})
    err = _refused(cli, tmp_path, src)
    assert err.startswith(f"{src}: {REFUSE} ") and problem in err, err


def test_contract_reports_every_problem_at_once(tmp_path: Path, cli) -> None:
    arrays = make_ikostrikov(5, 2)
    arrays["value_preds"] = np.zeros((6, 2, 3), np.float32)
    src = write_arrays(tmp_path / "storage.h5", arrays)
    assert _refused(cli, tmp_path, src) == (
        f"{src}: {REFUSE} 2 problems: field 'last_values': expected shape [N] = [2] (or [2, 1]), found shape (2, 3); "
        "field 'values': expected shape [T, N] = [5, 2] (or [5, 2, 1]), found shape (5, 2, 3)."
    )


def test_nonfinite_observations_are_kept_with_a_warning(tmp_path: Path, cli) -> None:
    obs = np.zeros((7, 3), np.float32)
    obs[2, 1] = np.inf
    src = _d4rl(tmp_path, observations=obs, next_observations=np.concatenate([obs[1:], obs[-1:]]))
    code, out, err = cli("import", src, "-o", tmp_path / "out.h5", "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == [
        f"{src}: field 'observations/policy': 1 NaN/Inf values (first at step 2); kept as they are: observations "
        "may hold them, check that they are meant."
    ]
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["observations/policy"][2, 0, 1] == np.inf


def test_robomimic_demo_lacking_an_observation_key(tmp_path: Path, cli) -> None:
    """A demo without a key the others have was imported with zeros in its place."""
    src = make_robomimic(tmp_path / "demo.hdf5", [3, 2], next_obs=False)
    with h5py.File(src, "a") as f:
        del f["data/demo_1/obs/img"]
    assert _refused(cli, tmp_path, src) == (
        f"{src}: episode 'data/demo_1': expected 'obs/img' as other episodes store it, found it missing; importing "
        "would fill it with zeros. Re-export the episode with every field, or remove the field from every episode."
    )


def test_d4rl_next_observations_that_disagree_are_kept(tmp_path: Path, cli) -> None:
    """next_observations[t] should be observations[t + 1] inside an episode; rows that are not were dropped."""
    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4])
    with h5py.File(src, "a") as f:
        following = np.concatenate([f["observations"][1:], f["observations"][-1:] + 5])
        following[[0, 4]] = -1  # inside episodes 0 and 1
        following[2] = 99  # where episode 0 ends: a final observation, not a disagreement
        f["next_observations"][...] = following
    code, out, err = cli("import", src, "-o", tmp_path / "out.h5", "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == [
        f"{src}: field 'next_observations': 2 rows inside an episode differ from the next 'observations' row; "
        "kept as they are in 'source/next_observations' (final_observations holds the rows where an episode ends)."
    ]
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["source/next_observations"][:], following)


def test_d4rl_next_observations_that_agree_are_not_carried_twice(tmp_path: Path, cli) -> None:
    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4])
    with h5py.File(src, "a") as f:
        f["next_observations"][...] = np.concatenate([f["observations"][1:], f["observations"][-1:] + 5])
    code, out, err = cli("import", src, "-o", tmp_path / "out.h5", "--json")
    assert code == 0 and json.loads(out)["warnings"] == [], err
    with h5py.File(tmp_path / "out.h5") as f:
        assert "source" not in f


def _declared_huge(path: Path, T: int, flag_dtype: type = bool) -> Path:
    """A D4RL file of a few KB declaring ``T`` unallocated steps."""
    with h5py.File(path, "w") as f:
        fields = [("observations", (3,), np.float32), ("actions", (2,), np.float32), ("rewards", (), np.float32)]
        for name, row, dtype in [*fields, ("terminals", (), flag_dtype), ("timeouts", (), flag_dtype)]:
            f.create_dataset(name, (T, *row), dtype, chunks=(4096, *row))
    return path


# The disk as a child sees it: 1 GiB free (a 2**29-step output needs far more; the runner's disk may hold it).
SMALL_DISK = "import shutil; shutil.disk_usage = lambda _: shutil._ntuple_diskusage(1 << 40, 0, 1 << 30); "


def test_declared_huge_flags_are_not_read_whole(tmp_path: Path) -> None:
    """The flags were read whole (3.2 GB for 2**29 steps), then refused with exit 2 under --max-memory 64M:
    now the disk check refuses the 13G output before any row is read, in little memory."""
    src = _declared_huge(tmp_path / "huge.h5", 2**29)
    out = tmp_path / "out.h5"
    argv = ["import", str(src), "-o", str(out), "--max-memory", "64M", "-q"]
    peak, code, err = _peak_anonymous_kb(argv, prelude=SMALL_DISK)
    assert code == 3 and not out.exists(), err
    assert err.strip() == (
        f"error: {out}: the output needs 13312M of disk (uncompressed), 1024M is free on the file system holding "
        f"{tmp_path.resolve()}; free some space or write the output elsewhere."
    )
    assert peak < 200 * 1024, peak
    print(f"peak RssAnon {peak} KiB")


def test_declared_huge_flags_are_streamed_within_the_budget(tmp_path: Path) -> None:
    """Flags of 2**21 steps under --max-memory 1M were refused (exit 2: the plan held them whole); now they are
    read a block at a time like every other field: the episode ends where they say, in the budget's memory."""
    T = 2**21
    src = _declared_huge(tmp_path / "long.h5", T, flag_dtype=np.float32)
    ends = {12345: "terminals", 700_000: "timeouts", 1_500_000: "terminals", T - 1: "timeouts"}
    with h5py.File(src, "a") as f:
        for step, name in ends.items():
            f[name][step] = 1
        f["timeouts"][12345] = 1  # terminal and timed out: terminated
    small = _declared_huge(tmp_path / "small.h5", 4096)

    def peak_of(source: Path, out: Path) -> int:
        peak, code, err = _peak_anonymous_kb(["import", str(source), "-o", str(out), "--max-memory", "1M", "-q"])
        assert code == 0, err
        return peak

    base, peak = peak_of(small, tmp_path / "small-out.h5"), peak_of(src, tmp_path / "out.h5")
    assert peak - base < 48 * 1024, (peak, base)
    with h5py.File(tmp_path / "out.h5") as f:
        dones, time_outs = f["dones"][:, 0], f["time_outs"][:, 0]
    assert np.flatnonzero(dones).tolist() == sorted(ends)
    assert np.flatnonzero(time_outs).tolist() == [700_000, T - 1]


def test_ikostrikov_flags_are_streamed_within_the_budget(tmp_path: Path, cli) -> None:
    """masks/bad_masks were read whole (exit 2 under a budget smaller than them): now a block at a time."""
    arrays = make_ikostrikov(20_000, 3)
    src = write_arrays(tmp_path / "storage.h5", arrays)
    code, out, err = cli("import", src, "-o", tmp_path / "out.h5", "--max-memory", "64K", "--json")
    assert code == 0, err
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["dones"][:], (arrays["masks"][1:, :, 0] == 0).astype(np.uint8))
        assert np.array_equal(f["time_outs"][:], (arrays["bad_masks"][1:, :, 0] == 0).astype(np.uint8))
    assert json.loads(out)["episodes"] == int((arrays["masks"][1:] == 0).sum())


def test_declared_huge_output_is_refused_when_the_disk_cannot_hold_it(tmp_path: Path, cli, monkeypatch) -> None:
    import shutil

    src = _declared_huge(tmp_path / "huge.h5", 2**20)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10 << 30, 0, 5 << 20))
    out = tmp_path / "out.h5"
    code, _, err = cli("import", src, "-o", out)
    assert code == 3 and not out.exists(), err
    assert err.strip() == (
        f"error: {out}: the output needs 26M of disk (uncompressed), 5M is free on the file system holding "
        f"{tmp_path.resolve()}; free some space or write the output elsewhere."
    )


def test_torch_source_with_a_compressed_member(tmp_path: Path, cli) -> None:
    """A compressed member cannot be memory-mapped: it was inflated whole (1.8 GB for a 1.6 MB file)."""
    import zipfile

    plain = _torch(tmp_path, returns=torch.zeros(2**16))
    src = tmp_path / "packed.pt"
    with zipfile.ZipFile(plain) as archive, zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as packed:
        for info in archive.infolist():
            packed.writestr(info.filename, archive.read(info.filename))
    first = zipfile.ZipFile(src).infolist()[0]
    assert _refused(cli, tmp_path, src) == (
        f"{src}: member '{first.filename}': expected torch.save's uncompressed members (read memory-mapped), found "
        f"it compressed ({first.file_size} bytes declared). Load it with torch and save it again with torch.save."
    )


def test_ikostrikov_dones_beside_source_dones(tmp_path: Path, cli) -> None:
    """Both went to source/dones: refused as a corrupt file."""
    arrays = make_ikostrikov(5, 2)
    arrays["dones"], arrays["source/dones"] = np.ones((5, 2, 1), np.float32), np.full((5, 2, 1), 2, np.float32)
    src = write_arrays(tmp_path / "storage.h5", arrays)
    code, _, err = cli("import", src, "-o", tmp_path / "out.h5", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "out.h5") as f:
        assert np.array_equal(f["source/dones"][:], arrays["source/dones"])
        assert np.array_equal(f["source/source/dones"][:], arrays["dones"])


def test_hdf5_with_a_zip_appended_is_hdf5(tmp_path: Path, cli) -> None:
    """Was taken for a torch.save file (and refused): the HDF5 signature decides first."""
    import io
    import zipfile

    src = make_d4rl(tmp_path / "d4rl.hdf5", [3, 4])
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("x", "y")
    with open(src, "ab") as f:
        f.write(archive.getvalue())
    assert zipfile.is_zipfile(src)
    code, out, err = cli("import", src, "-o", tmp_path / "out.h5", "--json")
    assert code == 0 and json.loads(out)["layout"] == "d4rl", err


def test_robomimic_root_attributes_are_carried(tmp_path: Path, cli) -> None:
    src = make_robomimic(tmp_path / "demo.hdf5", [3, 2])
    with h5py.File(src, "a") as f:
        f.attrs["robot"] = "panda"
    code, _, err = cli("import", src, "-o", tmp_path / "out.h5", "-q")
    assert code == 0, err
    with h5py.File(tmp_path / "out.h5") as f:
        assert f.attrs["source_robot"] == "panda" and f.attrs["source_env_args"] == '{"env_name": "Lift"}'


def test_robomimic_plan_cost_is_per_dataset_not_per_demo_and_dataset() -> None:
    """5,000 two-step demos took about 5 minutes: each demo scanned every dataset of the file."""
    import time

    from rolloutcli.hdf5.schema import DatasetInfo
    from rolloutcli.pipeline.import_source import check_episode_fields
    from rolloutcli.pipeline.layouts import plan_import

    listing = {}
    for k in range(5000):
        for key in ("obs/pos", "obs/img", "next_obs/pos", "next_obs/img", "actions", "rewards", "dones", "states"):
            listing[f"data/demo_{k}/{key}"] = DatasetInfo((2, 3), np.dtype(np.float32))
    started = time.perf_counter()
    check_episode_fields("x.h5", "robomimic", listing)
    plan = plan_import("x.h5", "robomimic", listing, lambda name, rows: np.zeros((2, 3), np.float32)[rows])
    assert time.perf_counter() - started < 5 and plan.episodes == 5000 and plan.T == 10_000


def test_torch_source_whose_zip64_locator_spans_disks(tmp_path: Path, cli) -> None:
    """Found by the fuzz suite: zipfile.is_zipfile raised BadZipFile past its own check (a traceback)."""
    src = _torch(tmp_path)
    data = bytearray(src.read_bytes())
    data[data.rfind(b"PK\x06\x07") + 16] = 2  # the zip64 end locator's count of disks
    src.write_bytes(bytes(data))
    assert _refused(cli, tmp_path, src) == (
        f"{src}: cannot read it as a torch.save archive (zipfiles that span multiple disks are not supported)."
    )


def _peak_anonymous_kb(argv: list[str], prelude: str = "") -> tuple[int, int, str]:
    """The largest RssAnon (private memory; the memory-mapped source's pages are file pages) seen while
    ``rolloutcli argv`` ran (after ``prelude``, Python run first in the child), its exit code and stderr."""
    import subprocess
    import sys
    import time

    run = "runpy.run_module('rolloutcli', run_name='__main__')"
    code = f"{prelude}import runpy, sys; sys.argv = ['rolloutcli', *{argv!r}]; {run}"
    process = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    peak = 0
    while process.poll() is None:
        with contextlib.suppress(OSError, ValueError, IndexError):  # IndexError: a zombie has no RssAnon
            status = Path(f"/proc/{process.pid}/status").read_text()
            peak = max(peak, int(status.split("RssAnon:")[1].split()[0]))
        time.sleep(0.005)
    return peak, process.returncode, process.stderr.read().decode()


def test_torch_source_carried_tensor_is_read_in_blocks(tmp_path: Path) -> None:
    """A carried tensor (returns) was converted whole: 128 MB of private memory under --max-memory 1M."""
    small = _torch(tmp_path, returns=torch.zeros(10, 2, 1)).rename(tmp_path / "small.pt")
    baseline, code, err = _peak_anonymous_kb(
        ["import", str(small), "-o", str(tmp_path / "small.h5"), "--max-memory", "1M", "-q"]
    )
    assert code == 0, err
    big = _torch(tmp_path, returns=torch.ones(2**24, 2, 1))
    peak, code, err = _peak_anonymous_kb(
        ["import", str(big), "-o", str(tmp_path / "out.h5"), "--max-memory", "1M", "-q"]
    )
    assert code == 0, err
    assert peak - baseline < 48 * 1024, (peak, baseline)
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["source/returns"].shape == (2**24, 2, 1) and f["source/returns"][-1, 1, 0] == 1
