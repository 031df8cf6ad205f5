"""``rolloutcli returns``: Monte-Carlo returns-to-go of a rollout without values (offline data), in env blocks.

The input's bytes are copied to the temporary output, which gets ``returns_to_go`` (float32 ``[T, N]``) and
``returns_truncated`` (uint8 ``[T, N]``, 1 on every step of an episode cut by a time-out or by the end of the
recording) and the root attributes ``returns_gamma`` and ``returns_kind = "monte-carlo"``. Each env column is
computed alone (:mod:`rolloutcli.core.returns_to_go`), so the bytes never depend on ``--max-memory``.
Rewards holding a time-out bootstrap (``timeouts_bootstrapped``) are not raw: ``rewards_raw`` is read then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.core.moments import ExactMoments
from rolloutcli.core.returns_to_go import returns_to_go
from rolloutcli.errors import RolloutError
from rolloutcli.hdf5.filecopy import OpenCopy
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.derive import Derived, run_derive
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress

RETURNS, TRUNCATED = "returns_to_go", "returns_truncated"


def run_returns(
    src: Path,
    dst: Path | None,
    gamma: float,
    run: RunOptions,
    *,
    overwrite: bool = False,
    in_place: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``dst`` (or replace ``src`` when ``in_place``) = ``src`` + returns-to-go, truncation marks."""
    progress = progress or Progress()
    return run_derive(
        src,
        dst,
        lambda reader: _Returns(reader, gamma, progress).derived(),
        run,
        name="returns",
        overwrite=overwrite,
        in_place=in_place,
        progress=progress,
    )


def _rewards_field(reader: RolloutReader) -> str:
    """``rewards``, or ``rewards_raw`` where the rewards hold a time-out bootstrap (exit 1 without it)."""
    if reader.schema.attrs.get("timeouts_bootstrapped", False) not in (True, 1):
        return "rewards"
    raw = reader.schema.fields.get("rewards_raw")
    if raw is None or raw.shape[:2] != (reader.T, reader.N) or raw.dtype.kind != "f":
        found = "nothing" if raw is None else f"{raw.dtype} {list(raw.shape)}"
        raise RolloutError.field(
            reader.path,
            "rewards_raw",
            f"float raw rewards [T, N] = [{reader.T}, {reader.N}] (the rewards hold a time-out bootstrap: "
            "timeouts_bootstrapped is true)",
            found,
            "Run returns on the recording, before gae.",
        )
    return "rewards_raw"


class _Returns:
    """Returns-to-go as a derive job: one pass over env blocks."""

    def __init__(self, reader: RolloutReader, gamma: float, progress: Progress) -> None:
        self.reader, self.gamma, self.rewards, self.progress = reader, gamma, _rewards_field(reader), progress
        self.flags = [n for n in ("dones", "time_outs") if n in reader.schema.fields]
        self.moments, self.episodes, self.truncated = ExactMoments(), 0, 0
        self.overflows, self.first_overflow = 0, (0, 0)  # steps whose return left float32; the first (env, step)

    def derived(self) -> Derived:
        # share 3: inputs as stored + float32 copies + the two outputs per env in flight
        return Derived("returns", [self.rewards, *self.flags], 3, self.prepare, self.block, self.finish)

    def prepare(self, out: OpenCopy) -> None:
        out.create(RETURNS, self.reader.T, self.reader.N)
        out.create(TRUNCATED, self.reader.T, self.reader.N, np.uint8)

    def block(self, out: OpenCopy, start: int, stop: int) -> None:
        flags = self.reader.arrays(self.flags, start, stop)
        if self.rewards == "rewards":
            rewards = self.reader.array("rewards", start, stop)
        else:
            rewards = out.read_steps(self.rewards, start, stop).astype(np.float32)
        dones, time_outs = flags["dones"], flags.get("time_outs")
        returns, truncated = returns_to_go(rewards, dones, time_outs, self.gamma)
        out.write(RETURNS, start, stop, returns)
        out.write(TRUNCATED, start, stop, truncated)
        self._count_overflows(returns, start)
        self.moments = self.moments.merge(ExactMoments.of(returns))
        open_at_end = dones[-1] == 0
        self.episodes += int(np.count_nonzero(dones)) + int(np.count_nonzero(open_at_end))
        cut = 0 if time_outs is None else np.count_nonzero((time_outs != 0) & (dones != 0))
        self.truncated += int(cut) + int(np.count_nonzero(open_at_end))

    def _count_overflows(self, returns: np.ndarray, start: int) -> None:
        """The rewards are finite (checked on open): a non-finite return is a discounted sum past float32's
        largest value, stored as the arithmetic gives it (inf): kept, never clipped, and reported."""
        envs, steps = np.nonzero(~np.isfinite(returns.T))  # env-major: the first is the lowest env, earliest step
        if envs.size and not self.overflows:
            self.first_overflow = (start + int(envs[0]), int(steps[0]))
        self.overflows += int(envs.size)

    def finish(self, out: OpenCopy, blocks: list[tuple[int, int]]) -> dict[str, Any]:
        if self.overflows:
            env, step = self.first_overflow
            self.progress.warn(
                f"{self.reader.path}: returns_to_go overflows float32 on {self.overflows} step(s), first in env "
                f"{env} at step {step}; stored as inf. Scale the rewards down or lower --gamma."
            )
        out.set_attrs({"returns_gamma": self.gamma, "returns_kind": "monte-carlo"})
        out.set_attrs({"meaning": "discounted Monte-Carlo return-to-go of the step's episode"}, RETURNS)
        out.set_attrs(
            {"meaning": "1: the step's episode was cut by a time-out or by the end of the recording"}, TRUNCATED
        )
        return {
            "gamma": self.gamma,
            "rewards_from": self.rewards,
            "episodes": self.episodes,
            "truncated_episodes": self.truncated,
            "overflowed_steps": self.overflows,
            "returns": self.moments.as_dict(),
        }
