"""What ``batch`` keeps of the files of a dataset (:class:`DatasetFiles`), read while they are checked, and the
manifest's ``gae`` entry made of it (:func:`gae_record`)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.dataset import check_agreement
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.options import RunOptions

# The manifest's "gae" entries: what the gae runs recorded in each source file (its root attributes).
GAE_ATTRS = {
    "gamma": "gae_gamma",
    "lambda": "gae_lambda",
    "advantages_normalized": "advantages_normalized",
    "timeouts_bootstrapped": "timeouts_bootstrapped",
}


def gae_values(reader: RolloutReader) -> tuple[Any, ...]:
    return tuple(reader.schema.attrs.get(attr) for attr in GAE_ATTRS.values())


@dataclass(frozen=True)
class DatasetFiles:
    """What ``batch`` keeps of each file of a dataset (the files are never all open at once: each open file holds
    ~0.5 MB of libhdf5 caches): its ``(T, N)`` and its gae attributes (:func:`gae_values`), as ``gae`` (the distinct
    ones) and ``which`` (each file's, an index into ``gae``): a tuple of them a file held ~150 B of the driver."""

    sizes: list[tuple[int, int]]
    gae: list[tuple[Any, ...]]
    which: array


# Values whose type and repr say all of them: two of those alike are one (written the same in the manifest).
_SCALARS = (str, bytes, int, float, np.number, np.bool_, type(None))


def _distinct(values: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``values`` as a key: equal keys, values the manifest writes the same; None where an array or another object
    could differ beyond its repr (kept as its own)."""
    if not all(isinstance(value, _SCALARS) for value in values):
        return None
    return tuple((type(value), repr(value)) for value in values)


def check_files(files: Sequence[Path], run: RunOptions, same_steps: str | None) -> DatasetFiles:
    """The files' agreement (``check_agreement``: exit 1), their values checked on the way; what is kept of them."""
    gae: list[tuple[Any, ...]] = []
    which, seen = array("q"), {}

    def each(reader: RolloutReader) -> None:
        values = gae_values(reader)
        key = _distinct(values)
        if key is None or key not in seen:
            gae.append(values)
            if key is not None:
                seen[key] = len(gae) - 1
        which.append(seen[key] if key is not None else len(gae) - 1)

    # the values are checked here, where the driver waits for the next file's probe, not when blocks are planned
    sizes = check_agreement(files, run.safety, same_steps=same_steps, each=each, values=run.max_memory)
    return DatasetFiles(sizes, gae, which)


def gae_record(values: list[tuple[Any, ...]]) -> dict[str, Any]:
    """What the gae runs recorded in the sources (None where nothing): one value where every file agrees, else the
    list of each file's value in dataset order (files made with other options are not silently one setting)."""
    record = {}
    for i, key in enumerate(GAE_ATTRS):
        column = [each[i] for each in values]
        record[key] = column[0] if all(value == column[0] for value in column) else column
    return record


def dataset_gae(dataset: DatasetFiles) -> dict[str, Any]:
    """:func:`gae_record` of every file of the dataset, in order."""
    return gae_record([dataset.gae[k] for k in dataset.which])
