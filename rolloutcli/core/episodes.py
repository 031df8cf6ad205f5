"""Where episodes begin and end in one file's env lanes, and the train / validation side of an episode.

Pure functions on arrays: :func:`lane_segments` cuts each env lane of ``[T, N]`` episode-end flags into the runs
of steps that belong to one episode; :func:`valid_side` draws a side from a seed and a stable identity.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import xxhash


class Segment(NamedTuple):
    """Rows ``[start, stop)`` of env ``lane`` belong to one episode; ``ended``: its last row is a done (else the
    episode goes on past the file's last row)."""

    lane: int
    start: int
    stop: int
    ended: bool


def lane_segments(dones: np.ndarray, skip: np.ndarray | None = None) -> list[Segment]:
    """The episode segments of every lane of ``dones`` ``[T, N]`` (bool), lane by lane, each lane in time order.

    A segment ends after each done row. ``skip`` ``[T, N]`` (bool) marks rows that are no step of any episode
    (gymnasium's autoreset steps, which follow a done): they belong to no segment. A segment that reaches the
    last row without a done is not ended: the episode continues in the next file of the recording.
    """
    T, N = dones.shape
    cut = dones if skip is None else dones | skip
    out: list[Segment] = []
    for lane in range(N):
        start = 0
        for row in np.flatnonzero(cut[:, lane]).tolist():
            if skip is not None and skip[row, lane]:
                if row > start:  # a skipped row inside an episode: the steps before it end nowhere
                    out.append(Segment(lane, start, row, False))
            else:
                out.append(Segment(lane, start, row + 1, True))
            start = row + 1
        if start < T:
            out.append(Segment(lane, start, T, False))
    return out


def valid_side(seed: int, identity: str, fraction: float) -> bool:
    """Whether the item named ``identity`` goes to the validation side: a hash of the seed and the identity
    alone, so adding items never moves another one, and about ``fraction`` of the items go there."""
    if fraction <= 0:
        return False
    draw = xxhash.xxh64_intdigest(identity.encode("utf-8"), seed=seed % 2**64)
    return draw < fraction * 2.0**64
