"""Record RSL-RL's rollouts: ``attach(runner, out_dir)`` hooks an ``OnPolicyRunner`` (or Isaac Lab's) so that
every ``every``-th iteration is written as ``out_dir/rollout_<iteration>.h5``, with nothing else changed. With
``every == 1`` the files are one consecutive recording (format 1.2): ``recording_id`` new per attach (a resumed run
is a new recording: its envs were reset), ``recording_index`` counting the files handed over (not the iteration);
with ``every > 1`` steps are skipped and neither is written.

The hook wraps the algorithm's ``process_env_step`` and ``compute_returns`` (and the runner's ``learn``) on the
instance (no user monkeypatching) and only reads what RSL-RL computed. Per step it copies the env's raw rewards
(RSL-RL's storage holds them bootstrapped) and ``extras["time_outs"]`` verbatim; at ``compute_returns`` it copies
the rollout RSL-RL's storage holds (observations, actions, values, log-probs, distribution parameters in RSL-RL's
order, hidden states: zeros where RSL-RL's state was still None) and the critic's output of RSL-RL's own
``last_values`` forward (the critic is run no extra time, so training is bit-identical with and without the
hook), and hands the copy to :mod:`rolloutcli.record.worker`, which writes the file off the training process.
A failed write is raised at the next iteration; ``learn`` returns once its files are published.
"""

from __future__ import annotations

import functools
import json
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rolloutcli.errors import EXIT_IO, RolloutError
from rolloutcli.record.folder import recording_folder
from rolloutcli.record.waiting import listing, wait_settled
from rolloutcli.record.worker import publish

RECORDER = "rolloutcli.record.rsl_rl"
_NEXT = "_rolloutcli_next_iteration"  # kept on the runner by detach()


def _names(actor: Any, count: int) -> list[str]:
    """Names of the distribution parameters in RSL-RL's order: Gaussian (mean, std), Beta (alpha, beta)."""
    distribution = getattr(actor, "distribution", None)
    kind = type(distribution).__name__.lower()
    if "beta" in kind and count == 2:
        return ["alpha", "beta"]
    if "gaussian" in kind and count == 2:
        return ["mean", "std"]
    return [f"param{i}" for i in range(count)]


@functools.cache
def _rsl_rl_version() -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version("rsl-rl-lib")
    except metadata.PackageNotFoundError:
        return "unknown"


class RslRlRecorder:
    """The hook :func:`attach` installs; ``files`` lists the files written so far."""

    def __init__(self, runner: Any, out_dir: str | Path, every: int = 1, compression: str | None = None) -> None:
        if every < 1:
            raise ValueError(f"every: expected a positive number of iterations, found {every}")
        self.runner, self.alg, self.out_dir, self.every = runner, runner.alg, Path(out_dir), every
        self.compression, self._files = compression, []
        # one recording of every step: one id (this attach's, not the global RNG's), files counted from 0
        self.recording_id, self._handed = (uuid.uuid4().hex if every == 1 else None), 0
        self._pending: list[Future[Path]] = []  # handed to the writing process, in order
        self._raw: dict[str, Any] | None = None  # this iteration's step count, whether time_outs were seen
        self._kept: dict[str, Any] = {}  # [T, ...] raw rewards and time_outs, reused every iteration
        self._rows: dict[str, tuple[Any, ...]] = {}  # their rows, as views
        self._names: list[str] = []
        self._config = json.dumps(getattr(runner, "cfg", {}), default=repr, sort_keys=True)  # as attached
        # RSL-RL's next learn() starts at its last iteration again: a recorder attached after another on this
        # runner goes on from that one's next file, not over its last
        self.iteration = max(int(getattr(runner, "current_learning_iteration", 0)), getattr(runner, _NEXT, 0))
        recording_folder(self.out_dir, self.iteration, "attach")
        self._process, self._returns, self._learn = self.alg.process_env_step, self.alg.compute_returns, runner.learn
        self.alg.process_env_step, self.alg.compute_returns = self.process_env_step, self.compute_returns
        runner.learn = self.learn

    @property
    def files(self) -> list[Path]:
        """The files written so far (waits for those being published; raises the first failure)."""
        error = self._settle()
        if error is not None:
            raise error
        return list(self._files)

    def _settle(self, wait: bool = True) -> BaseException | None:
        """Move the published files (all of them: ``wait``, each within ``PUBLISH_WAIT_S``) to ``files``; a
        failure comes back as one ``RolloutError`` naming exactly the files published and those not, forgotten once
        returned (a recording not settled in time stays pending and is raised at once)."""
        failed: list[tuple[Path, BaseException]] = []
        try:
            while self._pending and (wait or self._pending[0].done()):
                error = wait_settled(self._pending[0])
                future = self._pending.pop(0)
                if error is None:
                    self._files.append(future.result())
                else:
                    failed.append((getattr(future, "path", "?"), error))
        except RolloutError as late:
            raise self._report(late, [getattr(f, "path", "?") for f in self._pending]) from None
        if not failed:
            return None
        return self._report(failed[0][1], [path for path, _ in failed])

    def _report(self, error: BaseException, lost: list[Any]) -> RolloutError:
        """``error`` (the first failure) with the files published so far and those not, named exactly."""
        in_flight = [getattr(f, "path", "?") for f in self._pending if getattr(f, "path", "?") not in lost]
        more = f"; still being written: {listing(in_flight)}" if in_flight else ""
        return RolloutError(
            f"{error} Published: {listing(self._files)}; not published: {listing(lost)}{more}.",
            exit_code=getattr(error, "exit_code", EXIT_IO),
        )

    def learn(self, *args: Any, **kwargs: Any) -> Any:
        """The runner's ``learn``; returns once this run's files are published (or raises what failed)."""
        try:
            result = self._learn(*args, **kwargs)
        except BaseException:
            self._settle()  # what was handed over is finished; the exception on its way says what went wrong
            raise
        self.files  # noqa: B018 - waits, and raises a failed publish
        return result

    def detach(self) -> None:
        """Remove the hook (an unfinished recording is discarded; published ones are waited for)."""
        self.alg.process_env_step, self.alg.compute_returns = self._process, self._returns
        self.runner.learn = self._learn
        setattr(self.runner, _NEXT, self.iteration)
        self._raw = None
        self.files  # noqa: B018 - surfaces a failed background publish

    def _attrs(self) -> dict[str, Any]:
        return {"rsl_rl_version": _rsl_rl_version(), "runner_config": self._config, "iteration": self.iteration}

    def process_env_step(self, obs: Any, rewards: Any, dones: Any, extras: dict[str, Any]) -> Any:
        if self.iteration % self.every == 0:
            self._keep(rewards, extras)
        return self._process(obs, rewards, dones, extras)

    def _keep(self, rewards: Any, extras: dict[str, Any]) -> None:
        """Copy what RSL-RL's storage will not hold as given: the raw rewards and ``extras["time_outs"]``
        (verbatim: RSL-RL bootstraps wherever it is set; the env may reuse both buffers), into ``[T, ...]`` rows
        kept from iteration to iteration (zeros at steps whose extras had no time-outs). Each step is one
        ``copy_`` into a row view made once (indexing the buffer every step cost as much as the copy)."""
        time_outs = extras.get("time_outs")
        if self._raw is None:
            self._start_rows(rewards)
        raw, rows = self._raw, self._rows
        assert raw is not None
        step = raw["step"]
        rows["rewards"][step].copy_(rewards)
        if time_outs is not None:
            like = rows.get("time_outs")
            if like is None or like[0].shape != time_outs.shape or like[0].dtype != time_outs.dtype:
                self._new_time_outs(time_outs)
            rows["time_outs"][step].copy_(time_outs)
            raw["time_outs"] = True
        raw["step"] = step + 1

    def _start_rows(self, rewards: Any) -> None:
        """A new iteration's recording: the raw-reward rows (reused while the env's rewards keep their shape and
        device) and zeroed time-out rows."""
        T, kept = self.alg.storage.num_transitions_per_env, self._kept
        if not kept or kept["rewards"].shape[1:] != rewards.shape or kept["rewards"].device != rewards.device:
            kept.clear()
            kept["rewards"] = rewards.new_empty((T, *rewards.shape))
            self._rows = {"rewards": kept["rewards"].unbind(0)}
        if "time_outs" in kept:
            kept["time_outs"].zero_()
        self._raw = {"step": 0, "time_outs": False}

    def _new_time_outs(self, time_outs: Any) -> None:
        import torch

        T = len(self._kept["rewards"])
        self._kept["time_outs"] = torch.zeros((T, *time_outs.shape), dtype=time_outs.dtype, device=time_outs.device)
        self._rows["time_outs"] = self._kept["time_outs"].unbind(0)

    def _steps(self) -> dict[str, Any]:
        """The rollout RSL-RL's storage holds (``[T, ...]``), with the env's raw rewards and time-outs: the tensors
        themselves (views), which :func:`publish` copies before it returns (the loop overwrites them next
        iteration)."""
        st, alg, raw = self.alg.storage, self.alg, self._raw
        assert raw is not None
        steps: dict[str, Any] = {
            "observations": dict(st.observations.items()),
            "actions": st.actions,
            "rewards": self._kept["rewards"],
            "dones": st.dones[..., 0],
            "values": st.values[..., 0],
            "actions_log_prob": st.actions_log_prob[..., 0],
        }
        params = st.distribution_params or ()
        if params:
            names = self._names or _names(alg.actor, len(params))
            self._names = names  # the actor's distribution does not change
            steps["distribution"] = dict(zip(names, params, strict=True))
        if raw["time_outs"]:
            steps["time_outs"] = self._kept["time_outs"]
        hidden = {}  # the storage's rows are zeros where RSL-RL's state was still None
        for net, saved in (("actor", st.saved_hidden_state_a), ("critic", st.saved_hidden_state_c)):
            if saved is not None and getattr(getattr(alg, net), "is_recurrent", False):
                hidden[net] = tuple(saved)
        if hidden:
            steps["hidden_states"] = hidden
        return steps

    def compute_returns(self, obs: Any) -> Any:
        if self._raw is None:
            self.iteration += 1
            return self._returns(obs)
        error = self._settle(wait=False)  # a failure is raised at the next iteration, not later
        if error is not None:
            raise error
        critic, captured = self.alg.critic, []
        forward = critic.forward

        def spy(*args: Any, **kwargs: Any) -> Any:  # RSL-RL's own last-values forward, seen once
            out = forward(*args, **kwargs)
            captured.append(out)
            return out

        critic.forward = spy
        try:
            result = self._returns(obs)
        finally:
            del critic.forward
        job = {
            "writer": {
                "path": self.out_dir / f"rollout_{self.iteration:06d}.h5",
                "num_envs": self.alg.storage.num_envs,
                "num_steps": self.alg.storage.num_transitions_per_env,
                "compression": self.compression,
                "gamma": float(self.alg.gamma),
                "lam": float(self.alg.lam),
                "recorder": RECORDER,
                "timeouts_rule": "rsl",  # RSL-RL: r += gamma * V(s_t) where extras["time_outs"]
                "recording_id": self.recording_id,
                "recording_index": None if self.recording_id is None else self._handed,
                "attrs": self._attrs(),
                "overwrite": True,
            },
            "steps": self._steps(),
            "close": {
                "last_values": captured[0] if captured else None,
                "last_observations": dict(obs.items()),
            },
        }
        self._raw = None
        self._pending.append(publish(job))
        self.iteration, self._handed = self.iteration + 1, self._handed + 1
        return result


def attach(runner: Any, out_dir: str | Path, every: int = 1, compression: str | None = None) -> RslRlRecorder:
    """Record every ``every``-th iteration of ``runner`` (an RSL-RL ``OnPolicyRunner``) into ``out_dir``."""
    return RslRlRecorder(runner, out_dir, every, compression)
