"""What ``rolloutcli plot`` draws, as plain numpy data computed per env block and merged (no matplotlib here).

* Episodes: the return (sum of rewards) and length of every completed episode whose first step lies in the
  recording (or every one when the recording starts at a reset), and whether it ended on a time-out.
* Histograms with edges fixed in advance (from a first pass's min/max), so blocks merge by adding counts.
* The padding blow-up of ``split``: trajectories end at dones and at the last step of every env; with
  ``--max-length L`` each is cut into ``ceil(len / L)`` pieces padded to ``min(T, L)`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Episodes:
    """Completed episodes: returns (float64), lengths and time-out flags, in block order."""

    returns: list[np.ndarray] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    time_outs: list[np.ndarray] = field(default_factory=list)

    def add(self, rewards: np.ndarray, dones: np.ndarray, time_outs: np.ndarray | None, from_reset: bool) -> None:
        """The episodes of one env block ``[T, n]`` (``from_reset``: the first episode of each env is whole)."""
        ended = dones.astype(bool)
        sums = np.cumsum(rewards.astype(np.float64), axis=0)
        env, step = np.nonzero(ended.T)  # env-major, ascending steps
        first = np.ones(env.shape, dtype=bool)
        first[1:] = env[1:] != env[:-1]
        end_sum = sums[step, env]
        prev_step = np.where(first, -1, np.roll(step, 1))
        prev_sum = np.where(first, 0.0, np.roll(end_sum, 1))
        keep = np.ones(env.shape, dtype=bool) if from_reset else ~first
        self.returns.append((end_sum - prev_sum)[keep])
        self.lengths.append((step - prev_step)[keep])
        flags = time_outs.astype(bool)[step, env] if time_outs is not None else np.zeros(env.shape, dtype=bool)
        self.time_outs.append(flags[keep])

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
        return join(self.returns, np.float64), join(self.lengths, np.int64), join(self.time_outs, bool)


def split_length_counts(dones: np.ndarray) -> np.ndarray:
    """``[T + 1]`` counts of the lengths of split's trajectories in a ``[T, n]`` block."""
    ended = dones.astype(bool).copy()
    T = ended.shape[0]
    ended[-1] = True  # the last step of every env closes its trajectory
    env, step = np.nonzero(ended.T)
    first = np.ones(env.shape, dtype=bool)
    first[1:] = env[1:] != env[:-1]
    lengths = step - np.where(first, -1, np.roll(step, 1))
    return np.bincount(lengths, minlength=T + 1)[: T + 1]


def padding_blowup(length_counts: np.ndarray, num_envs: int, max_lengths: list[int]) -> list[float]:
    """Padded rows / ``T * N`` for each ``--max-length`` L (``split --pad-to rollout``)."""
    T = length_counts.shape[0] - 1
    lengths = np.arange(T + 1)
    out = []
    for L in max_lengths:
        pieces = int((length_counts * -(-lengths // L)).sum())
        out.append(pieces * min(T, L) / (T * num_envs))
    return out


def max_length_grid(steps: int) -> list[int]:
    """1, 2, 4, ... up to T, and T."""
    grid = [1 << i for i in range(max(steps.bit_length(), 1)) if 1 << i < steps]
    return [*grid, steps]


@dataclass
class Histogram:
    """Counts of finite values in ``bins`` equal bins over ``[low, high]`` (one bin when low == high)."""

    low: float
    high: float
    bins: int = 40
    counts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.bins, dtype=np.int64)

    @property
    def edges(self) -> np.ndarray:
        if self.high > self.low:
            return np.linspace(self.low, self.high, self.bins + 1)
        return np.linspace(self.low - 0.5, self.low + 0.5, self.bins + 1)  # one value: centred

    def add(self, values: np.ndarray) -> None:
        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        flat = flat[np.isfinite(flat)]
        self.counts += np.histogram(flat, self.edges)[0]
