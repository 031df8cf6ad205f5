"""Per-dimension statistics of every observation group and of actions, streamed in env blocks (``inspect
--per-dim``, ``stats --normalizer``)."""

from __future__ import annotations

import math
from typing import Any

from rolloutcli.core.per_dim import DimMoments
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.progress import Progress


def scan_per_dim(reader: RolloutReader, progress: Progress, names: dict[str, str] | None = None) -> dict[str, Any]:
    """``{label: (DimMoments, shape)}`` for ``names`` (label -> dataset; default: every observation group as
    ``observations/<key>`` and ``actions``). Exact: the result never depends on the blocks."""
    if names is None:
        names = {f"observations/{key}": path for key, path in reader.schema.observation_keys.items()}
        names["actions"] = "actions"
    shapes = {label: tuple(reader.schema.fields[path].shape[2:]) for label, path in names.items()}
    result = {label: DimMoments.empty(math.prod(shape)) for label, shape in shapes.items()}
    blocks = reader.blocks(list(names.values()))
    progress.start("per-dim statistics", len(blocks))
    for start, stop in blocks:
        for label, path in names.items():
            block = reader.array(path, start, stop)
            result[label] = result[label].merge(DimMoments.of(block.reshape(-1, math.prod(shapes[label]))))
        progress.advance()
    progress.finish()
    return {label: (moments, shapes[label]) for label, moments in result.items()}


def merge_scans(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two files' scans as one (exact; the files agree in labels and shapes, see ``dataset.check_agreement``)."""
    if a is None:
        return b
    return {label: (moments.merge(b[label][0]), shape) for label, (moments, shape) in a.items()}


def per_dim_report(scanned: dict[str, Any]) -> dict[str, Any]:
    """The JSON form: per label, its shape, the per-dimension lists and the total of non-finite values."""
    report = {}
    for label, (moments, shape) in scanned.items():
        stats = moments.as_dict()
        report[label] = {"shape": list(shape), **stats, "nonfinite_total": sum(stats["nonfinite"])}
    return report
