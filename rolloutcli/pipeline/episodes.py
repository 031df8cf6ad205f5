"""Read a dataset in episode order: :func:`plan_episodes` joins episodes across consecutive recordings (format
contract 1.2), :func:`read_chunks` yields their steps file by file, within the memory budget.

What a plan keeps per file is small: until its recording is walked, its facts (:mod:`episode_facts`: its
segments and a hash per env of its first and last observations, as bytes); then only its kept episodes and their
pieces. So a dataset of thousands of files plans in memory; the steps themselves are only read by
:func:`read_chunks`, one block of rows of one file at a time.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rolloutcli.dataset import Paths, check_agrees, dataset_reader, signature
from rolloutcli.errors import RolloutError
from rolloutcli.fields import AUTORESET
from rolloutcli.hdf5.limits import DEFAULT_MAX_MEMORY, SafetyOptions
from rolloutcli.hdf5.probe import probing_ahead
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.engine import EngineOptions, Unit, run_units
from rolloutcli.pipeline.episode_facts import END_OPEN, END_TIMEOUT, FileFacts, observation_paths, read_facts
from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan, Pieces
from rolloutcli.pipeline.lazy import Lazy

_FIX_ORDER = "Add the missing file, or export the files of each part of the recording separately."


def _order(facts: list[FileFacts], files: Sequence[Path]) -> list[list[int]]:
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
    for rec in order:
        rec.sort(key=lambda i: facts[i].index or 0)
        for a, b in itertools.pairwise(rec):
            was, now = facts[a].index or 0, facts[b].index or 0
            if now != was + 1:
                found = "the same index" if now == was else f"recording_index {now}"
                raise RolloutError(
                    f"{files[b]}: attribute 'recording_index': expected {was + 1} after {files[a]} "
                    f"(recording_index {was}) in recording {facts[a].recording}, found {found}. "
                    + ("Drop the copy." if now == was else _FIX_ORDER)
                )
    return order


def _check_continues(before: FileFacts, after: FileFacts, paths: tuple[Path, Path]) -> None:
    """Refuse (exit 1, naming both files (``paths``) and the env) a file whose first observations differ from the
    ``last_observations`` of the file before it in the recording (where that file recorded them). An env whose
    episode ended at the last step is not compared: a recorder may hold the observation that ended it there
    (TorchRL, gymnasium's DISABLED mode) while the next file starts from the reset."""
    last, first = before.last(), after.first()
    if last is None:
        return
    n = min(len(last), len(first))
    differs = np.flatnonzero(last[:n] != first[:n])
    lanes = differs[~np.isin(differs, before.lanes_done_last())]
    if len(lanes):
        raise RolloutError(
            f"{paths[1]}: field 'observations' of env {int(lanes[0])} at step 0: expected the last_observations of "
            f"{paths[0]} (the file before it in recording {after.recording}), found other values. "
            "Check that no file of the recording is missing or was replaced."
        )


@dataclass(slots=True)
class _Open:
    """An episode being walked: ``steps`` rows of its lane from row ``row0`` of plan file ``first_file`` to
    ``last_file`` (its rows are consecutive over the files of its recording: it only goes on into the next file
    from the last row of one to the first of the next)."""

    lane: int
    start: int
    partial_start: bool
    origin: tuple[int, int]
    first_file: int
    row0: int
    last_file: int = -1
    steps: int = 0


Ends = tuple[bool, bool, bool, bool]  # (partial_end, terminated, truncated, has_next)
_CUT: Ends = (True, False, False, False)


def _walk(
    rec: list[int], facts: list[FileFacts], files: Sequence[Path], first_file: int, partial: bool
) -> tuple[list[tuple[_Open, Ends]], int]:
    """The episodes of one recording (files ``rec``, numbered from ``first_file`` in the plan) with their ends,
    partial ones only where ``partial`` (kept); and how many of them are partial."""
    kept: list[tuple[_Open, Ends]] = []
    partials = 0

    def close(ep: _Open, ends: Ends) -> None:
        nonlocal partials
        if ep.partial_start or ends[0]:
            partials += 1
            if not partial:
                return  # dropped as soon as it ends: a plan never holds the episodes it leaves out
        kept.append((ep, ends))

    open_: dict[int, _Open] = {}
    offset = 0
    for pos, fi in enumerate(rec):
        f, k = facts[fi], first_file + pos
        if pos:
            _check_continues(facts[rec[pos - 1]], f, (files[rec[pos - 1]], files[fi]))
        carried, open_ = open_, {}
        for lane, start, stop, end in f.rows().tolist():
            ep = carried.pop(lane) if start == 0 and lane in carried else None
            if ep is None:
                from_start = pos == 0 and start == 0 and not f.from_reset
                ep = _Open(lane, offset + start, from_start, (f.index or 0, start), k, start)
            ep.steps, ep.last_file = ep.steps + stop - start, k
            if end != END_OPEN:
                close(ep, (False, end != END_TIMEOUT, end == END_TIMEOUT, f.has_final))
            elif stop == f.T:
                open_[lane] = ep
            else:  # cut by a skipped row without a done: nothing says how it ended
                close(ep, _CUT)
        for ep in carried.values():
            close(ep, _CUT)
        offset += f.T
    for ep in open_.values():
        close(ep, (True, False, False, facts[rec[-1]].has_last))
    return kept, partials


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
    facts: list = [None] * len(files)
    digests = np.zeros(len(files), np.int64)  # hash() of each file's fields: the fields themselves are not kept
    ids: dict[str, str] = {}
    first: dict = {}

    def done(index: int, result: tuple[FileFacts, dict]) -> None:  # in any order
        f, fields = result
        if f.recording is not None:  # one string per recording, not one per file
            f.recording = ids.setdefault(f.recording, f.recording)
        facts[index], digests[index] = f, hash(repr(sorted(fields.items())))
        if index == 0:
            first.update(fields)

    engine = engine or EngineOptions()
    serial = engine.engine == "local" and engine.workers == 1  # the units run in order, here: each probes the next
    def unit(i: int) -> Unit:  # made when the engine takes it (a list of them held ~160 B a file for the read)
        return read_facts, (files[i], safety, budget, files[i + 1] if serial and i + 1 < len(files) else None)

    run_units(Lazy(len(files), unit), engine, done)
    for i in np.flatnonzero(digests != digests[0]).tolist():  # the fields again, for the message naming both files
        check_agrees(files[0], first, files[i], signature(files[i], safety)[0])
    plan = EpisodePlan([], [], {}, {})
    plan.pieces = Pieces(plan.episodes)
    order = array("q")  # the files in reading order, as positions in ``files``: packed as ``files`` at the end
    for rec in _order(facts, files):
        recording = facts[rec[0]].recording or names[rec[0]]
        if facts[rec[0]].recording is None:
            plan.standalone[names[rec[0]]] = len(order)
        episodes, partials = _walk(rec, facts, files, len(order), partial)
        sizes, plan.partial = [facts[i].T for i in rec], plan.partial + partials
        for ep, ends in sorted(episodes, key=lambda item: (item[0].start, item[0].lane)):
            _add(plan, recording, ep, ends, sizes, len(order))
        order.extend(rec)
        for i in rec:
            facts[i] = None  # walked: what is left of the file is in the plan
    plan.files = Paths([str(files[i]) for i in order])  # a list of Path objects held ~500 B a file
    plan.left_out = 0 if partial else plan.partial
    with dataset_reader(plan.files[0], safety, check=False) as reader:
        _describe(plan, reader)
    return plan


def _add(plan: EpisodePlan, recording: str, ep: _Open, ends: Ends, sizes: list[int], k0: int) -> None:
    """Number ``ep`` (the plan's next episode) and list its pieces by file; ``sizes``: the steps of each file of
    its recording, the first being plan file ``k0``."""
    partial_end, terminated, truncated, has_next = ends
    episode = Episode(
        number=len(plan.episodes),
        recording=recording,
        lane=ep.lane,
        start=ep.start,
        steps=ep.steps,
        partial_start=ep.partial_start,
        partial_end=partial_end,
        terminated=terminated,
        truncated=truncated,
        has_next=has_next,
        first_file=ep.first_file,
        last_file=ep.last_file,
        origin=ep.origin,
    )
    plan.episodes.append(episode)
    pieces = plan.pieces
    assert isinstance(pieces, Pieces)
    row, offset = ep.row0, 0
    for k in range(ep.first_file, ep.last_file + 1):  # every file but the last to its end
        stop = min(sizes[k - k0], row + ep.steps - offset)
        pieces.add(k, episode, row, stop, offset)
        offset, row = offset + stop - row, 0


def _describe(plan: EpisodePlan, reader: RolloutReader) -> None:
    """Fill ``plan.fields`` (chunk row name -> stored dtype, one step's shape), ``observations`` and
    ``not_held`` from one file of the dataset."""
    renamed = {
        path: f"{prefix}/{key}"
        for prefix in ("observations", "final_observations")
        for key, path in observation_paths(reader, prefix).items()
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
    for key in observation_paths(reader):
        plan.observations[key] = plan.fields[f"observations/{key}"]
    plan.last = observation_paths(reader, "last_observations")


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
