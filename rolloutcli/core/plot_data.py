"""What ``rolloutcli plot`` draws, as plain numpy data computed per env block and merged (no matplotlib here).

* Episodes: the return (sum of rewards) and length of every completed episode whose first step lies in the
  recording (or every one when the recording starts at a reset), and whether it ended on a time-out; and the
  part inside the recording of every episode it cuts (started before it or still running at its end: an
  RSL-RL rollout of T=24 steps holds little else), and how many episodes ended in it.
* Reward per step: mean, std, min and max over envs of the rewards of each step.
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
    partial_returns: list[np.ndarray] = field(default_factory=list)
    partial_lengths: list[np.ndarray] = field(default_factory=list)
    ended: int = 0
    ended_time_outs: int = 0

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
        self.ended += int(ended.sum())
        self.ended_time_outs += int(flags.sum())
        self._add_partial(sums, env, step, first, from_reset)

    def _add_partial(
        self, sums: np.ndarray, env: np.ndarray, step: np.ndarray, first: np.ndarray, from_reset: bool
    ) -> None:
        """The episodes cut by the recording: the head of each env (unless ``from_reset``) and its running tail."""
        T, n = sums.shape
        last = np.ones(env.shape, dtype=bool)
        last[:-1] = env[1:] != env[:-1]
        tail_start = np.zeros(n, dtype=np.int64)  # an env without a done is one episode cut at both ends
        tail_start[env[last]] = step[last] + 1
        running = tail_start < T
        before = np.where(tail_start > 0, sums[np.maximum(tail_start - 1, 0), np.arange(n)], 0.0)
        returns, lengths = [(sums[-1] - before)[running]], [(T - tail_start)[running]]
        if not from_reset:  # a head that ends in the recording (a head without a done is the tail above)
            returns.append(sums[step[first], env[first]])
            lengths.append(step[first] + 1)
        self.partial_returns.append(np.concatenate(returns))
        self.partial_lengths.append(np.concatenate(lengths))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
        return join(self.returns, np.float64), join(self.lengths, np.int64), join(self.time_outs, bool)

    def partial(self) -> tuple[np.ndarray, np.ndarray]:
        """Returns (float64) and lengths of the parts of the episodes cut by the recording, in block order."""
        join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
        return join(self.partial_returns, np.float64), join(self.partial_lengths, np.int64)


@dataclass
class PerStep:
    """Mean, std, min and max over envs of each step's reward, merged over env blocks (float64 sums)."""

    T: int
    count: int = 0
    total: np.ndarray = field(init=False)
    squares: np.ndarray = field(init=False)
    low: np.ndarray = field(init=False)
    high: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.total, self.squares = np.zeros(self.T), np.zeros(self.T)
        self.low, self.high = np.full(self.T, np.inf), np.full(self.T, -np.inf)

    def add(self, rewards: np.ndarray) -> None:
        """One ``[T, n]`` block of rewards."""
        values = rewards.astype(np.float64)
        self.count += values.shape[1]
        self.total += values.sum(axis=1)
        self.squares += (values * values).sum(axis=1)
        self.low, self.high = np.minimum(self.low, values.min(axis=1)), np.maximum(self.high, values.max(axis=1))

    def as_dict(self) -> dict[str, np.ndarray]:
        mean = self.total / max(self.count, 1)
        std = np.sqrt(np.maximum(self.squares / max(self.count, 1) - mean * mean, 0.0))
        return {"mean": mean, "std": std, "min": self.low, "max": self.high}


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
