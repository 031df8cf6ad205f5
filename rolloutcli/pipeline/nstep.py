"""``rolloutcli nstep``: n-step returns for off-policy learning, streamed in env blocks (a derive job).

The copy of the input gets ``nstep_returns``, ``nstep_discount`` (float32) and ``nstep_next_step`` (int64)
``[T, N]`` from :func:`rolloutcli.core.nstep.nstep_returns`, per env block, so the bytes never depend on
``--max-memory``. A time-out bootstraps from ``final_observations`` (``--timeouts final-value``) or ends the
episode like a termination (``--timeouts ignore``). Rewards that already hold RSL-RL's time-out bootstrap
(``timeouts_bootstrapped``) are never summed: the raw ones (``rewards_raw``) are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.core.moments import ExactMoments
from rolloutcli.errors import EXIT_USAGE, RolloutError
from rolloutcli.hdf5.filecopy import OpenCopy
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.derive import Derived, run_derive
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress

TIMEOUT_RULES = ("final-value", "ignore")


@dataclass(frozen=True)
class NStepOptions:
    """What ``nstep`` computes: windows of ``n`` rewards discounted by ``gamma``, time-outs by ``timeouts``."""

    n: int
    gamma: float = 0.99
    timeouts: str = "final-value"

    def check(self) -> None:
        """Usage errors (exit 2), before any file is touched."""
        if self.n < 1:
            raise RolloutError(f"--n: expected at least 1, found {self.n}.", exit_code=EXIT_USAGE)
        if not 0.0 <= self.gamma <= 1.0:
            raise RolloutError(f"--gamma: expected a number in [0, 1], found {self.gamma}.", exit_code=EXIT_USAGE)
        if self.timeouts not in TIMEOUT_RULES:
            raise RolloutError(
                f"--timeouts: expected final-value or ignore, found '{self.timeouts}'.", exit_code=EXIT_USAGE
            )


def run_nstep(
    src: Path,
    dst: Path | None,
    options: NStepOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    in_place: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``dst`` (or replace ``src`` when ``in_place``) = ``src`` + the n-step datasets and attributes."""
    options.check()
    progress = progress or Progress()

    def make(reader: RolloutReader) -> Derived:
        return _NStep(reader, options, check_nstep_source(reader, options, run.max_memory)).derived()

    return run_derive(src, dst, make, run, name="nstep", overwrite=overwrite, in_place=in_place, progress=progress)


def check_nstep_source(reader: RolloutReader, options: NStepOptions, budget: int) -> str:
    """Check what n-step windows need (final observations for time-outs); return the name of the rewards to sum
    (``rewards_raw`` where the rewards hold a time-out bootstrap). A K over T is no error: as in
    :func:`rolloutcli.core.nstep.nstep_returns`, a window stops at the rollout's end (``rollout_end``)."""
    fields = reader.schema.fields
    if options.timeouts == "final-value" and "time_outs" in fields and not reader.schema.names("final_observations"):
        count = _count_time_outs(reader, budget)
        if count:
            raise RolloutError.field(
                reader.path,
                "final_observations",
                "the observations that ended the episodes, to bootstrap the time-outs from",
                f"nothing, and {count} time-outs",
                "Record final_observations (format 1.1), or pass --timeouts ignore to treat time-outs as ends.",
            )
    if not reader.schema.attrs.get("timeouts_bootstrapped", False):
        return "rewards"
    raw, stored = fields.get("rewards_raw"), fields["rewards"]
    if raw is None or raw.shape != stored.shape or raw.dtype.kind != "f":
        found = "nothing" if raw is None else f"{raw.dtype} {list(raw.shape)}"
        raise RolloutError.field(
            reader.path,
            "rewards_raw",
            "the raw rewards (the rewards hold a time-out bootstrap: timeouts_bootstrapped is true), float, shaped "
            f"as rewards {list(stored.shape)}",
            found,
            "Run nstep on the recording (before gae bootstraps its rewards).",
        )
    return "rewards_raw"


def _count_time_outs(reader: RolloutReader, budget: int) -> int:
    return sum(
        int(np.count_nonzero(reader.array("time_outs", a, b)))
        for a, b in reader.blocks(["time_outs"], budget=max(budget // 2, 1))
    )


class _NStep:
    """The n-step job: one pass over env blocks, the attributes at the end."""

    def __init__(self, reader: RolloutReader, options: NStepOptions, rewards: str) -> None:
        self.reader, self.options, self.rewards = reader, options, rewards
        self.flags = [name for name in ("dones", "time_outs") if name in reader.schema.fields]
        self.moments = ExactMoments()
        self.counts = {"terminated": 0, "final_observation": 0, "rollout_end": 0}

    def derived(self) -> Derived:
        # share 8: the inputs as stored + float32/bool copies + four [T, N] results (int64 among them) and the
        # window masks per env in flight
        return Derived("nstep", [self.rewards, *self.flags], 8, self.prepare, self.block, self.finish)

    def prepare(self, out: OpenCopy) -> None:
        T, N = self.reader.T, self.reader.N
        out.create("nstep_returns", T, N)
        out.create("nstep_discount", T, N)
        out.create("nstep_next_step", T, N, np.int64)

    def block(self, out: OpenCopy, start: int, stop: int) -> None:
        import torch

        from rolloutcli.core.nstep import nstep_returns

        rewards = self.reader.read(self.rewards, start, stop)
        rewards = np.ascontiguousarray(rewards.reshape(rewards.shape[:2]), dtype=np.float32)
        flags = {name: torch.from_numpy(self.reader.array(name, start, stop)) for name in self.flags}
        result = nstep_returns(
            torch.from_numpy(rewards),
            flags["dones"],
            self.options.n,
            self.options.gamma,
            flags.get("time_outs"),
            timeouts=self.options.timeouts,
        )
        out.write("nstep_returns", start, stop, result.returns.numpy())
        out.write("nstep_discount", start, stop, result.discount.numpy())
        out.write("nstep_next_step", start, stop, result.next_step.numpy())
        self.moments = self.moments.merge(ExactMoments.of(result.returns.numpy()))
        self._count(result, flags.get("time_outs"))

    def _count(self, result: Any, time_outs: Any) -> None:
        """Windows that end on a termination, on a time-out that bootstraps, at the rollout's end."""
        import torch

        ended = result.next_step == -1
        bootstraps = torch.zeros_like(ended)
        if time_outs is not None and self.options.timeouts == "final-value":
            last = torch.arange(self.reader.T).unsqueeze(1) + result.steps - 1
            bootstraps = ended & time_outs.gather(0, last).bool()
        self.counts["terminated"] += int((ended & ~bootstraps).sum())
        self.counts["final_observation"] += int(bootstraps.sum())
        self.counts["rollout_end"] += int((result.next_step == self.reader.T).sum())

    def finish(self, out: OpenCopy, blocks: list[tuple[int, int]]) -> dict[str, Any]:
        options = self.options
        out.set_attrs({"nstep_n": options.n, "nstep_gamma": options.gamma, "nstep_timeouts": options.timeouts})
        names = self.reader.schema
        return {
            "n": options.n,
            "gamma": options.gamma,
            "timeouts": options.timeouts,
            "rewards": self.rewards,
            "windows": self.counts,
            "last_observations": bool(names.names("last_observations")),
            "final_observations": bool(names.names("final_observations")),
            "returns": self.moments.as_dict(),
        }
