"""``rolloutcli gae``: advantages and returns for a rollout file, streamed in env blocks.

The input's bytes are copied to the temporary output, which gets ``advantages``, ``returns`` and, when this
run bootstraps time-outs, the bootstrapped ``rewards`` (the recorded ones kept as ``rewards_raw``). GAE runs
per env block with RSL-RL's float32 loop (:mod:`rolloutcli.core.gae_numpy`); normalising uses the exactly
rounded moments of all advantages, so the bytes never depend on ``--max-memory``, threads or the install.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rolloutcli.core.gae_numpy import gae_arrays, normalize_array
from rolloutcli.core.moments import ExactMoments
from rolloutcli.core.timeouts import BOOTSTRAPPING, apply_timeouts, decide_rule
from rolloutcli.errors import EXIT_BAD_DATA, RolloutError, problem_line
from rolloutcli.hdf5.filecopy import OpenCopy
from rolloutcli.hdf5.reader import RolloutReader
from rolloutcli.pipeline.derive import Derived, run_derive
from rolloutcli.pipeline.options import RunOptions
from rolloutcli.pipeline.progress import Progress
from rolloutcli.pipeline.timeouts_rule import DEFAULT_NOTE, recorded_rule

WRITTEN = ("advantages", "returns")


@dataclass(frozen=True)
class GaeOptions:
    """What ``gae`` computes; ``bootstrap_timeouts`` None: when ``time_outs`` exists; ``last_values``
    ``"recorded"`` (require the dataset) or ``"zero"`` (the rollout end is terminal); ``timeouts``: the
    time-out rule (:mod:`rolloutcli.core.timeouts`), None: from ``bootstrap_timeouts`` (True ``rsl``, False
    ``ignore``), else from the file (:func:`applied_options`)."""

    gamma: float = 0.99
    lam: float = 0.95
    normalize: bool = True
    bootstrap_timeouts: bool | None = None
    last_values: str = "recorded"
    timeouts: str | None = None

    @property
    def rule(self) -> str:
        if self.timeouts is not None:
            return self.timeouts
        return "ignore" if self.bootstrap_timeouts is False else "rsl"

    @property
    def explicit(self) -> str | None:
        """The rule the user named (``--timeouts`` or its aliases), None when not named."""
        return None if self.timeouts is None and self.bootstrap_timeouts is None else self.rule

    @property
    def requires_time_outs(self) -> bool:
        """Asked for a rule that needs ``time_outs`` (not the default, which applies when they exist)."""
        return self.rule != "ignore" and (self.timeouts is not None or bool(self.bootstrap_timeouts))


def applied_options(reader: RolloutReader, options: GaeOptions) -> tuple[GaeOptions, str]:
    """The options with the rule ``gae`` applies to this file and where it came from (``option``, ``file``:
    its ``timeouts_rule``, ``default``); the same on a ``gae`` output, whose ``gae_timeouts`` only records."""
    explicit = options.explicit  # when given, the file's attribute is not read (not even checked)
    rule, source = decide_rule(explicit, None if explicit else recorded_rule(reader.path, reader.schema.attrs))
    return (replace(options, timeouts=rule) if source == "file" else options), source


@dataclass(frozen=True)
class _Rewards:
    """Where this run's rewards come from: ``bootstrap``: this run bootstraps time-outs; ``already``: the
    input's rewards hold a bootstrap with this gamma; ``raw``: the copy's dataset of raw rewards (an earlier
    run with another gamma), None: the input's ``rewards``."""

    bootstrap: bool
    already: bool
    raw: str | None


def run_gae(
    src: Path,
    dst: Path | None,
    options: GaeOptions,
    run: RunOptions,
    *,
    overwrite: bool = False,
    in_place: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``dst`` (or replace ``src`` when ``in_place``) = ``src`` + advantages, returns, attributes."""
    progress = progress or Progress()

    def make(reader: RolloutReader) -> Derived:
        applied, source = applied_options(reader, options)
        _check_fields(reader, applied, source)
        return _Gae(reader, applied, _plan_rewards(reader, applied), progress, source).derived()

    return run_derive(src, dst, make, run, name="gae", overwrite=overwrite, in_place=in_place, progress=progress)


def _check_fields(reader: RolloutReader, options: GaeOptions, source: str) -> None:
    """Everything GAE needs is there (every problem at once, exit 1). A rule from the file acts on the
    time-outs where there are any, as the default does."""
    fields, recorded = reader.schema.fields, options.last_values == "recorded"
    rule, named = options.rule, "--bootstrap-timeouts" if options.timeouts is None else f"--timeouts {options.rule}"
    if source == "file":
        named = f"the file's timeouts_rule {rule}"
    acts = source == "option" or "time_outs" in fields
    missing = [
        (
            "values",
            "values" not in fields,
            "a dataset [T, N] of V(s_t)",
            "gae needs the critic's values; record them. Data without a critic (imported, offline): "
            f"rolloutcli returns {reader.path} -o OUT.h5 gives Monte-Carlo returns-to-go.",
        ),
        (
            "last_values",
            recorded and "last_values" not in fields,
            "a dataset [N] of V(s_T) to bootstrap the rollout end",
            "Record it, or pass --last-values zero to treat the end of the rollout as terminal.",
        ),
        (
            "time_outs",
            options.requires_time_outs and source == "option" and "time_outs" not in fields,
            f"a dataset [T, N] for {named}",
            "Record time-outs, or pass "
            + ("--no-bootstrap-timeouts." if options.timeouts is None else "--timeouts ignore."),
        ),
        (
            "final_values",
            acts and rule == "final-value" and "final_values" not in fields,
            f"a dataset [T, N] of V(final observation) for {named}",
            "Record final values (the critic on the observation that ended the episode), or pass --timeouts rsl.",
        ),
    ]
    problems = [problem_line(reader.path, name, what, "nothing", fix) for name, bad, what, fix in missing if bad]
    if problems:
        raise RolloutError.many(reader.path, problems)


def _flag_attribute(path: Path, attrs: dict[str, Any], name: str) -> bool:
    """A root attribute that must be a boolean (or 0/1); False when absent."""
    value = attrs.get(name, False)
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise RolloutError(
        f"{path}: attribute '{name}': expected a boolean (true/false or 0/1), found {value!r}. Set it to a "
        f"boolean (h5py: f.attrs['{name}'] = False).",
        exit_code=EXIT_BAD_DATA,
    )


def _plan_rewards(reader: RolloutReader, options: GaeOptions) -> _Rewards:
    """Decide the rewards' source and bootstrap; never mixes two gammas (see :class:`_Rewards`)."""
    fields, attrs, rule = reader.schema.fields, reader.schema.attrs, options.rule
    wanted = rule in BOOTSTRAPPING and "time_outs" in fields
    if not _flag_attribute(reader.path, attrs, "timeouts_bootstrapped"):
        return _Rewards(bootstrap=wanted, already=False, raw=None)
    recorded, recorded_rule = attrs.get("gae_gamma"), attrs.get("gae_timeouts", "rsl")
    same_gamma = not isinstance(recorded, (int, float)) or float(recorded) == float(options.gamma)
    if same_gamma and recorded_rule == rule:
        return _Rewards(bootstrap=False, already=True, raw=None)  # bootstrapped with this rule: never twice
    if "rewards_raw" not in fields:
        if not same_gamma:
            expected = (
                f"the raw rewards to bootstrap with --gamma {options.gamma} (the rewards hold a time-out "
                f"bootstrap with gae_gamma {recorded})"
            )
            fix = f"Pass --gamma {recorded}, or run gae on the recording with its raw rewards."
        else:
            expected = (
                f"the raw rewards for --timeouts {rule} (the rewards hold a '{recorded_rule}' time-out bootstrap)"
            )
            fix = f"Pass --timeouts {recorded_rule}, or run gae on the recording with its raw rewards."
        raise RolloutError.field(reader.path, "rewards_raw", expected, "nothing", fix)
    raw, stored = fields["rewards_raw"], fields["rewards"]
    if raw.shape != stored.shape or raw.dtype.kind != "f":
        raise RolloutError.field(
            reader.path,
            "rewards_raw",
            f"float raw rewards of the shape of rewards {list(stored.shape)}",
            f"{raw.dtype} {list(raw.shape)}",
            "Store the recorded rewards there, or run gae on the recording.",
        )
    return _Rewards(bootstrap=wanted, already=False, raw="rewards_raw" if wanted else "rewards")


def _prepare_output(out: OpenCopy, rewards: _Rewards, steps: int, envs: int) -> None:
    """Make room in the copy for this run's datasets (see :class:`_Rewards`)."""
    if rewards.raw is None and rewards.bootstrap:
        out.rename("rewards", "rewards_raw")
        out.set_attrs({"meaning": "rewards as recorded, before time-out bootstrapping"}, "rewards_raw")
    elif rewards.raw == "rewards":  # an earlier run's bootstrap is undone: the raw rewards are the rewards again
        out.rename("rewards_raw", "rewards")
    for name in (*WRITTEN, "rewards") if rewards.bootstrap else WRITTEN:
        out.create(name, steps, envs)


def _block_inputs(
    reader: RolloutReader, out: OpenCopy, plan: _Rewards, block: dict[str, np.ndarray], options: GaeOptions, span: slice
) -> tuple[np.ndarray, np.ndarray, int]:
    """Float32 rewards and uint8 dones of one env block for the kernel under this run's time-out rule (rewards
    bootstrapped in their stored precision) and the number of time-outs the rule acted on."""
    if plan.raw is not None:
        raw = out.read_steps(plan.raw, span.start, span.stop)
    elif plan.bootstrap:
        raw = reader.read("rewards", span.start, span.stop)
        raw = raw.reshape(raw.shape[:2])
    else:
        raw = block["rewards"]
    raw = raw.astype(np.float64 if raw.dtype == np.float64 else np.float32, copy=False)
    time_outs = block.get("time_outs")
    rule = options.rule if plan.bootstrap or options.rule not in BOOTSTRAPPING else "ignore"
    if plan.already:  # the rewards hold this rule's bootstrap; nothing else to do
        time_outs = None
    r, d = apply_timeouts(
        rule, raw, block["values"], block["dones"], time_outs, options.gamma, block.get("final_values")
    )
    count = 0 if time_outs is None else int(np.count_nonzero(time_outs))
    return np.ascontiguousarray(r, dtype=np.float32), np.ascontiguousarray(d), count


class _Gae:
    """GAE as a derive job: pass 1 per env block, then (when normalising) ``(A - mean) / (std + 1e-8)``."""

    def __init__(
        self, reader: RolloutReader, options: GaeOptions, rewards: _Rewards, progress: Progress, source: str
    ) -> None:
        self.reader, self.options, self.rewards, self.progress = reader, options, rewards, progress
        self.source = source  # where the time-out rule came from (applied_options)
        as_read = rewards.raw is None and not rewards.bootstrap  # else _block_inputs reads them in their own dtype
        self.needed = ["values", "dones"] + (["rewards"] if as_read else [])
        if "time_outs" in reader.schema.fields and (rewards.bootstrap or options.rule not in BOOTSTRAPPING):
            self.needed.append("time_outs")
        if rewards.bootstrap and options.rule == "final-value":
            self.needed.append("final_values")
        if "last_values" in reader.schema.fields and options.last_values == "recorded":
            self.needed.append("last_values")
        self.raw, self.returns, self.bootstrapped = ExactMoments(), ExactMoments(), 0
        self.kept: np.ndarray | None = None  # the advantages of a file read in one block, kept for pass 2

    def derived(self) -> Derived:
        fields = self.reader.schema.fields
        inputs = [n for n in ("rewards", "values", "dones", "time_outs", "final_values") if n in fields]
        # share 4: inputs as stored + float32 copies + A, R (and bootstrapped rewards) per env in flight
        return Derived("gae", inputs, 4, self.prepare, self.block, self.finish)

    def prepare(self, out: OpenCopy) -> None:
        _prepare_output(out, self.rewards, self.reader.T, self.reader.N)

    def block(self, out: OpenCopy, start: int, stop: int) -> None:
        options, block = self.options, self.reader.arrays(self.needed, start, stop)
        last_values = block.get("last_values", np.zeros(stop - start, np.float32))
        r, d, count = _block_inputs(self.reader, out, self.rewards, block, options, slice(start, stop))
        self.bootstrapped += count
        advantages, returns = gae_arrays(r, block["values"], d, last_values, options.gamma, options.lam)
        if self.rewards.bootstrap:
            out.write("rewards", start, stop, r)
        out.write("returns", start, stop, returns)
        self.returns = self.returns.merge(ExactMoments.of(returns))
        self.raw = self.raw.merge(ExactMoments.of(advantages))
        if options.normalize and start == 0 and stop == self.reader.N:
            self.kept = advantages
        else:
            out.write("advantages", start, stop, advantages)

    def finish(self, out: OpenCopy, blocks: list[tuple[int, int]]) -> dict[str, Any]:
        options, moments = self.options, self.raw
        if options.normalize:
            if self.kept is None:
                self.progress.start("normalize", len(blocks))
            moments = _normalize(out, blocks, self.kept, self.raw, self.progress)
        _set_attributes(out, self.rewards, options, self.raw)
        if self.source == "default" and "time_outs" in self.reader.schema.fields:  # the rule acted: say which
            self.progress.warn(DEFAULT_NOTE.format(path=self.reader.path))  # once written: a failure says only it
        return {
            "gamma": options.gamma,
            "lambda": options.lam,
            "normalized": options.normalize,
            "timeouts_bootstrapped": self.rewards.bootstrap or self.rewards.already,
            "bootstrapped_by_this_run": self.rewards.bootstrap,
            "last_values": options.last_values,
            "bootstrapped_rewards": self.bootstrapped,
            "timeouts": options.rule,
            "timeouts_from": self.source,
            "advantages": moments.as_dict(),
            "returns": self.returns.as_dict(),
            "advantages_raw_mean": _number(self.raw.mean) if options.normalize else None,
            "advantages_raw_std": _number(self.raw.std) if options.normalize else None,
        }


def _normalize(
    out: OpenCopy, blocks: list[tuple[int, int]], kept: np.ndarray | None, raw: ExactMoments, progress: Progress
) -> ExactMoments:
    """Rewrite the advantages normalised with the exact statistics; return the moments of the result.

    One value has no spread: its std is NaN and so is its normalised advantage, as in RSL-RL.
    """
    moments = ExactMoments()
    for start, stop in blocks:
        advantages = kept if kept is not None else out.read_written("advantages", start, stop)
        normalized = normalize_array(advantages, raw.mean, raw.std)
        out.write("advantages", start, stop, normalized)
        moments = moments.merge(ExactMoments.of(normalized))
        if kept is None:
            progress.advance()
    return moments


def _set_attributes(out: OpenCopy, rewards: _Rewards, options: GaeOptions, raw: ExactMoments) -> None:
    normalized = options.normalize  # an earlier run's statistics are removed when this one does not normalise
    out.set_attrs(
        {
            "gae_gamma": options.gamma,
            "gae_lambda": options.lam,
            "advantages_normalized": normalized,
            "timeouts_bootstrapped": rewards.bootstrap or rewards.already,
            "last_values_mode": options.last_values,
            "gae_timeouts": options.rule,
            "advantages_normalization": "exact" if normalized else None,
            "advantages_raw_mean": raw.mean if normalized else None,
            "advantages_raw_std": raw.std if normalized else None,
        }
    )


def _number(value: float) -> float | None:
    """A statistic for the JSON summary: None where it is not a number."""
    return None if value != value else value
