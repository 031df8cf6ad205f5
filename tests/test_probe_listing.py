"""The metadata probe's quick walk and the listing it sends back (issue 39: a small file's per-file cost).

The quick walk (``probe_walk.quick_walk``) vouches for a file only when the full audit would pass it, and its
listing is exactly what a reader lists itself (``listing.list_datasets``, ``read_attrs``); a reader takes the
probe's listing instead of walking the file again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from promises import make_input
from rollout_factory import make_rollout
from test_promises_hostile import HOSTILE, Patch, make_hostile

from rolloutcli.errors import RolloutError
from rolloutcli.hdf5 import reader as reader_module
from rolloutcli.hdf5.audit import audit_file
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.listing import Listing, attr_names, from_json, list_datasets, read_attrs, to_json
from rolloutcli.hdf5.probe_helper import _read_metadata
from rolloutcli.hdf5.probe_walk import quick_walk
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.safety import HDF5_ERRORS
from rolloutcli.hdf5.schema import DatasetInfo

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"
NOT_HDF5 = {"fifo", "devzero", "text", "truncated"}
HANGS = {"global heap that hangs libhdf5"}  # loops forever in libhdf5: only ever read in a prober


def _listed(path: Path) -> Listing:
    with h5py.File(path, "r") as handle:
        return Listing(*list_datasets(handle), read_attrs(handle))


def _high_level(path: Path) -> Listing:
    """The listing made with h5py's high-level objects (an independent reference for the low-level one)."""
    datasets, types = {}, []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            packing = [obj.compression, "shuffle" if obj.shuffle else None, "fletcher32" if obj.fletcher32 else None]
            packed = "+".join(p for p in packing if p) or None
            datasets[name] = DatasetInfo(tuple(obj.shape or ()), obj.dtype, obj.chunks, packed)
        elif isinstance(obj, h5py.Datatype):
            types.append(name)

    with h5py.File(path, "r") as handle:
        handle.visititems(visit)
        return Listing(datasets, types, read_attrs(handle))


def _quick(path: Path, options: SafetyOptions | None = None) -> Listing | None:
    with h5py.File(path, "r") as handle:
        return quick_walk(handle, options or SafetyOptions())


def _variants(folder: Path) -> list[Path]:
    """Plain rollouts stored in every way the quick walk vouches for."""
    files = [make_rollout(folder / "plain.h5"), *sorted(SAMPLE.glob("*.h5"))]
    for name, options in {
        "gzip": {"compression": "gzip", "shuffle": True, "fletcher32": True},
        "lzf": {"compression": "lzf"},
        "scaleoffset": {"scaleoffset": 0, "chunks": True},
        "chunked": {"chunks": True, "maxshape": (None, None)},
    }.items():
        path = folder / f"{name}.h5"
        with h5py.File(path, "w") as handle:
            handle.attrs.update({"rolloutcli_format": "rollout", "format_version": 1.2, "flag": True, "n": [1, 2]})
            handle.create_dataset("rewards", data=np.arange(12, dtype=np.float32).reshape(3, 4), **options)
            handle.create_dataset("dones", data=np.zeros((3, 4), bool), **{k: v for k, v in options.items()
                                                                            if k != "scaleoffset"})  # fmt: skip
            handle.create_dataset("group/big_endian", data=np.arange(4, dtype=">i8"))
            handle.create_dataset("group/scalar", data=np.float64(3.5))
            handle.create_dataset("group/empty", shape=(0, 4), dtype=np.uint8, chunks=(1, 4), maxshape=(None, 4))
            handle["group"].attrs["note"] = "kept"
        files.append(path)
    return files


def test_the_quick_listing_is_the_readers_own(tmp_path: Path) -> None:
    for path in _variants(tmp_path):
        quick = _quick(path)
        assert quick == _listed(path) == _high_level(path), path
        assert from_json(json.loads(json.dumps(to_json(quick)))) == quick, path
        with h5py.File(path, "r") as handle:
            audit_file(path, handle, SafetyOptions())  # and the audit passes it


@pytest.mark.parametrize("case", sorted(set(HOSTILE) - HANGS))
def test_the_quick_walk_never_vouches_for_a_file_the_audit_refuses(tmp_path: Path, case: str) -> None:
    builder = HOSTILE[case][0]
    if builder in NOT_HDF5:
        return
    (tmp_path / "aux").mkdir()
    path = make_input("rollout", tmp_path / "in.h5", T=16, N=6)
    make_hostile(path, builder, tmp_path / "aux")
    with h5py.File(path, "r") as handle:
        try:
            assert quick_walk(handle, SafetyOptions()) is None
        except HDF5_ERRORS:
            pass  # raised in the prober: it vouches for nothing either
        if not isinstance(builder, Patch):
            with pytest.raises(RolloutError):
                audit_file(path, handle, SafetyOptions())


def test_what_the_quick_walk_leaves_to_the_audit(tmp_path: Path) -> None:
    """Soft links (trusted), committed datatypes, strings, tighter limits: the full walk lists them."""
    path = make_rollout(tmp_path / "r.h5")
    with h5py.File(path, "a") as handle:
        handle["alias"] = h5py.SoftLink("/rewards")
    assert _quick(path, SafetyOptions(allow_external=True)) is None
    for name, make in {
        "type": lambda h: h.__setitem__("named", np.dtype("f4")),
        "strings": lambda h: h.create_dataset("names", data=["a", "bc"], dtype=h5py.string_dtype()),
        "twice": lambda h: h.__setitem__("again", h["observations"]),
        "a dataset twice": lambda h: h.__setitem__("again", h["rewards"]),
    }.items():
        path = make_rollout(tmp_path / f"{name}.h5")
        with h5py.File(path, "a") as handle:
            make(handle)
        assert _quick(path) is None, name
        found = json.loads(_read_metadata(path, {"options": {}, "timeout": 5}))
        assert found["status"] == "ok" and found["clean"] is not None, name
        assert found["listing"] is None or from_json(found["listing"]) == _high_level(path), name
        assert _listed(path) == _high_level(path), name
    assert _quick(make_rollout(tmp_path / "tight.h5"), SafetyOptions(max_dataset_bytes=8)) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the probe needs fork")
def test_a_reader_takes_the_probes_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listed: list[object] = []
    real = reader_module.list_datasets
    monkeypatch.setattr(reader_module, "list_datasets", lambda handle: listed.append(handle) or real(handle))
    path = make_rollout(tmp_path / "r.h5")
    with RolloutReader(path) as reader:
        assert (reader.datasets, reader.attrs) == (_listed(path).datasets, _listed(path).attrs)
    assert listed == []
    with h5py.File(path, "a") as handle:  # an attribute JSON cannot hold: listed here
        handle.attrs["pair"] = np.array([1 + 2j])
    with RolloutReader(path) as reader:
        assert reader.attrs["pair"] == [1 + 2j]
    assert len(listed) == 1


def test_a_listing_past_its_size_is_not_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prober's answer carries the listing only under ``LISTING_BYTES``; past it, the file is still clean."""
    from rolloutcli.hdf5 import probe_helper

    path = make_rollout(tmp_path / "r.h5")
    found = json.loads(_read_metadata(path, {"options": {}, "timeout": 5}))
    assert from_json(found["listing"]) == _high_level(path)
    monkeypatch.setattr(probe_helper, "LISTING_BYTES", len(json.dumps(found)) - 1)
    smaller = json.loads(_read_metadata(path, {"options": {}, "timeout": 5}))
    assert smaller == {**found, "listing": None}


def test_attribute_names_come_in_h5pys_order(tmp_path: Path) -> None:
    """``attr_names`` lists what ``list(obj.attrs)`` lists, in its order: creation order where the object tracks
    it (the root group's own flag for a file), else by name; a committed type's through h5py."""
    for tracked in (False, True):
        path = tmp_path / f"{tracked}.h5"
        with h5py.File(path, "w", track_order=tracked) as handle:
            group = handle.create_group("g", track_order=tracked)
            dataset = handle.create_dataset("d", data=[1.0], track_order=tracked)
            handle["t"] = np.dtype("<f4")
            for obj in (handle, group, dataset, handle["t"]):
                for name in ("b", "a", "c\u00e9"):
                    obj.attrs[name] = 1
        with h5py.File(path, "r") as handle:
            for obj in (handle, handle["g"], handle["d"], handle["t"]):
                assert attr_names(obj) == list(obj.attrs), (tracked, obj)
            assert attr_names(handle) == (["b", "a", "c\u00e9"] if tracked else ["a", "b", "c\u00e9"])
