"""What ``export --to minari`` writes besides the arrays: dataset ids, spaces and ``metadata.json`` (no h5py here).

The layout is Minari's HDF5 storage (``<dataset id>/data/main_data.hdf5`` and ``data/metadata.json``), written
by :mod:`rolloutcli.hdf5.export_minari` rather than by Minari's ``DataCollector``: that one needs jax, and its
bytes depend on the install. ``minari.load_dataset`` opens the folder with ``MINARI_DATASETS_PATH`` set to the
folder above it, so the output folder's name is the dataset id (``name-v0``); with a split the output is a
namespace holding ``train-v0`` and ``valid-v0`` (ids ``<name>/train-v0`` and ``<name>/valid-v0``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.pipeline.episode_plan import EpisodePlan

# The Minari version whose layout is written (and tested): Minari reads datasets of its supported versions only.
MINARI_VERSION = "0.5.4"
SPLIT_IDS = ("train-v0", "valid-v0")  # the two datasets of a split, inside the output folder (a namespace)
MAX_NAME_BYTES = 95  # the temporary output keeps 96 bytes of the name (rolloutcli.hdf5.atomic): a longer one is cut
# Minari's dataset id regex (minari.dataset.minari_dataset), one path component at a time, version required.
_DATASET = re.compile(r"[-_\w]+?-v\d+")
_NAMESPACE = re.compile(r"[-_\w][-_\w]*[-_\w]+")
# What a Minari episode holds of a chunk's rows (the observation after the last step comes apart).
HELD = ("observations/", "final_observations/", "infos/", "actions", "rewards", "dones", "time_outs")


def dataset_ids(dst: Path, split: bool) -> list[str]:
    """The Minari ids of the output ``dst`` (one, or train and valid with a split); exit 2 for a name Minari
    cannot load."""
    name = dst.name
    pattern, wanted = (_NAMESPACE, "a namespace like 'pusher'") if split else (_DATASET, "an id like 'pusher-v0'")
    if not pattern.fullmatch(name) or len(name.encode()) > MAX_NAME_BYTES:
        cleaned = re.sub(r"[^-_\w]", "_", name.split("-v")[0]) or "dataset"
        example = cleaned if split else f"{cleaned}-v0"
        raise RolloutError.field(
            dst,
            "-o",
            f"{wanted} (letters, digits, '-', '_'; at most {MAX_NAME_BYTES} bytes), since minari.load_dataset "
            "finds a dataset by its folder name",
            repr(name),
            f"Name the output folder like '{example}'.",
            exit_code=EXIT_USAGE,
        )
    return [f"{name}/{side}" for side in SPLIT_IDS] if split else [name]


def _box(dtype: np.dtype, shape: tuple[int, ...], where: str, field: str) -> dict[str, Any]:
    """Minari's serialised ``gymnasium.spaces.Box`` for data of ``dtype``: bounds are the dtype's own (floats
    unbounded, integers their whole range, 0..255 for uint8 images), since the env's are not recorded."""
    if dtype.kind == "f":
        low, high = -np.inf, np.inf
    elif dtype.kind in "iu":
        low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
    elif dtype.kind == "b":
        low, high = False, True
    else:
        raise RolloutError.field(
            where,
            field,
            "numbers or booleans (a Box space)",
            f"dtype {dtype}",
            "Leave this field out of the recording or convert it to numbers.",
        )
    full = np.full(shape, low, dtype=dtype), np.full(shape, high, dtype=dtype)
    return {"type": "Box", "dtype": str(dtype), "shape": list(shape), "low": full[0].tolist(), "high": full[1].tolist()}


def observation_space(plan: EpisodePlan, where: str) -> dict[str, Any]:
    """One observation group: its Box. Several: a Dict space, nested where keys hold ``/``."""
    if not plan.observations:
        raise RolloutError.field(
            where,
            "observations",
            "at least one observation group",
            "none",
            "Export a recording with observations/<key> datasets.",
        )
    if len(plan.observations) == 1:
        ((key, (dtype, shape)),) = plan.observations.items()
        return _box(np.dtype(dtype), tuple(shape), where, f"observations/{key}")
    space: dict[str, Any] = {"type": "Dict", "subspaces": {}}
    for key, (dtype, shape) in sorted(plan.observations.items()):
        node = space
        *parents, leaf = key.split("/")
        for part in parents:
            node = node["subspaces"].setdefault(part, {"type": "Dict", "subspaces": {}})
        node["subspaces"][leaf] = _box(np.dtype(dtype), tuple(shape), where, f"observations/{key}")
    return space


def action_space(plan: EpisodePlan, where: str) -> dict[str, Any]:
    """A Box over the actions' dtype, integer actions included: a Discrete space would need the number of
    actions, which the recording does not hold (counting those seen would invent it)."""
    if "actions" not in plan.fields:
        raise RolloutError.field(where, "actions", "an actions dataset", "none", "Export a recording with actions.")
    dtype, shape = plan.fields["actions"]
    return _box(np.dtype(dtype), tuple(shape), where, "actions")


def metadata(dataset_id: str, episodes: int, steps: int, spaces: tuple[dict, dict], size: int) -> str:
    """``metadata.json`` as Minari's ``MinariStorage.new`` and ``create_dataset`` write it, without ``env_spec``
    (not known): images are stored raw (``jpeg_encoding`` false)."""
    return json.dumps(
        {
            "dataset_id": dataset_id,
            "total_episodes": episodes,
            "total_steps": steps,
            "data_format": "hdf5",
            "jpeg_encoding": False,
            "observation_space": json.dumps(spaces[0]),
            "action_space": json.dumps(spaces[1]),
            "minari_version": MINARI_VERSION,
            "dataset_size": round(size / 1e6, 1),
        }
    )


def not_held(plan: EpisodePlan) -> list[str]:
    """The top-level names of the dataset's fields that a Minari episode has no place for."""
    names = [name for name in plan.fields if not any(name == h or (h[-1] == "/" and name.startswith(h)) for h in HELD)]
    return sorted({name.split("/")[0] for name in [*names, *plan.not_held]})


def warnings_for(plan: EpisodePlan, cut: int, dropped: int) -> list[str]:
    """The warning lines of an export: what Minari cannot hold, and the episodes cut for want of the
    observation after their last step (``dropped`` of them had one step and are left out whole)."""
    lines = []
    if names := not_held(plan):
        lines.append(f"minari has no place for {', '.join(names)}: not exported")
    if cut:
        whole = f" ({dropped} of one step are left out whole)" if dropped else ""
        lines.append(
            f"{cut} episodes end without the observation after their last step (not recorded): their last step "
            f"is left out of minari{whole}"
        )
    return lines
