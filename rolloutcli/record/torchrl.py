"""``write_tensordict``: a TorchRL collector's batch (``[N, T]`` TensorDict, ``("next", ...)`` keys) as a rollout
file ``[T, N, ...]``.

``rewards``, ``dones``, ``terminated``, ``truncated`` come from ``("next", ...)``; ``time_outs = truncated &
~terminated``; ``values`` from ``value_key``; TorchRL's ``("next", value_key)`` is V of the observation after
the step, before any reset, so at done steps it becomes ``final_values`` (and ``("next", obs)`` the
``final_observations``), and at the last step ``last_values`` / ``last_observations``. ``rolloutcli gae
--timeouts final-value`` then gives TorchRL's ``generalized_advantage_estimate``.

A collector's batches follow each other (each starts where the last stopped, its envs not reset): write them with
one ``recording_id`` and ``recording_index`` 0, 1, ... (format 1.2's consecutive recording; new id when the
envs are reset). ``last_observations`` are ``("next", obs)`` of the last step: the observations the next batch
starts from, except at an env done at the last step, where they are the observation that ended its episode (the
collector resets it after the batch; the batch does not hold the reset observation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolloutcli.record.writer import RolloutWriter


def _get(td: Any, key: Any) -> Any:
    return td.get(key) if key in td.keys(include_nested=True) else None


def _env_first(x: Any) -> Any:
    """``[N, T, 1]`` -> ``[N, T]`` (TorchRL's trailing singleton of rewards, flags and values)."""
    return x.squeeze(-1) if x.dim() == 3 and x.shape[-1] == 1 else x


def write_tensordict(
    td: Any,
    path: str | Path,
    *,
    observation_keys: tuple[str, ...] = ("observation",),
    value_key: str = "state_value",
    log_prob_key: str = "sample_log_prob",
    distribution_keys: tuple[str, ...] = ("loc", "scale"),
    gamma: float | None = None,
    lam: float | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    recording_id: str | None = None,
    recording_index: int | None = None,
) -> Path:
    """Write ``td`` (batch ``[N, T]``, time last, as a TorchRL collector returns
    it; a ``[T]`` batch is one env) to ``path``; returns the path. ``recording_id``/``recording_index``: see the
    module docstring."""
    if td.batch_dims == 1:
        td = td.unsqueeze(0)
    N, T = td.batch_size
    nxt = td.get("next")
    done = _env_first(nxt.get("done")).bool()
    terminated = _env_first(_get(nxt, "terminated") if _get(nxt, "terminated") is not None else nxt.get("done"))
    truncated = _get(nxt, "truncated")
    truncated = done & ~terminated.bool() if truncated is None else _env_first(truncated).bool()
    time_outs = truncated & ~terminated.bool()
    values, next_values = _get(td, value_key), _get(nxt, value_key)
    groups = {"policy" if k == "observation" else k: k for k in observation_keys}
    writer = RolloutWriter(
        path,
        num_envs=N,
        num_steps=T,
        compression=compression,
        gamma=gamma,
        lam=lam,
        recorder="rolloutcli.record.torchrl.write_tensordict",
        timeouts_rule="final-value",  # the value estimators bootstrap a truncation from ("next", value)
        recording_id=recording_id,
        recording_index=recording_index,
        overwrite=overwrite,
    )
    with writer:
        for t in range(T):
            step = {
                "observations": {g: td.get(k)[:, t] for g, k in groups.items()},
                "actions": td.get("action")[:, t],
                "rewards": _env_first(nxt.get("reward"))[:, t],
                "dones": done[:, t],
                "time_outs": time_outs[:, t],
                "final_observations": {g: nxt.get(k)[:, t] for g, k in groups.items()},
            }
            if values is not None:
                step["values"] = _env_first(values)[:, t]
            if next_values is not None:
                step["final_values"] = _env_first(next_values)[:, t] * done[:, t]
            log_prob = _get(td, log_prob_key)
            if log_prob is not None:
                step["actions_log_prob"] = _env_first(log_prob)[:, t]
            params = {k: td.get(k)[:, t] for k in distribution_keys if _get(td, k) is not None}
            if params:
                step["distribution"] = params
            writer.add(step)
        last = None if next_values is None else _env_first(next_values)[:, -1]
        writer.close(last_values=last, last_observations={g: nxt.get(k)[:, -1] for g, k in groups.items()})
    return Path(path)
