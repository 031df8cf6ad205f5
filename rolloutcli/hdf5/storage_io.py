"""A whole rollout file to and from a dict of tensors keyed by dataset path (``RolloutStorage``'s I/O).

``read_rollout`` reads through ``RolloutReader`` (the commands' checks); ``write_rollout`` writes through
``RolloutOutput`` into a temporary file renamed when complete. Neither knows ``RolloutStorage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.atomic import atomic_file
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.hdf5.schema import FORMAT_NAME, FORMAT_VERSION
from rolloutcli.hdf5.writer import RolloutOutput

if TYPE_CHECKING:
    import torch


@dataclass
class Rollout:
    """What ``read_rollout`` returns: every field but the extras, normalised (:mod:`rolloutcli.fields`), keyed by
    dataset path; ``N`` counts the envs read; ``observations``, ``hidden`` and ``attrs`` as in ``RolloutSchema``;
    ``distribution``: the distribution parameter names in tuple order."""

    tensors: dict[str, torch.Tensor]
    T: int
    N: int
    observations: dict[str, str] = field(default_factory=dict)
    hidden: dict[str, list[str]] = field(default_factory=dict)
    distribution: list[str] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)


def _env_range(envs: slice | None, num_envs: int, path: Path) -> tuple[int, int]:
    if envs is None:
        return 0, num_envs
    start, stop, step = envs.indices(num_envs)
    if step != 1 or stop <= start:
        raise RolloutError(
            f"{path}: envs={envs!r} selects no contiguous env range of the file's N={num_envs} envs. "
            "Pass a slice such as slice(0, 128).",
            exit_code=EXIT_USAGE,
        )
    return start, stop


def read_rollout(
    path: Path | str,
    device: str | torch.device = "cpu",
    envs: slice | None = None,
    options: SafetyOptions | None = None,
) -> Rollout:
    """Read every field of ``path`` (env slice ``envs``) as tensors on ``device``."""
    path = Path(path)
    with RolloutReader(path, options or SafetyOptions()) as reader:
        schema = reader.schema
        start, stop = _env_range(envs, schema.N, path)
        fields = [name for name, spec in schema.fields.items() if spec.role != "extra"]
        tensors = {name: reader.tensor(name, start, stop, device) for name in fields}
        return Rollout(
            tensors,
            schema.T,
            stop - start,
            dict(schema.observation_keys),
            {net: list(paths) for net, paths in schema.hidden.items()},
            reader.distribution_order(),
            dict(schema.attrs),
        )


def write_rollout(
    path: Path | str,
    tensors: Mapping[str, Any],
    attrs: Mapping[str, Any] | None = None,
    *,
    group_attrs: Mapping[str, Mapping[str, Any]] | None = None,
    overwrite: bool = False,
) -> None:
    """Write ``tensors`` (keyed by dataset path) as a rollout file at ``path``, stamped with the format.

    ``group_attrs`` sets attributes on groups the datasets create (e.g. ``{"distribution": {"order": [...]}}``).
    """
    path = Path(path)
    stamp = {"rolloutcli_format": FORMAT_NAME, "format_version": FORMAT_VERSION}
    with atomic_file(path, overwrite=overwrite) as tmp, RolloutOutput(tmp, path) as out:
        out.set_attrs({**stamp, **{k: v for k, v in (attrs or {}).items() if k not in stamp}})
        for name, value in tensors.items():
            out.put(name, value)
        for group, values in (group_attrs or {}).items():
            out.set_attrs(values, group)
