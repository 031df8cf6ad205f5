"""What a plan of episodes needs of one file of a dataset (format contract 1.2): :func:`read_facts` reads it as one
unit of work; a :class:`FileFacts` holds it until the file's recording is walked.

A dataset of 10,000 files holds 10,000 of them at once (the order of a recording's files is only known once
every file is read), so they are kept compact: a few bytes objects, no Python object per segment, env or step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from rolloutcli.core.episodes import lane_segments
from rolloutcli.dataset import dataset_reader, reader_signature
from rolloutcli.errors import RolloutError
from rolloutcli.fields import AUTORESET
from rolloutcli.hdf5.limits import SafetyOptions
from rolloutcli.hdf5.probe import probe_ahead
from rolloutcli.hdf5.reader import RolloutReader

# How a segment's last row ends it: no done there (the episode goes on past the file, or a skipped row cut it),
# a done, a done that is a time-out.
END_OPEN, END_DONE, END_TIMEOUT = 0, 1, 2


@dataclass(slots=True)
class FileFacts:
    """What the plan needs of one file.

    ``segments``: rows ``(lane, start, stop, end)`` as bytes (of :func:`_row_type`), lane by lane, each lane in
    time order (see :func:`lane_segments`); ``end``: ``END_*``. Only for a file of a recording (``None`` for a
    file alone, never compared with another): ``hashes``, uint64 per env of the hash of its first observations
    (every key), then, where ``has_last``, of its ``last_observations``; ``done_last``, int64 envs whose episode
    ended at the last step (the next file starts after a reset).
    """

    recording: str | None
    index: int | None
    T: int
    N: int
    from_reset: bool
    has_final: bool
    has_last: bool
    segments: bytes
    hashes: bytes | None = None
    done_last: bytes | None = None

    def rows(self) -> np.ndarray:
        return np.frombuffer(self.segments, _row_type(self.T)).reshape(-1, 4)

    def first(self) -> np.ndarray:
        return np.frombuffer(self.hashes or b"", np.uint64)[: self.N]

    def last(self) -> np.ndarray | None:
        return np.frombuffer(self.hashes or b"", np.uint64)[self.N :] if self.has_last else None

    def lanes_done_last(self) -> np.ndarray:
        return np.frombuffer(self.done_last or b"", np.int64)


def _lanes_hash(arrays: list[np.ndarray], N: int) -> np.ndarray:
    """Per env ``n``: one hash of ``a[n]`` for every array ``a`` (``[N, ...]``), bytes as stored."""
    out = np.empty(N, np.uint64)
    for n in range(N):
        h = xxhash.xxh64()
        for a in arrays:
            h.update(np.ascontiguousarray(a[n]).tobytes())
        out[n] = h.intdigest()
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


def _row_type(T: int) -> type:
    """The integers of a file's segment rows: int32 where its steps fit (half the bytes held a file), else int64."""
    return np.int32 if T < 2**31 else np.int64


def _segments(dones: np.ndarray, skip: np.ndarray | None, outs: np.ndarray) -> bytes:
    """The rows of :attr:`FileFacts.segments`."""
    rows = [
        (s.lane, s.start, s.stop, END_OPEN if not s.ended else END_TIMEOUT if outs[s.stop - 1, s.lane] else END_DONE)
        for s in lane_segments(dones, skip)
    ]
    return np.array(rows, _row_type(len(dones))).reshape(-1, 4).tobytes()


def read_facts(
    path: Path, safety: SafetyOptions | None, budget: int, ahead: Path | None = None
) -> tuple[FileFacts, dict]:
    """Read what the plan needs of one file (flags, a hash per env of the first and last observations), and its
    fields' signature; ``ahead``: the file this process reads next, probed meanwhile."""
    if ahead is not None:
        probe_ahead(ahead, safety)
    with dataset_reader(path, safety, budget=budget) as reader:  # its value check streams within the budget
        rid, index = _recording(reader)
        fields = reader.schema.fields
        dones = reader.array("dones") != 0
        skip = reader.array(AUTORESET) != 0 if AUTORESET in fields and fields[AUTORESET].env_axis == 1 else None
        outs = reader.array("time_outs") != 0 if "time_outs" in fields else np.zeros_like(dones)
        first = [reader.slice(name, (0,)) for name in observation_paths(reader).values()]
        last_names = list(observation_paths(reader, "last_observations").values())
        has_last = all(n in fields for n in last_names)
        hashes = [_lanes_hash(first, reader.N)]
        if has_last:
            hashes.append(_lanes_hash([reader.slice(n) for n in last_names], reader.N))
        facts = FileFacts(
            recording=rid,
            index=index,
            T=reader.T,
            N=reader.N,
            from_reset=_flag(reader.attrs.get("recorded_from_reset")),
            has_final=all(n in fields for n in observation_paths(reader, "final_observations").values()),
            has_last=has_last,
            segments=_segments(dones, skip, outs),
        )
        if rid is not None:  # a file alone is never compared with another
            facts.hashes = np.concatenate(hashes).tobytes()
            facts.done_last = np.flatnonzero(dones[-1]).astype(np.int64).tobytes() if reader.T else b""
        return facts, reader_signature(reader)


def observation_paths(reader: RolloutReader, prefix: str = "observations") -> dict[str, str]:
    """Observation key -> dataset path under ``prefix`` (a single dataset at ``observations`` is key ``policy``)."""
    names = reader.schema.names("observation")
    paths = {n.split("/", 1)[1] if "/" in n else "policy": n for n in names}
    return {key: prefix + path[len("observations") :] for key, path in sorted(paths.items())}
