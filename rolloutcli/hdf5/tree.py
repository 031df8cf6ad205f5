"""The objects of an audited file as plain data (``inspect`` shows them for a file outside the contract)."""

from __future__ import annotations

from typing import Any

import h5py

from rolloutcli.hdf5.reader import H5Input

MAX_ENTRIES = 200  # a file of 100,000 episodes is summarised, not listed


def object_tree(source: H5Input, limit: int = MAX_ENTRIES) -> tuple[list[dict[str, Any]], int]:
    """(The first ``limit`` groups and datasets reachable by hard links, in name order, each with its
    attributes; how many objects there are in all). Datasets carry shape, dtype, chunks and compression."""
    names: list[str] = []
    source.guard(lambda: source.handle.visit(names.append))
    entries = [{"path": "/", "kind": "group", "attrs": source.attrs}]
    for name in sorted(names)[: max(limit - 1, 0)]:
        obj = source.guard(lambda name=name: source.handle.get(name, getlink=False), name)
        entry: dict[str, Any] = {"path": "/" + name, "kind": "group"}
        if isinstance(obj, h5py.Dataset):
            info = source.datasets[name]
            entry.update(kind="dataset", shape=list(info.shape), dtype=str(info.dtype))
            entry.update(chunks=list(info.chunks) if info.chunks else None, compression=info.compression)
        elif not isinstance(obj, h5py.Group):
            entry["kind"] = "datatype"
        entry["attrs"] = source.attrs_of(name)
        entries.append(entry)
    return entries, len(names) + 1
