"""``export --to minari``: a dataset's episodes as a Minari dataset folder, written chunk by chunk.

Layout (Minari's HDF5 storage; ids, spaces and metadata in :mod:`rolloutcli.pipeline.minari_layout`):
``OUT/data/main_data.hdf5`` holds ``episode_<k>`` (k = 0, 1, ... in episode order) with ``observations``
(``[L + 1, ...]``: one dataset for one observation group, a group of them for several), ``actions``,
``rewards`` (stored dtypes), ``terminations``, ``truncations`` (bool), and ``infos/source_file`` (index into the
root attribute ``source_files``) beside the recording's own ``infos/*``; ``OUT/data/metadata.json`` says what
Minari needs. With a split, ``OUT/train-v0`` and ``OUT/valid-v0`` are two such folders.

Every dataset is created at its final size from the plan before a chunk is read, then each chunk is written at
its place, so memory holds one chunk; each episode's rows are counted and a missing one is refused (a
preallocated row never written would be an invented zero).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.hdf5.export_marker import MARKER
from rolloutcli.hdf5.safety import translate_write_error
from rolloutcli.hdf5.writer import cap_metadata_cache
from rolloutcli.pipeline import minari_layout as layout
from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan

# What h5py raises on a failed write: OS faults (exit 3 with their fix), and libhdf5's refusals.
_OUTPUT_ERRORS = (OSError, RuntimeError, MemoryError, TypeError, ValueError, KeyError)
SOURCE_FILE = "infos/source_file"
Valid = Callable[[Episode], bool] | None


@dataclass
class _Slot:
    """One output episode: its group, the steps it keeps, and the rows written so far."""

    group: h5py.Group
    kept: int
    written: dict[str, int] = field(default_factory=dict)


@dataclass
class _Side:
    """One Minari dataset being written (the whole export, or one side of a split)."""

    folder: Path
    dataset_id: str
    file: h5py.File
    episodes: int = 0
    steps: int = 0


def output_kind(split: bool) -> str:
    """A Minari dataset is a folder (a split: a folder of two)."""
    return "folder"


def _untimed_group(parent: h5py.Group, name: str) -> h5py.Group:
    """A group without modification times (equal exports give equal bytes)."""
    plist = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    plist.set_obj_track_times(False)
    h5py.h5g.create(parent.id, name.encode(), gcpl=plist)
    return parent[name]


def _create(group: h5py.Group, name: str, rows: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """A resizable, chunked dataset as Minari creates them (``update_dataset_from_buffer`` appends to it)."""
    parent, _, leaf = name.rpartition("/")
    for depth, part in enumerate(parent.split("/") if parent else []):
        where = "/".join(parent.split("/")[:depth])
        holder = group[where] if where else group
        if part not in holder:
            _untimed_group(holder, part)
    (group[parent] if parent else group).create_dataset(
        leaf, shape=(rows, *shape), dtype=dtype, maxshape=(None, *shape), chunks=True, track_times=False
    )


def _outputs(plan: EpisodePlan) -> dict[str, tuple[str, np.dtype, tuple[int, ...], int]]:
    """Output name -> (chunk row, dtype, one step's shape, extra rows): what each episode holds."""
    single = len(plan.observations) == 1
    out = {}
    for key, (dtype, shape) in plan.observations.items():
        out["observations" if single else f"observations/{key}"] = (f"observations/{key}", dtype, shape, 1)
    out["actions"] = ("actions", *plan.fields["actions"], 0)
    out["rewards"] = ("rewards", plan.fields["rewards"][0], (), 0)
    out["terminations"] = ("dones", np.dtype(bool), (), 0)
    out["truncations"] = ("time_outs", np.dtype(bool), (), 0)
    for name, (dtype, shape) in plan.fields.items():
        if name.startswith("infos/"):
            if name == SOURCE_FILE:
                raise RolloutError.field(
                    plan.files[0],
                    name,
                    f"no field named {name} (the export keeps each step's file there)",
                    "one",
                    "Rename that info in the recording.",
                )
            out[name] = (name, dtype, shape, 0)
    out[SOURCE_FILE] = ("", np.dtype(np.int32), (), 0)
    return out


def _allocate(side: _Side, episode: Episode, kept: int, outputs: dict) -> _Slot:
    """Episode group ``episode_<k>`` with every dataset at its final size, and the attributes Minari reads
    (``id``, ``total_steps``) beside ours, which its readers pass on as episode metadata."""
    group = _untimed_group(side.file, f"episode_{side.episodes}")
    for name, (_, dtype, shape, extra) in outputs.items():
        _create(group, name, kept + extra, np.dtype(dtype), tuple(shape))
    group.attrs.update(
        {
            "id": side.episodes,
            "total_steps": kept,
            "recording": episode.recording,
            "lane": episode.lane,
            "start_step": episode.start,
            "partial_start": episode.partial_start,
            "partial_end": episode.partial_end,
            "last_step_left_out": kept < episode.steps,
        }
    )
    side.episodes += 1
    side.steps += kept
    return _Slot(group, kept)


def _write(slot: _Slot, chunk: Chunk, outputs: dict, where: Path) -> None:
    """The chunk's rows at their place; the observation after the last step where the episode keeps it."""
    start = chunk.offset
    stop = min(chunk.offset + chunk.steps, slot.kept)
    for name, (row, _, shape, extra) in outputs.items():
        if name == SOURCE_FILE:
            values = np.full(stop - start, chunk.file, dtype=np.int32)
        elif name in ("terminations", "truncations"):
            dones = chunk.rows["dones"][: stop - start].astype(bool)
            outs = chunk.rows.get("time_outs")
            outs = np.zeros_like(dones) if outs is None else outs[: stop - start].astype(bool)
            values = outs if name == "truncations" else dones & ~outs
        else:
            values = chunk.rows[row][: chunk.steps if extra else stop - start]
        if values.shape[1:] != tuple(shape):
            raise RolloutError.field(
                where,
                row,
                f"steps shaped {tuple(shape)} as in the first file",
                f"{values.shape[1:]}",
                "Export files of one recording setup together.",
            )
        if len(values):
            slot.group[name][start : start + len(values)] = values
        slot.written[name] = slot.written.get(name, 0) + len(values)
        if extra and chunk.last and slot.kept == chunk.episode.steps and chunk.next_observation is not None:
            slot.group[name][slot.kept] = chunk.next_observation[row.split("/", 1)[1]]
            slot.written[name] += 1


def _check_complete(slots: dict[int, _Slot], outputs: dict, where: Path) -> None:
    for number, slot in slots.items():
        for name, (_, _, _, extra) in outputs.items():
            if slot.written.get(name, 0) != slot.kept + extra:
                raise RolloutError(
                    f"{where}: episode {number}: expected {slot.kept + extra} rows of {name}, found "
                    f"{slot.written.get(name, 0)} written; nothing is published. Report this as a bug.",
                )


def _open_sides(out: Path, plan: EpisodePlan, ids: list[str], sides: list[_Side]) -> None:
    """Open each dataset's ``main_data.hdf5`` into ``sides`` (closed by the caller, even if one fails)."""
    split = len(ids) > 1
    for dataset_id in ids:
        folder = (out / dataset_id.split("/", 1)[1] if split else out) / "data"
        folder.mkdir(parents=True, exist_ok=True)
        handle = h5py.File(folder / "main_data.hdf5", "w")
        cap_metadata_cache(handle.id)
        handle.attrs["source_files"] = [path.name for path in plan.files]
        handle.attrs[MARKER] = "minari"  # an earlier export --overwrite may replace
        sides.append(_Side(folder, dataset_id, handle))


def _fill(sides: list[_Side], plan: EpisodePlan, chunks: Iterable[Chunk], valid: Valid, out: Path) -> tuple[int, int]:
    """Allocate every episode, write every chunk; (episodes cut, episodes left out whole)."""
    outputs = _outputs(plan)
    slots: dict[int, _Slot] = {}
    cut = dropped = 0
    for episode in sorted(plan.episodes, key=lambda e: e.number):
        kept = episode.steps - (0 if episode.has_next else 1)  # Minari needs the observation after each step
        cut += kept < episode.steps
        if kept == 0:
            dropped += 1
            continue
        side = sides[1] if valid is not None and valid(episode) else sides[0]
        slots[episode.number] = _allocate(side, episode, kept, outputs)
    for chunk in chunks:
        if (slot := slots.get(chunk.episode.number)) is not None:
            _write(slot, chunk, outputs, plan.files[chunk.file])
    _check_complete(slots, outputs, out)
    return cut, dropped


def export_minari(
    out: Path, plan: EpisodePlan, chunks: Iterable[Chunk], valid: Valid, *, label: Path | None = None
) -> list[str]:
    """Write ``plan``'s episodes (read from ``chunks``) as a Minari dataset at ``out`` (two with ``valid``:
    ``out/train-v0`` and ``out/valid-v0``); the warning lines. ``label``: the destination the user gave, which
    names the dataset and the messages (``out`` may be its temporary); ``out`` when None."""
    shown = Path(label or out)
    where = plan.files[0] if plan.files else shown
    spaces = (layout.observation_space(plan, str(where)), layout.action_space(plan, str(where)))
    ids = layout.dataset_ids(shown, valid is not None)
    sides: list[_Side] = []
    try:
        try:
            _open_sides(out, plan, ids, sides)
            cut, dropped = _fill(sides, plan, chunks, valid, shown)
        finally:
            for side in sides:
                side.file.close()
        for side in sides:
            size = (side.folder / "main_data.hdf5").stat().st_size
            text = layout.metadata(side.dataset_id, side.episodes, side.steps, spaces, size)
            (side.folder / "metadata.json").write_text(text)
    except _OUTPUT_ERRORS as exc:
        error = translate_write_error(shown, exc)
        if error.exit_code != EXIT_IO:  # not an OS fault: h5py refused a write of ours
            error = RolloutError(f"{shown}: cannot write the output ({str(exc).splitlines()[0]}).", exit_code=EXIT_IO)
        raise error from exc
    return layout.warnings_for(plan, cut, dropped)
