"""Foreign HDF5 layouts (D4RL, Minari, robomimic / Isaac Lab, ikostrikov) recognised from a file's dataset
listing, and the plan that lays one out in the rollout format. No h5py here: a plan is plain data (which source
rows go to which output rows, and which outputs :mod:`rolloutcli.pipeline.import_flags` computes a block at a
time); the one row per episode read to build it (its last episode-end flag) comes through ``read``.

Episode datasets are laid end to end in one env lane (N = 1, T = all steps), each episode whole: ``dones`` is 1
at the last step of every episode (and nowhere else), ``time_outs`` where that end was a truncation, and the
observation that ended an episode is kept in ``final_observations`` at that step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutcli.errors import RolloutError, problem_line
from rolloutcli.fields import field_of
from rolloutcli.pipeline.import_flags import Computed, EpisodeEnds, FlatFlags, Zeros
from rolloutcli.pipeline.import_source import episode_key

LAYOUTS = ("ikostrikov", "d4rl", "minari", "robomimic")  # recognised in this order
# What each layout is recognised by (the datasets it must have), for the "unrecognised layout" message.
SIGNATURES = {
    "d4rl": "observations (or observations/<key>), actions, rewards, terminals",
    "minari": "episode_<k>/{observations, actions, rewards, terminations, truncations}",
    "robomimic": "data/demo_<k>/{obs/<key>, actions}",
    "ikostrikov": "obs, masks, bad_masks, value_preds, rewards, actions (obs with T+1 rows)",
}
IKOSTRIKOV_PLUS_ONE = ("obs", "masks", "bad_masks", "value_preds", "recurrent_hidden_states")


@dataclass(frozen=True)
class Copy:
    """``out[dst : dst + count] = src[start : start + count]``; ``lane``: into env 0 (``out[rows, 0]``);
    ``single``: one source row written as the whole output (``out[...] = src[start]``)."""

    out: str
    src: str
    start: int
    dst: int
    count: int
    lane: bool = True
    single: bool = False


@dataclass
class Plan:
    """How to write one rollout file from a source: output datasets, row copies, outputs computed by blocks."""

    layout: str
    T: int
    N: int
    datasets: dict[str, tuple[tuple[int, ...], np.dtype]] = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)
    computed: list[Computed] = field(default_factory=list)
    verbatim: dict[str, str] = field(default_factory=dict)  # source -> output: datasets carried along whole
    attrs: dict[str, Any] = field(default_factory=dict)
    episodes: int = 0


Listing = dict[str, Any]  # {path: DatasetInfo-like with .shape and .dtype}
Reader = Callable[[str, slice], np.ndarray]  # rows of a source dataset


def _episode_groups(listing: Listing, pattern: str) -> dict[str, Listing]:
    """Group paths matching ``pattern`` (one group: the integer id) in id order (demo_2 before demo_10), each
    with the part of ``listing`` below it (one pass: a cost per dataset, not per episode and dataset)."""
    regex, found, under = re.compile(pattern), {}, {}
    for name, info in listing.items():
        if m := regex.match(name):
            found.setdefault(m.group(0), episode_key(m.group(1)))
            under.setdefault(m.group(0), {})[name] = info
    return {group: under[group] for group in sorted(found, key=found.get)}


def matches(listing: Listing, layout: str) -> bool:
    """``listing`` (a file's datasets) has what ``layout`` needs."""
    names = set(listing)
    if layout == "ikostrikov":
        return {"obs", "masks", "rewards", "actions"} <= names
    if layout == "d4rl":
        observations = "observations" in names or any(n.startswith("observations/") for n in names)
        return observations and {"actions", "rewards", "terminals"} <= names
    if layout == "minari":
        return bool(_episode_groups(listing, r"^episode_(\d+)(?=/)"))
    return bool(_episode_groups(listing, r"^data/demo_(\d+)(?=/)"))


def recognise(listing: Listing) -> str | None:
    """The layout ``listing`` looks like, or None; a rollout file is not recognised."""
    names = set(listing)
    if {"rewards", "dones"} <= names and any(n.startswith("observations") for n in names):
        return None  # already the rollout format
    return next((layout for layout in LAYOUTS if matches(listing, layout)), None)


def unrecognised(path: object, listing: Listing, wanted: str = "auto") -> RolloutError:
    looked = SIGNATURES if wanted == "auto" else {wanted: SIGNATURES[wanted]}
    tops = sorted({name.split("/")[0] for name in listing})
    shown = ", ".join(tops[:12]) + (f" (+{len(tops) - 12} more)" if len(tops) > 12 else "")
    what = "; ".join(f"{k}: {v}" for k, v in looked.items())
    fix = (
        "Pass --from to name the layout, or convert the file to the rollout format yourself."
        if wanted == "auto"
        else "Leave out --from (or pass --from auto) to recognise the layout."
    )
    return RolloutError(f"{path}: unrecognised layout: looked for {what}; found {shown or 'no datasets'}. {fix}")


def plan_import(path: object, layout: str, listing: Listing, read: Reader) -> Plan:
    """The plan for ``layout`` (checked: every field of every episode agrees in length)."""
    planner = {"d4rl": _d4rl, "minari": _minari, "robomimic": _robomimic, "ikostrikov": _ikostrikov}[layout]
    return planner(path, listing, read)


# ------------------------------------------------------------------------------------------ episode datasets


@dataclass
class Episode:
    """One episode of an episode dataset: its step fields (``out -> src`` of ``length`` rows), the observation
    that ended it (``out -> (src, row)``), one-row fields laid at its first step, and how it ended."""

    name: str
    length: int
    steps: dict[str, tuple[str, int]] = field(default_factory=dict)  # out -> (src, first row)
    ends: dict[str, tuple[str, int]] = field(default_factory=dict)  # out -> (src, row) at the last step
    starts: dict[str, str] = field(default_factory=dict)  # out -> src (its row 0) at the first step
    terminated: bool = False
    truncated: bool = False


def _lay_out(path: object, layout: str, episodes: list[Episode], listing: Listing) -> Plan:
    """Episodes end to end in one lane: the copies, dones/time_outs, shapes checked across episodes."""
    T = sum(e.length for e in episodes)
    plan = Plan(layout, T, 1, episodes=len(episodes))
    t = 0
    for episode in episodes:
        if episode.length == 0:
            raise RolloutError(f"{path}: episode '{episode.name}': expected at least one step, found 0.")
        for out, (src, first) in episode.steps.items():
            _declare(path, plan, out, src, listing, (T, 1), episode)
            plan.copies.append(Copy(out, src, first, t, episode.length))
        for out, (src, row) in episode.ends.items():
            _declare(path, plan, out, src, listing, (T, 1), episode)
            plan.copies.append(Copy(out, src, row, t + episode.length - 1, 1))
        for out, src in episode.starts.items():
            _declare(path, plan, out, src, listing, (T, 1), episode)
            plan.copies.append(Copy(out, src, 0, t, 1))
        t += episode.length
    # Every episode is whole: its last step ends it (one index per episode is all that is held).
    ends = np.cumsum([e.length for e in episodes], dtype=np.int64) - 1
    cut = np.array([e.truncated and not e.terminated for e in episodes], bool)
    plan.computed.append(EpisodeEnds(T, ends, cut))
    plan.attrs["recorded_from_reset"] = True
    return plan


def _declare(path: object, plan: Plan, out: str, src: str, listing: Listing, lead: tuple, ep: Episode) -> None:
    """Declare output ``out`` [T, 1, *row shape of src]; every episode must agree on its row shape and dtype."""
    info = listing[src]
    shape, dtype = (*lead, *info.shape[1:]), info.dtype
    known = plan.datasets.setdefault(out, (shape, dtype))
    if known != (shape, dtype):
        raise RolloutError(
            problem_line(
                path,
                src,
                f"rows of shape {known[0][2:]} and dtype {known[1]} as in earlier episodes",
                f"shape {info.shape[1:]}, dtype {dtype} in episode '{ep.name}'",
                "Every episode must store the same fields with the same shapes.",
            )
        )


def _check_lengths(path: object, episode: Episode, listing: Listing, extra_rows: dict[str, int]) -> None:
    """Every step field has ``length`` rows (``length + extra_rows[src]`` where a field has more)."""
    for src in [*(s for s, _ in episode.steps.values()), *extra_rows]:
        rows = listing[src].shape[0] if listing[src].shape else 0
        want = episode.length + extra_rows.get(src, 0)
        if rows != want:
            raise RolloutError(
                f"{path}: episode '{episode.name}': field '{src}' has {rows} rows, expected {want} "
                f"({episode.length} steps); the episode's fields disagree in length. Re-export the episode."
            )


def _datasets_under(listing: Listing, prefix: str) -> dict[str, str]:
    """``{key: path}`` of the datasets below ``prefix`` (``""`` key: ``prefix`` itself is a dataset)."""
    if prefix in listing:
        return {"": prefix}
    return {name[len(prefix) + 1 :]: name for name in listing if name.startswith(prefix + "/")}


def _obs_name(group: str, key: str) -> str:
    return f"{group}/{key or 'policy'}"


def _minari(path: object, listing: Listing, read: Reader) -> Plan:
    episodes = []
    for group, own in _episode_groups(listing, r"^episode_(\d+)(?=/)").items():
        need = [f"{group}/{n}" for n in ("actions", "rewards", "terminations", "truncations")]
        if any(name.startswith(f"{group}/actions/") for name in own):
            raise RolloutError(
                f"{path}: episode '{group}': expected one actions dataset, found dict actions "
                "(a group); they have no place in the rollout format."
            )
        missing = [n for n in need if n not in listing]
        observations = _datasets_under(own, f"{group}/observations")
        if missing or not observations:
            raise RolloutError(
                f"{path}: episode '{group}': expected {', '.join(need)} and observations, "
                f"found {', '.join(missing) or 'no observations'} missing."
            )
        length = listing[f"{group}/rewards"].shape[0] if listing[f"{group}/rewards"].shape else 0
        if length == 0:
            raise RolloutError(f"{path}: episode '{group}': expected at least one step, found 0.")
        ep = Episode(group, length)
        for n in ("actions", "rewards"):
            ep.steps[n] = (f"{group}/{n}", 0)
        extra = {}
        for key, src in observations.items():
            ep.steps[_obs_name("observations", key)] = (src, 0)
            ep.ends[_obs_name("final_observations", key)] = (src, length)
            extra[src] = 1
        for key, src in _datasets_under(own, f"{group}/infos").items():
            rows = listing[src].shape[0] if listing[src].shape else 0
            if rows == length + 1:  # the reset's info, then one per step
                ep.starts[f"reset_infos/{key}"] = src
                extra[src] = 1
            ep.steps[f"infos/{key}"] = (src, rows - length if rows == length + 1 else 0)
        extra.update({f"{group}/terminations": 0, f"{group}/truncations": 0})
        _check_lengths(path, ep, listing, extra)
        last = {n: read(f"{group}/{n}", slice(length - 1, length)) for n in ("terminations", "truncations")}
        ep.terminated, ep.truncated = bool(last["terminations"].any()), bool(last["truncations"].any())
        ep.truncated = ep.truncated or not ep.terminated  # an episode cut by the recording is a truncation
        episodes.append(ep)
    plan = _lay_out(path, "minari", episodes, listing)
    _last_observation(plan, episodes[-1])
    return plan


def _last_observation(plan: Plan, episode: Episode) -> None:
    """The observation after the last step (``last_observations``): the last episode's final observation."""
    for out, (src, row) in episode.ends.items():
        name = "last_observations/" + out.split("/", 1)[1]
        plan.datasets[name] = ((1, *plan.datasets[out][0][2:]), plan.datasets[out][1])
        plan.copies.append(Copy(name, src, row, 0, 1, lane=False))


def _robomimic(path: object, listing: Listing, read: Reader) -> Plan:
    episodes, recorded = [], []
    for group, own in _episode_groups(listing, r"^data/demo_(\d+)(?=/)").items():
        if f"{group}/actions" not in listing or not _datasets_under(own, f"{group}/obs"):
            raise RolloutError(
                f"{path}: episode '{group}': expected {group}/actions and {group}/obs/<key>, found one of them missing."
            )
        length = listing[f"{group}/actions"].shape[0]
        ep = Episode(group, length, {"actions": (f"{group}/actions", 0)})
        extra = {}
        for name, src in _datasets_under(own, group).items():
            top, _, key = name.partition("/")
            rows = listing[src].shape[0] if listing[src].shape else 0
            if top == "obs":
                ep.steps[_obs_name("observations", key)] = (src, 0)
            elif top == "next_obs":
                ep.ends[_obs_name("final_observations", key)] = (src, length - 1)
                extra[src] = 0
            elif name in ("rewards", "dones"):
                ep.steps[name if name == "rewards" else "recorded_dones"] = (src, 0)
            elif rows == 1 and length != 1:
                ep.starts[name] = src  # one row per demo (initial_state/...): at its first step
            elif name != "actions":
                ep.steps[name] = (src, 0)
        _check_lengths(path, ep, listing, extra)
        done = read(f"{group}/dones", slice(length - 1, length)) if f"{group}/dones" in listing else None
        ep.terminated = bool(done is not None and length and done.any())
        ep.truncated = not ep.terminated  # a demo that stops without its done flag was cut short
        recorded.append(done is not None)
        episodes.append(ep)
    plan = _lay_out(path, "robomimic", episodes, listing)
    demos = re.compile(r"^data/demo_\d+/")
    plan.verbatim.update({n: _carried(n) for n in listing if not demos.match(n)})  # mask/<filter key>, ...
    if "rewards" not in plan.datasets:
        plan.computed.append(Zeros("rewards", (plan.T, 1), np.dtype(np.float32)))
        plan.attrs["rewards_recorded"] = False  # Isaac Lab demos store no rewards: zeros stand in
    if episodes[-1].ends:
        _last_observation(plan, episodes[-1])
    return plan


# -------------------------------------------------------------------------------------------------- flat files


def _carried(name: str) -> str:
    """Where a source dataset with no place in the format is carried: its own path, unless a field owns it."""
    return name if field_of(name) is None and name.split("/")[0] not in ("dones", "time_outs") else f"source/{name}"


def _rows_check(path: object, listing: Listing, names: list[str], rows: int, expected: str) -> None:
    for name in names:
        found = listing[name].shape[0] if listing[name].shape else 0
        if found != rows:
            raise RolloutError(
                problem_line(
                    path, name, expected, f"{found} rows", "Every per-step dataset must have one row per step."
                )
            )


def _d4rl_name(name: str) -> str:
    """Where a D4RL dataset goes (observations may be one dataset or a group of keys)."""
    top, _, key = name.partition("/")
    if top in ("observations", "next_observations"):
        return _obs_name("observations" if top == "observations" else "final_observations", key)
    return name if name in ("actions", "rewards") else _carried(name)


def _d4rl(path: object, listing: Listing, read: Reader) -> Plan:
    T = listing["rewards"].shape[0] if listing["rewards"].shape else 0
    if T == 0:
        raise RolloutError(problem_line(path, "rewards", "at least one step", "0 rows"))
    tops = ("observations", "actions", "terminals", "timeouts", "next_observations")
    _rows_check(path, listing, [n for n in listing if n.split("/")[0] in tops], T, f"{T} rows (as 'rewards')")
    plan = Plan("d4rl", T, 1)  # its episodes are counted from the flags once the disk is known to hold it
    for name, info in listing.items():
        if name in ("terminals", "timeouts"):
            continue
        out = _d4rl_name(name)
        if info.shape and info.shape[0] == T:
            plan.datasets[out] = ((T, 1, *info.shape[1:]), info.dtype)
            plan.copies.append(Copy(out, name, 0, 0, T))
        else:
            plan.verbatim[name] = out
        if out.startswith("final_observations/"):  # the observation after the last step
            last = "last_observations/" + out.split("/", 1)[1]
            plan.datasets[last] = ((1, *info.shape[1:]), info.dtype)
            plan.copies.append(Copy(last, name, T - 1, 0, 1, lane=False))
    plan.computed.append(FlatFlags(T, 1, "terminals", "timeouts" if "timeouts" in listing else None))
    plan.attrs["recorded_from_reset"] = True
    return plan


def _ikostrikov(path: object, listing: Listing, read: Reader) -> Plan:
    """ikostrikov's RolloutStorage: obs, masks, bad_masks, value_preds, hidden states with T+1 rows."""
    reward = listing["rewards"].shape
    if len(reward) < 2:
        raise RolloutError(problem_line(path, "rewards", "shape [T, N, 1]", f"shape {reward}"))
    T, N = reward[:2]
    present = [n for n in IKOSTRIKOV_PLUS_ONE if n in listing]
    _rows_check(path, listing, present, T + 1, f"T+1 = {T + 1} rows ('rewards' has T = {T})")
    steps = [n for n in ("actions", "action_log_probs") if n in listing]
    _rows_check(path, listing, steps, T, f"T = {T} rows (as 'rewards')")
    for name in [*present, *steps]:
        if listing[name].shape[1:2] != (N,):
            raise RolloutError(problem_line(path, name, f"N = {N} processes on axis 1", f"shape {listing[name].shape}"))
    plan = Plan("ikostrikov", T, N)
    renames = {
        "obs": "observations/policy",
        "actions": "actions",
        "rewards": "rewards",
        "action_log_probs": "actions_log_prob",
        "value_preds": "values",
    }
    for src, out in renames.items():
        if src in listing:
            info = listing[src]
            plan.datasets[out] = ((T, *info.shape[1:]), info.dtype)
            plan.copies.append(Copy(out, src, 0, 0, T, lane=False))
    obs = listing["obs"]
    plan.datasets["last_observations/policy"] = (tuple(obs.shape[1:]), obs.dtype)
    plan.copies.append(Copy("last_observations/policy", "obs", T, 0, 1, lane=False, single=True))
    if "value_preds" in listing:
        info = listing["value_preds"]
        plan.datasets["last_values"] = (tuple(info.shape[1:]), info.dtype)
        plan.copies.append(Copy("last_values", "value_preds", T, 0, 1, lane=False, single=True))
    if "recurrent_hidden_states" in listing:  # [T+1, N, H] -> [T, layers = 1, N, H]; the one after T kept
        info = listing["recurrent_hidden_states"]
        plan.datasets["hidden_states/actor/0"] = ((T, 1, *info.shape[1:]), info.dtype)
        plan.copies.append(Copy("hidden_states/actor/0", "recurrent_hidden_states", 0, 0, T))
        plan.datasets["last_hidden_states"] = (tuple(info.shape[1:]), info.dtype)
        plan.copies.append(Copy("last_hidden_states", "recurrent_hidden_states", T, 0, 1, lane=False, single=True))
    bad = "bad_masks" if "bad_masks" in listing else None
    plan.computed.append(FlatFlags(T, N, "masks", bad, offset=1, ended_when_set=False))
    plan.verbatim.update({n: _carried(n) for n in listing if n not in (*renames, *IKOSTRIKOV_PLUS_ONE)})
    return plan
