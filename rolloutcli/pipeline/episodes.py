"""Read a dataset in episode order: :func:`plan_episodes` joins episodes across consecutive recordings (format
contract 1.2), :func:`read_chunks` yields their steps file by file, within the memory budget.

What a plan keeps per file is small (its segments and a hash per env of its first and last observation), so a
dataset of thousands of files plans in memory; the steps themselves are only read by :func:`read_chunks`, one
block of rows of one file at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from rolloutcli.core.episodes import Segment, lane_segments
from rolloutcli.dataset import check_agrees, dataset_reader, reader_signature, signature
from rolloutcli.errors import RolloutError
from rolloutcli.fields import AUTORESET
from rolloutcli.hdf5.limits import DEFAULT_MAX_MEMORY, SafetyOptions
from rolloutcli.hdf5.probe import probe_ahead, probing_ahead
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.engine import EngineOptions, run_units
from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan

_FIX_ORDER = "Add the missing file, or export the files of each part of the recording separately."


@dataclass
class _File:
    """What the plan needs of one file."""

    path: Path
    recording: str | None
    index: int | None
    from_reset: bool
    T: int
    segments: list[Segment]
    ends: dict[tuple[int, int], bool]  # (row, lane) of each done -> whether it was a time-out
    has_final: bool
    has_last: bool
    first: list[int]  # per env: hash of its first observations (every key)
    last: list[int] | None  # per env: hash of its last_observations, where recorded
    done_last: set[int]  # envs whose episode ended at the last step (the next file starts after a reset)


def _lanes_hash(arrays: list[np.ndarray], N: int) -> list[int]:
    """Per env ``n``: one hash of ``a[n]`` for every array ``a`` (``[N, ...]``), bytes as stored."""
    out = []
    for n in range(N):
        h = xxhash.xxh64()
        for a in arrays:
            h.update(np.ascontiguousarray(a[n]).tobytes())
        out.append(h.intdigest())
    return out


MAX_RECORDING_ID = 256  # characters: an id is a name (RolloutWriter's a UUID), copied into every episode's output


def _attr(reader: RolloutReader, name: str) -> Any:
    """The root attribute ``name`` as stored; bytes as UTF-8 text (bytes that are not stay bytes: refused as an
    id, never decoded with replacement characters, which would make two different ids one; a long array stays an
    array, never its description)."""
    value = reader.raw_attr(name)
    if isinstance(value, np.generic) and not isinstance(value, bytes | str):
        return value.item()
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        return value


def _shown(value: Any) -> str:
    """A hostile attribute's value as a short quote (a message stays one short line)."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} shaped {value.shape}"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}... ({type(value).__name__})"


def _flag(value: Any) -> bool:
    """A boolean attribute: true only as a bool or the integer 1 (a string "false" is not true)."""
    return isinstance(value, bool | np.bool_ | int | np.integer) and bool(value) and int(value) == 1


def _recording(reader: RolloutReader) -> tuple[str | None, int | None]:
    """``(recording_id, recording_index)`` of a file, or ``(None, None)`` for a file that stands alone."""
    rid, index = _attr(reader, "recording_id"), _attr(reader, "recording_index")
    if rid is None and index is None:
        return None, None
    if isinstance(rid, bytes):
        raise RolloutError(
            f"{reader.path}: attribute 'recording_id': expected UTF-8 text, found bytes that are not "
            f"({_shown(bytes(rid))}). Write the id as a string."
        )
    if not isinstance(rid, str) or not rid or isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise RolloutError(
            f"{reader.path}: attributes 'recording_id'/'recording_index': expected a non-empty string and an "
            f"integer >= 0 together, found {_shown(rid)} and {_shown(index)}. Write both (RolloutWriter) or neither."
        )
    if len(rid) > MAX_RECORDING_ID:
        raise RolloutError(
            f"{reader.path}: attribute 'recording_id': expected at most {MAX_RECORDING_ID} characters, found "
            f"{len(rid)}. Write a short id (RolloutWriter writes a UUID)."
        )
    if index < 0:
        raise RolloutError(
            f"{reader.path}: attribute 'recording_index': expected an integer >= 0, found {index}. "
            "Write the files' order from 0."
        )
    return rid, int(index)


def _facts(path: Path, safety: SafetyOptions | None, budget: int, ahead: Path | None = None) -> tuple[_File, dict]:
    """Read what the plan needs of one file (flags, a hash per env of the first and last observations);
    ``ahead``: the file this process reads next, probed meanwhile."""
    if ahead is not None:
        probe_ahead(ahead, safety)
    with dataset_reader(path, safety, budget=budget) as reader:  # its value check streams within the budget
        rid, index = _recording(reader)
        fields = reader.schema.fields
        dones = reader.array("dones") != 0
        skip = reader.array(AUTORESET) != 0 if AUTORESET in fields and fields[AUTORESET].env_axis == 1 else None
        outs = reader.array("time_outs") != 0 if "time_outs" in fields else np.zeros_like(dones)
        rows, lanes = np.nonzero(dones if skip is None else dones & ~skip)
        obs = _observation_paths(reader)
        first = [reader.slice(name, (0,)) for name in obs.values()]
        last_names = list(_observation_paths(reader, "last_observations").values())
        has_last = all(n in fields for n in last_names)
        facts = _File(
            path=path,
            recording=rid,
            index=index,
            from_reset=_flag(reader.attrs.get("recorded_from_reset")),
            T=reader.T,
            segments=lane_segments(dones, skip),
            ends={(r, n): bool(outs[r, n]) for r, n in zip(rows.tolist(), lanes.tolist(), strict=True)},
            has_final=all(n in fields for n in _observation_paths(reader, "final_observations").values()),
            has_last=has_last,
            first=_lanes_hash(first, reader.N),
            last=_lanes_hash([reader.slice(n) for n in last_names], reader.N) if has_last else None,
            done_last=set(np.flatnonzero(dones[-1]).tolist()) if reader.T else set(),
        )
        return facts, reader_signature(reader)


def _observation_paths(reader: RolloutReader, prefix: str = "observations") -> dict[str, str]:
    """Observation key -> dataset path under ``prefix`` (a single dataset at ``observations`` is key ``policy``)."""
    names = reader.schema.names("observation")
    paths = {n.split("/", 1)[1] if "/" in n else "policy": n for n in names}
    return {key: prefix + path[len("observations") :] for key, path in sorted(paths.items())}


def _order(facts: list[_File]) -> list[list[int]]:
    """Recordings in dataset order (by their first file), each its files' positions in ``recording_index``
    order; a file without ``recording_id`` is a recording of its own. Refuses a repeated or missing index."""
    groups: dict[str, list[int]] = {}
    order: list[list[int]] = []
    for i, f in enumerate(facts):
        if f.recording is None:
            order.append([i])
        elif f.recording not in groups:
            groups[f.recording] = [i]
            order.append(groups[f.recording])
        else:
            groups[f.recording].append(i)
    for files in order:
        files.sort(key=lambda i: facts[i].index or 0)
        for a, b in itertools.pairwise(files):
            was, now = facts[a].index or 0, facts[b].index or 0
            if now != was + 1:
                found = "the same index" if now == was else f"recording_index {now}"
                raise RolloutError(
                    f"{facts[b].path}: attribute 'recording_index': expected {was + 1} after {facts[a].path} "
                    f"(recording_index {was}) in recording {facts[a].recording}, found {found}. "
                    + ("Drop the copy." if now == was else _FIX_ORDER)
                )
    return order


def _check_continues(before: _File, after: _File) -> None:
    """Refuse (exit 1, naming both files and the env) a file whose first observations differ from the
    ``last_observations`` of the file before it in the recording (where that file recorded them). An env whose
    episode ended at the last step is not compared: a recorder may hold the observation that ended it there
    (TorchRL, gymnasium's DISABLED mode) while the next file starts from the reset."""
    if before.last is None:
        return
    for lane, (a, b) in enumerate(zip(before.last, after.first, strict=False)):
        if a != b and lane not in before.done_last:
            raise RolloutError(
                f"{after.path}: field 'observations' of env {lane} at step 0: expected the last_observations of "
                f"{before.path} (the file before it in recording {after.recording}), found other values. "
                "Check that no file of the recording is missing or was replaced."
            )


@dataclass
class _Open:
    """An episode being assembled: its pieces ``(file, row_start, row_stop)`` in time order."""

    recording: str
    lane: int
    start: int
    partial_start: bool
    pieces: list[tuple[int, int, int]]
    origin: tuple[int, int]

    @property
    def steps(self) -> int:
        return sum(stop - start for _, start, stop in self.pieces)


def _walk(rec: list[int], facts: list[_File], first_file: int, name: str) -> list[tuple[_Open, tuple]]:
    """The episodes of one recording (files ``rec``, numbered from ``first_file`` in the plan), each with
    ``(partial_end, terminated, truncated, has_next)``."""
    done: list[tuple[_Open, tuple]] = []
    open_: dict[int, _Open] = {}
    offset = 0
    for pos, fi in enumerate(rec):
        f, k = facts[fi], first_file + pos
        if pos:
            _check_continues(facts[rec[pos - 1]], f)
        carried, open_ = open_, {}
        for seg in f.segments:
            ep = carried.pop(seg.lane) if seg.start == 0 and seg.lane in carried else None
            if ep is None:
                partial = pos == 0 and seg.start == 0 and not f.from_reset
                ep = _Open(f.recording or name, seg.lane, offset + seg.start, partial, [], (f.index or 0, seg.start))
            ep.pieces.append((k, seg.start, seg.stop))
            if seg.ended:
                timeout = f.ends[(seg.stop - 1, seg.lane)]
                done.append((ep, (False, not timeout, timeout, f.has_final)))
            elif seg.stop == f.T:
                open_[seg.lane] = ep
            else:  # cut by a skipped row without a done: nothing says how it ended
                done.append((ep, (True, False, False, False)))
        done.extend((ep, (True, False, False, False)) for ep in carried.values())
        offset += f.T
    last = facts[rec[-1]]
    done.extend((ep, (True, False, False, last.has_last)) for ep in open_.values())
    return done


def plan_episodes(
    files: Sequence[Path],
    names: Sequence[str],
    *,
    partial: bool = False,
    safety: SafetyOptions | None = None,
    budget: int = DEFAULT_MAX_MEMORY,
    engine: EngineOptions | None = None,
) -> EpisodePlan:
    """The plan of ``files`` (a dataset, in its sorted order; ``names``: their names relative to its root),
    each file read (its values checked in blocks of at most ``budget`` bytes) as a unit of ``engine``.

    Raises:
        RolloutError: exit 1 for files whose fields disagree, a repeated or missing ``recording_index`` in a
            recording, or a file that does not continue the one before it (naming both files and the env).
    """
    found, digests, first = {}, {}, {}

    def done(index: int, result: tuple[_File, dict]) -> None:  # in any order; a digest kept, not the fields
        found[index], digests[index] = result[0], hash(repr(sorted(result[1].items())))
        if index == 0:
            first.update(result[1])

    engine = engine or EngineOptions()
    serial = engine.engine == "local" and engine.workers == 1  # the units run in order, here: each probes the next
    aheads = [*files[1:], None] if serial else [None] * len(files)
    run_units([(_facts, (p, safety, budget, a)) for p, a in zip(files, aheads, strict=True)], engine, done)
    for i in range(1, len(files)):
        if digests[i] != digests[0]:  # the fields again, for the one-line error naming both files
            check_agrees(files[0], first, files[i], signature(files[i], safety)[0])
    facts = [found[i] for i in range(len(files))]
    found: list[tuple[_Open, tuple]] = []
    plan_files: list[Path] = []
    standalone = {}
    for rec in _order(facts):
        episodes = _walk(rec, facts, len(plan_files), names[rec[0]])
        found.extend(sorted(episodes, key=lambda item: (item[0].start, item[0].lane)))
        if facts[rec[0]].recording is None:
            standalone[names[rec[0]]] = len(plan_files)
        plan_files.extend(facts[i].path for i in rec)
    plan = _assemble(plan_files, found, partial, safety)
    plan.standalone = standalone
    return plan


def _assemble(
    files: list[Path], found: list[tuple[_Open, tuple]], partial: bool, safety: SafetyOptions | None
) -> EpisodePlan:
    """Number the episodes kept, and describe the fields a chunk carries (from the first file)."""
    episodes, pieces = [], {}
    for ep, (partial_end, terminated, truncated, has_next) in found:
        if (ep.partial_start or partial_end) and not partial:
            continue
        episode = Episode(
            number=len(episodes),
            recording=ep.recording,
            lane=ep.lane,
            start=ep.start,
            steps=ep.steps,
            partial_start=ep.partial_start,
            partial_end=partial_end,
            terminated=terminated,
            truncated=truncated,
            has_next=has_next,
            first_file=ep.pieces[0][0],
            last_file=ep.pieces[-1][0],
            origin=ep.origin,
        )
        episodes.append(episode)
        offset = 0
        for file, start, stop in ep.pieces:
            pieces.setdefault(file, []).append((episode, start, stop, offset))
            offset += stop - start
    total_partial = sum(1 for ep, ends in found if ep.partial_start or ends[0])
    plan = EpisodePlan(files, episodes, {}, {}, left_out=0 if partial else total_partial, partial=total_partial)
    plan.pieces = pieces
    with dataset_reader(files[0], safety, check=False) as reader:
        _describe(plan, reader)
    return plan


def _describe(plan: EpisodePlan, reader: RolloutReader) -> None:
    """Fill ``plan.fields`` (chunk row name -> stored dtype, one step's shape), ``observations`` and
    ``not_held`` from one file of the dataset."""
    renamed = {
        path: f"{prefix}/{key}"
        for prefix in ("observations", "final_observations")
        for key, path in _observation_paths(reader, prefix).items()
    }
    for name, spec in reader.schema.fields.items():
        if name == AUTORESET or name.startswith("last_observations"):
            continue  # used: autoreset steps are in no episode, last observations end partial ones
        if spec.env_axis != 1:
            plan.not_held.append(name)
            continue
        row = spec.row
        shape = spec.shape[2:]
        if row is not None and row.trailing_one and shape == (1,):
            shape = ()
        dtype = np.dtype(bool) if row is not None and row.flag else spec.dtype
        plan.fields[renamed.get(name, name)] = (dtype, shape)
        plan.sources[renamed.get(name, name)] = name
    for key in _observation_paths(reader):
        plan.observations[key] = plan.fields[f"observations/{key}"]
    plan.last = _observation_paths(reader, "last_observations")


def _normalised(plan: EpisodePlan, name: str, data: np.ndarray) -> np.ndarray:
    """Rows as a chunk holds them: a scalar field's trailing 1 dropped, flags as bool, dtype as stored."""
    dtype, shape = plan.fields[name]
    if data.ndim == len(shape) + 3:
        data = data[..., 0]
    return data != 0 if dtype == np.dtype(bool) and data.dtype != dtype else data


def _next_observation(plan: EpisodePlan, reader: RolloutReader, block: dict, t0: int, ep: Episode, row: int) -> dict:
    """The observation after ``ep``'s last step (at ``row`` of the file): the one that ended it at a done, else
    the file's ``last_observations``."""
    if ep.partial_end:
        return {key: reader.slice(path, (ep.lane,)) for key, path in plan.last.items()}
    return {key: block[f"final_observations/{key}"][row - t0, ep.lane] for key in plan.observations}


def read_chunks(plan: EpisodePlan, budget: int, safety: SafetyOptions | None = None) -> Iterator[Chunk]:
    """The steps of ``plan``'s episodes, file by file, each file in blocks of rows of at most ``budget`` bytes
    (at least one row): each chunk is one episode's steps within one block, an episode's chunks in time order.

    Two blocks may be alive at once: the consumer still holds the last chunk (a view of the block before) while
    the next is read, so a block gets half the budget."""
    step_bytes = sum(int(np.prod(shape)) * dtype.itemsize for dtype, shape in plan.fields.values())
    for k, path in enumerate(probing_ahead(plan.files, safety)):
        pieces = plan.pieces.get(k)
        if not pieces:
            continue
        with dataset_reader(path, safety, check=False) as reader:
            rows = max(1, budget // 2 // max(step_bytes * reader.N, 1))
            for t0 in range(0, reader.T, rows):
                t1 = min(reader.T, t0 + rows)
                block = None  # the block before is freed before the next is read (where no chunk holds it)
                block = {
                    n: _normalised(plan, n, reader.slice(src, (slice(t0, t1),))) for n, src in plan.sources.items()
                }
                for ep, start, stop, offset in pieces:
                    a, b = max(start, t0), min(stop, t1)
                    if a >= b:
                        continue
                    chunk = Chunk(ep, offset + a - start, k, {n: v[a - t0 : b - t0, ep.lane] for n, v in block.items()})
                    if chunk.last and ep.has_next:
                        chunk.next_observation = _next_observation(plan, reader, block, t0, ep, b - 1)
                    yield chunk
