"""An output's libhdf5 memory stays bounded however many objects it gets (issue 39): at most ``OPEN_DATASETS``
datasets kept open between writes, and a metadata cache held at ``OUTPUT_CACHE``; what is written is the same."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from rolloutcli.hdf5.writer import OPEN_DATASETS, OUTPUT_CACHE, RolloutOutput

COUNT = 1500  # datasets: their object headers overflow the capped cache several times


def _value(i: int) -> np.ndarray:
    return np.arange(i, i + 6, dtype=np.float32).reshape(2, 3)


def test_an_output_of_many_datasets_keeps_few_open_and_a_small_cache(tmp_path: Path) -> None:
    path = tmp_path / "many.h5"
    with RolloutOutput(path, path) as out:
        assert out.file.id.get_mdc_config().max_size == OUTPUT_CACHE
        for i in range(COUNT):  # every dataset made first, then written: as the episode exports do
            out.create(f"data/demo_{i}/obs", (2, 3), np.float32)
            assert len(out._objects) <= OPEN_DATASETS
        for i in range(COUNT):
            out.write(f"data/demo_{i}/obs", (), _value(i))
            assert len(out._objects) <= OPEN_DATASETS
        out.set_attrs({"total": COUNT}, "data")
    with h5py.File(path, "r") as handle:
        assert len(handle["data"]) == COUNT and handle["data"].attrs["total"] == COUNT
        for i in range(COUNT):
            np.testing.assert_array_equal(handle[f"data/demo_{i}/obs"][()], _value(i))


def test_the_capped_cache_writes_what_the_default_one_writes(tmp_path: Path) -> None:
    """The same objects written with libhdf5's default cache (h5py) read back the same."""
    ours, theirs = tmp_path / "ours.h5", tmp_path / "theirs.h5"
    with RolloutOutput(ours, ours) as out:
        for i in range(COUNT):
            out.put(f"g{i % 7}/d{i}", _value(i))
    with h5py.File(theirs, "w", libver=("v108", "latest")) as handle:
        for i in range(COUNT):
            handle.create_dataset(f"g{i % 7}/d{i}", data=_value(i), track_times=False)

    def listing(path: Path) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        with h5py.File(path, "r") as handle:
            handle.visititems(
                lambda name, obj: found.update({name: obj[()].tobytes()}) if isinstance(obj, h5py.Dataset) else None
            )
        return found

    assert listing(ours) == listing(theirs)
