"""The numbers ``inspect`` shows as plain data (numpy only), built per env block and merged (``merge``), so a
file larger than memory is summarised block by block with the same result as a single pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rolloutcli.core.moments import Moments, host_array

__all__ = ["EpisodeStats", "Moments"]


@dataclass
class EpisodeStats:
    """Episode-end statistics of a ``[T, N]`` dones tensor, mergeable over env blocks.

    ``length_counts[L]``: fully observed completed episodes of length L (their first step follows a done inside
    the recording); ``first_completed``: completed episodes that started before the recording; ``unfinished``:
    envs whose last episode still runs at T-1; ``trajectories``: what RSL-RL's split produces. Steps marked in
    ``autoreset`` (gymnasium's NEXT_STEP reset steps: dones is 1 there, but no transition happened) end no
    episode: they are counted in ``autoreset_steps`` only.
    """

    T: int
    length_counts: np.ndarray
    completed: int = 0
    terminations: int = 0
    time_outs: int = 0
    first_completed: int = 0
    unfinished: int = 0
    per_env: list[int] = field(default_factory=list)
    trajectories: int = 0
    autoreset_steps: int = 0

    @classmethod
    def of(
        cls, dones: object, time_outs: object | None = None, from_reset: bool = False, autoreset: object | None = None
    ) -> EpisodeStats:
        """Statistics of one env block; ``dones``/``time_outs``/``autoreset`` ``[T, n]`` 0/1 (arrays or tensors);
        ``from_reset``: every env's first step starts an episode (``recorded_from_reset``), so none is partial."""
        split_at = host_array(dones).astype(bool)  # where RSL-RL's split cuts, autoreset steps included
        reset = host_array(autoreset).astype(bool) if autoreset is not None else np.zeros_like(split_at)
        ended = split_at & ~reset
        T, n = ended.shape
        per_env = ended.sum(axis=0)
        completed = int(per_env.sum())
        timeouts = int((ended & host_array(time_outs).astype(bool)).sum()) if time_outs is not None else 0
        # Episode lengths: positions of dones per env (env-major), differences between consecutive ones (an
        # autoreset step is its own one-step segment, then left out).
        env_index, step_index = np.nonzero(split_at.T)
        first_of_env = np.ones(env_index.shape, dtype=bool)
        first_of_env[1:] = env_index[1:] != env_index[:-1]
        lengths = step_index - np.where(first_of_env, -1, np.roll(step_index, 1))
        real = ~reset.T[env_index, step_index]
        partial = first_of_env & (not from_reset) & real  # started before the recording: length unknown
        lengths = lengths[real & ~partial]
        counts = np.bincount(lengths, minlength=T + 1)[: T + 1].astype(np.int64)
        return cls(
            T,
            counts,
            completed,
            completed - timeouts,
            timeouts,
            int(partial.sum()),
            int((~split_at[-1]).sum()),
            per_env.tolist(),
            int(split_at[:-1].sum()) + n,
            int(reset.sum()),
        )

    def merge(self, other: EpisodeStats) -> EpisodeStats:
        return EpisodeStats(
            self.T,
            self.length_counts + other.length_counts,
            self.completed + other.completed,
            self.terminations + other.terminations,
            self.time_outs + other.time_outs,
            self.first_completed + other.first_completed,
            self.unfinished + other.unfinished,
            self.per_env + other.per_env,
            self.trajectories + other.trajectories,
            self.autoreset_steps + other.autoreset_steps,
        )

    def length_summary(self, percentiles: tuple[int, ...] = (5, 25, 50, 75, 95)) -> dict[str, float | int | None]:
        """Min/mean/percentiles/max of fully observed episode lengths (exact, from the counts)."""
        counts = self.length_counts
        total = int(counts.sum())
        if total == 0:
            return {"count": 0, "min": None, "mean": None, "max": None, **{f"p{p}": None for p in percentiles}}
        lengths = np.arange(counts.size, dtype=np.float64)
        cumulative = counts.cumsum()
        present = np.flatnonzero(counts)
        summary: dict[str, float | int | None] = {
            "count": total,
            "min": int(present[0]),
            "mean": float((lengths * counts).sum() / total),
            "max": int(present[-1]),
        }
        for p in percentiles:
            # nearest-rank percentile: smallest L with at least ceil(p/100 * total) episodes <= L
            rank = max(1, math.ceil(p / 100 * total))
            summary[f"p{p}"] = int(np.searchsorted(cumulative, rank))
        return summary

    def histogram(self, bins: int = 10) -> list[dict[str, int]]:
        """Equal-width bins ``[lo, hi]`` of fully observed episode lengths with their counts."""
        counts = self.length_counts
        present = np.flatnonzero(counts)
        if present.size == 0:
            return []
        lo, hi = int(present[0]), int(present[-1])
        width = max(1, math.ceil((hi - lo + 1) / bins))
        result = []
        for start in range(lo, hi + 1, width):
            stop = min(start + width - 1, hi)
            result.append({"from": start, "to": stop, "count": int(counts[start : stop + 1].sum())})
        return result
