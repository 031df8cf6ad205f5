"""Export whole episodes as a robomimic dataset (one HDF5 file, ``robomimic.utils.dataset.SequenceDataset``
reads it; Isaac Lab's imitation workflows read the same layout).

Layout: ``data/demo_<k>`` (k = 0, 1, ... in episode order) holds ``obs/<key>`` and ``next_obs/<key>`` (every
observation group of the rollout, dtype and shape kept), ``actions``, ``rewards``, ``dones`` (uint8: 1 at the
last step of an episode that terminated; 0 at a time-out or where the recording cut it, so that robomimic and
rolloutcli's ``import`` read it as truncated) and ``source_file`` (int32 per step: the index into
``data.attrs["source_files"]`` of the file the step was read from). Attributes: ``num_samples`` on each demo,
with ``recording``, ``env_lane`` and ``start_step`` (where the episode came from) and ``partial_start`` /
``partial_end`` on partial episodes; ``data.attrs["total"]`` and ``data.attrs["env_args"]``, a minimal JSON
robomimic accepts (no environment is known: ``env_name`` ``"unknown"``, ``type`` 2 = gym, no kwargs; edit it
before robomimic creates the environment). With a split, ``mask/train`` and ``mask/valid`` list the demos
(names as bytes, robomimic's convention).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rolloutcli.hdf5.export_steps import (
    StepCount,
    check_plan,
    file_names,
    kept_steps,
    new_file,
    split_side,
    warnings,
    write_rows,
    write_steps,
)
from rolloutcli.hdf5.writer import RolloutOutput
from rolloutcli.pipeline.episode_plan import Chunk, Episode, EpisodePlan

TARGET = "robomimic"
# robomimic's EnvType.GYM_TYPE: the closest of its environment kinds to a recorded rollout.
ENV_ARGS = {"env_name": "unknown", "type": 2, "env_kwargs": {}}


@dataclass(frozen=True)
class _Demo:
    name: str  # data/demo_<k>
    steps: int


def output_kind(split: bool) -> str:
    """What ``export_robomimic`` writes at ``out``: one file (a split is its ``mask/train`` and ``mask/valid``)."""
    return "file"


def export_robomimic(
    out: Path,
    plan: EpisodePlan,
    chunks: Iterable[Chunk],
    valid: Callable[[Episode], bool] | None,
    *,
    label: Path | None = None,
) -> list[str]:
    """Write ``plan``'s episodes, read from ``chunks``, as the robomimic file ``out``; the warning lines.
    Messages name ``label`` (the destination the user gave; ``out`` may be its temporary), or ``out``."""
    shown = Path(label or out)
    check_plan(shown, plan, TARGET)
    demos = _demos(plan)
    count = StepCount(plan)
    with new_file(out, shown, TARGET) as h5:
        for episode in plan.episodes:
            if episode.number in demos:
                _create(h5, plan, episode, demos[episode.number])
        for chunk in chunks:
            demo = demos.get(chunk.episode.number)
            if demo is not None:
                count.add(chunk, _write_chunk(shown, h5, chunk, demo, list(plan.observations)))
        count.check(shown)
        total = sum(d.steps for d in demos.values())
        h5.set_attrs({"total": total, "env_args": json.dumps(ENV_ARGS), "source_files": file_names(plan)}, "data")
        if valid is not None:
            for side in ("train", "valid"):
                names = [
                    demos[e.number].name.split("/")[1]
                    for e in plan.episodes
                    if e.number in demos and split_side(valid, e) == side
                ]
                h5.put(f"mask/{side}", np.array([n.encode() for n in names], dtype="S" if names else "S1"))
    return warnings(plan, TARGET)


def _demos(plan: EpisodePlan) -> dict[int, _Demo]:
    """Episode number -> its demo; an episode with no step left (one step, not followed by an observation) has
    none (robomimic and ``import`` refuse empty demos); the warning counts it with the others."""
    kept = [e for e in sorted(plan.episodes, key=lambda e: e.number) if kept_steps(e) > 0]
    return {e.number: _Demo(f"data/demo_{k}", kept_steps(e)) for k, e in enumerate(kept)}


def _create(h5: RolloutOutput, plan: EpisodePlan, episode: Episode, demo: _Demo) -> None:
    """The demo's datasets, preallocated for its kept steps, and its attributes."""
    n = demo.steps
    for key, (dtype, shape) in plan.observations.items():
        h5.create(f"{demo.name}/obs/{key}", (n, *shape), dtype)
        h5.create(f"{demo.name}/next_obs/{key}", (n, *shape), dtype)
    for name in ("actions", "rewards"):
        dtype, shape = plan.fields[name]
        h5.create(f"{demo.name}/{name}", (n, *shape), dtype)
    h5.create(f"{demo.name}/dones", (n,), np.uint8)
    h5.create(f"{demo.name}/source_file", (n,), np.int32)
    attrs = {"num_samples": n, "recording": episode.recording, "env_lane": episode.lane, "start_step": episode.start}
    attrs.update({k: True for k in ("partial_start", "partial_end") if getattr(episode, k)})
    h5.set_attrs(attrs, demo.name)


def _write_chunk(out: Path, h5: RolloutOutput, chunk: Chunk, demo: _Demo, keys: list[str]) -> int:
    """Write the chunk's kept steps at their place in its demo; how many steps it added."""
    episode, n = chunk.episode, demo.steps

    def place(role: str, key: str | None = None) -> str:
        return f"{demo.name}/{role}" if key is None else f"{demo.name}/{role}/{key}"

    src = write_steps(out, h5, chunk, n, 0, keys, place)
    dones = np.zeros(src.stop, np.uint8)
    if src.stop and chunk.last and episode.has_next and episode.terminated:
        dones[-1] = 1  # robomimic's done: the task ended here (not a time-out, not a cut)
    write_rows(h5, f"{demo.name}/dones", chunk.offset, dones)
    if chunk.last:  # an episode's chunks come in order: its demo is complete
        names = [f"{demo.name}/{p}/{key}" for p in ("obs", "next_obs") for key in keys]
        h5.release([*names, *(f"{demo.name}/{n}" for n in ("actions", "rewards", "dones", "source_file"))])
    return src.stop
