"""``rolloutcli.record.rsl_rl.attach`` on rsl-rl-lib's real ``OnPolicyRunner`` with a tiny fake VecEnv."""

from __future__ import annotations

import copy
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from rsl_rl.env import VecEnv
from rsl_rl.runners import OnPolicyRunner
from tensordict import TensorDict

from rolloutcli import RolloutStorage
from rolloutcli.record.rsl_rl import attach

N, T, OBS, ACT = 8, 6, 3, 2


class FakeEnv(VecEnv):
    """Deterministic dynamics; episodes end by termination (|x| large) or time limit (time_outs)."""

    def __init__(self, seed: int = 0) -> None:
        self.num_envs, self.num_actions, self.max_episode_length = N, ACT, 5
        self.device, self.cfg = "cpu", {}
        self.generator = torch.Generator().manual_seed(seed)
        self.state = torch.randn(N, OBS, generator=self.generator)
        self.episode_length_buf = torch.zeros(N, dtype=torch.long)

    def get_observations(self) -> TensorDict:
        return TensorDict({"policy": self.state.clone(), "critic": self.state * 2}, batch_size=[N])

    def step(self, actions: torch.Tensor):
        self.state = (
            self.state * 0.9
            + 0.1 * actions.sum(-1, keepdim=True)
            + 0.05 * torch.randn(N, OBS, generator=self.generator)
        )
        rewards = -self.state.pow(2).sum(-1)
        self.episode_length_buf += 1
        terminated = self.state.abs().max(-1).values > 1.2
        time_outs = self.episode_length_buf >= self.max_episode_length
        dones = terminated | time_outs
        self.state[dones] = torch.randn(int(dones.sum()), OBS, generator=self.generator)
        self.episode_length_buf[dones] = 0
        return self.get_observations(), rewards, dones.long(), {"time_outs": time_outs}


def _config(rnn: bool | str) -> dict:
    """``rnn``: False (MLP), "gru" or "lstm" (True: "gru")."""
    kind = "gru" if rnn is True else rnn
    model = {"class_name": "RNNModel", "rnn_type": kind, "rnn_hidden_dim": 8} if kind else {"class_name": "MLPModel"}
    actor = {**model, "hidden_dims": [16], "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": 1.0}}
    return {
        "num_steps_per_env": T,
        "save_interval": 1000,
        "obs_groups": {"actor": ["policy"], "critic": ["critic"]},
        "algorithm": {"class_name": "PPO", "num_learning_epochs": 2, "num_mini_batches": 2, "gamma": 0.98, "lam": 0.9},
        "actor": actor,
        "critic": {**model, "hidden_dims": [16]},
        "logger": "tensorboard",
        "multi_gpu": None,
    }


def _run(tmp_path: Path, rnn: bool | str, record: bool, iterations: int = 3):
    torch.manual_seed(0)
    runner = OnPolicyRunner(FakeEnv(), copy.deepcopy(_config(rnn)), log_dir=None, device="cpu")
    captured = []
    original = runner.alg.update

    def update():  # RSL-RL's storage right before the update, for comparison
        st = runner.alg.storage
        captured.append(
            {"returns": st.returns.clone(), "advantages": st.advantages.clone(), "rewards": st.rewards.clone()}
        )
        for net, saved in (("actor", st.saved_hidden_state_a), ("critic", st.saved_hidden_state_c)):
            captured[-1][net] = [part.clone() for part in saved or ()]
        return original()

    runner.alg.update = update
    recorder = attach(runner, tmp_path / "rec") if record else None
    runner.learn(iterations)
    params = [p.detach().clone() for p in [*runner.alg.actor.parameters(), *runner.alg.critic.parameters()]]
    return params, captured, recorder


@pytest.mark.parametrize("rnn", [False, "gru", "lstm"])
def test_hook_is_invisible_and_files_reproduce_rsl_rl(tmp_path: Path, cli, rnn: bool | str) -> None:
    plain, storage_plain, _ = _run(tmp_path, rnn, record=False)
    hooked, storage, recorder = _run(tmp_path, rnn, record=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True))
    assert len(recorder.files) == 3
    for it, path in enumerate(recorder.files):
        assert path.name == f"rollout_{it:06d}.h5"
        expected = storage[it]
        assert torch.equal(expected["returns"], storage_plain[it]["returns"])
        with h5py.File(path, "r") as handle:
            attrs = dict(handle.attrs)
            assert attrs["recorder"] == "rolloutcli.record.rsl_rl" and attrs["rsl_rl_version"] == "5.5.1"
            assert attrs["gamma"] == 0.98 and attrs["lam"] == 0.9 and not attrs["timeouts_bootstrapped"]
            assert attrs["timeouts_rule"] == "rsl" and attrs["format_version"] == 1.2
            assert list(handle["distribution"].attrs["order"]) == ["mean", "std"]
            assert ("hidden_states" in handle) is bool(rnn)
            if rnn:  # LSTM: (h, c) as parts 0 and 1, like RSL-RL's storage
                parts = sorted(handle["hidden_states/actor"])
                assert parts == (["0", "1"] if rnn == "lstm" else ["0"])
                assert parts == sorted(handle["hidden_states/critic"])
                for part in parts:
                    assert handle[f"hidden_states/actor/{part}"].shape == (T, 1, N, 8)
                    if it == 0:  # RSL-RL's state was None at the first step: zeros
                        assert not handle[f"hidden_states/actor/{part}"][0].any()
                    assert handle[f"hidden_states/critic/{part}"][1:].any()
                    for net in ("actor", "critic"):  # what RSL-RL's storage held, bit for bit
                        stored = expected[net][int(part)].numpy()
                        assert handle[f"hidden_states/{net}/{part}"][()].tobytes() == stored.tobytes()
            raw = handle["rewards"][()]
        assert not np.array_equal(raw, expected["rewards"].squeeze(-1).numpy())  # raw, not bootstrapped
        out = tmp_path / f"gae_{it}.h5"
        code, _, err = cli("gae", path, "-o", out, "--gamma", "0.98", "--lam", "0.9", "-q")
        assert code == 0, err
        with h5py.File(out, "r") as handle:
            assert handle["returns"][()].tobytes() == expected["returns"].squeeze(-1).numpy().tobytes()
            np.testing.assert_allclose(
                handle["advantages"][()], expected["advantages"].squeeze(-1).numpy(), rtol=0, atol=1e-5
            )
            assert handle["rewards"][()].tobytes() == expected["rewards"].squeeze(-1).numpy().tobytes()
        loaded = RolloutStorage.from_hdf5(path)
        loaded.compute_returns(gamma=0.98, lam=0.9)
        assert torch.equal(loaded.returns, expected["returns"])
        assert torch.equal(loaded.advantages, expected["advantages"])


def test_every_other_iteration_and_detach(tmp_path: Path) -> None:
    torch.manual_seed(0)
    runner = OnPolicyRunner(FakeEnv(), copy.deepcopy(_config(False)), log_dir=None, device="cpu")
    recorder = attach(runner, tmp_path / "rec", every=2, compression="lzf")  # as docs/recording.md says
    runner.learn(3)
    assert [p.name for p in recorder.files] == ["rollout_000000.h5", "rollout_000002.h5"]
    with h5py.File(recorder.files[0], "r") as handle:
        assert handle["rewards"].compression == "lzf" and handle["observations/policy"].compression == "lzf"
    recorder.detach()
    runner.learn(1)
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == ["rollout_000000.h5", "rollout_000002.h5"]


def test_failed_publish_is_raised_and_leaves_no_half_file(tmp_path: Path) -> None:
    from rolloutcli.errors import RolloutError

    torch.manual_seed(0)
    runner = OnPolicyRunner(FakeEnv(), copy.deepcopy(_config(False)), log_dir=None, device="cpu")
    (tmp_path / "rec" / "rollout_000001.h5").mkdir(parents=True)  # a folder where iteration 1's file goes
    recorder = attach(runner, tmp_path / "rec")
    with pytest.raises(RolloutError, match=r"rollout_000001\.h5") as caught:  # next iteration or learn end
        runner.learn(3)
    folder = tmp_path / "rec" / "rollout_000001.h5"
    assert str(caught.value).startswith(f"{folder}: output is a folder, expected a file path.")
    assert caught.value.exit_code == 2  # the child's RolloutError, as it was
    names = sorted(p.name for p in (tmp_path / "rec").iterdir())
    assert names[:2] == ["rollout_000000.h5", "rollout_000001.h5"] and (tmp_path / "rec" / names[1]).is_dir()
    assert all(name.startswith("rollout_") and name.endswith(".h5") for name in names)  # no temporaries
    recorder.detach()


def test_writing_process_restarts_after_it_died(tmp_path: Path) -> None:
    import time

    from rolloutcli.record import worker

    torch.manual_seed(0)
    runner = OnPolicyRunner(FakeEnv(), copy.deepcopy(_config(False)), log_dir=None, device="cpu")
    recorder = attach(runner, tmp_path / "rec")
    runner.learn(1)
    child = worker._publisher().child
    child.process.kill()
    child.process.wait()
    while child.alive:  # its reader notices the closed pipe
        time.sleep(0.01)
    runner.learn(1)
    assert [p.name for p in recorder.files] == ["rollout_000000.h5", "rollout_000001.h5"]
    assert worker._publisher().child is not child


def test_ctrl_c_in_the_loop_keeps_the_finished_files(tmp_path: Path) -> None:
    class Interrupted(FakeEnv):
        calls = 0

        def step(self, actions: torch.Tensor):
            Interrupted.calls += 1
            if Interrupted.calls == 2 * T + 3:  # in the third iteration's rollout
                raise KeyboardInterrupt
            return super().step(actions)

    torch.manual_seed(0)
    runner = OnPolicyRunner(Interrupted(), copy.deepcopy(_config(False)), log_dir=None, device="cpu")
    recorder = attach(runner, tmp_path / "rec")
    with pytest.raises(KeyboardInterrupt):
        runner.learn(5)
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == ["rollout_000000.h5", "rollout_000001.h5"]
    assert [p.name for p in recorder.files] == ["rollout_000000.h5", "rollout_000001.h5"]
    for path in recorder.files:
        assert RolloutStorage.from_hdf5(path).rewards.shape == (T, N, 1)


def test_raw_rewards_and_time_outs_kept_per_step(tmp_path: Path) -> None:
    """The hook's per-step copies: raw rewards every step, time-outs from the first step that has them (zeros
    before), both fresh each iteration, new buffers when the env's shape changes; the env's buffers are reused."""
    from types import SimpleNamespace

    from rolloutcli.record.rsl_rl import RslRlRecorder

    alg = SimpleNamespace(storage=SimpleNamespace(num_transitions_per_env=3))
    alg.process_env_step = lambda *args: None
    alg.compute_returns = lambda obs: None
    runner = SimpleNamespace(alg=alg, learn=lambda *args, **kwargs: None, cfg={}, current_learning_iteration=0)
    recorder = RslRlRecorder(runner, tmp_path)
    rewards, time_outs = torch.zeros(4), torch.zeros(4, dtype=torch.long)  # reused by the env, as Isaac Lab does

    def iteration(values: list[float], outs: list[list[int] | None]) -> None:
        recorder._raw = None  # what compute_returns does once an iteration is handed over
        for value, out in zip(values, outs, strict=True):
            rewards.fill_(value)
            extras = {}
            if out is not None:
                time_outs.copy_(torch.tensor(out))
                extras["time_outs"] = time_outs
            recorder.process_env_step(None, rewards, None, extras)

    iteration([1.0, 2.0, 3.0], [None, [0, 1, 0, 0], [1, 0, 0, 1]])
    assert recorder._kept["rewards"].tolist() == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    assert recorder._kept["time_outs"].tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 1]]
    iteration([4.0, 5.0, 6.0], [None, None, [0, 0, 1, 0]])
    assert recorder._kept["rewards"].tolist() == [[4.0] * 4, [5.0] * 4, [6.0] * 4]
    assert recorder._kept["time_outs"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    rewards, time_outs = torch.zeros(2), torch.zeros(2, dtype=torch.long)  # another number of envs
    iteration([7.0, 8.0, 9.0], [None, None, None])
    assert recorder._kept["rewards"].tolist() == [[7.0] * 2, [8.0] * 2, [9.0] * 2] and "time_outs" not in recorder._kept
    assert recorder._raw == {"step": 3, "time_outs": False}


def test_a_folder_of_an_earlier_run_is_refused_and_a_reattached_hook_goes_on(tmp_path: Path) -> None:
    """A fresh run into an earlier run's folder would replace its files one by one and leave the rest (it did,
    silently); the same runner attached again goes on after its last file (it replaced that one); a resumed run
    whose iterations follow the folder's is welcome."""
    from rolloutcli.errors import RolloutError

    torch.manual_seed(0)
    runner = OnPolicyRunner(FakeEnv(), copy.deepcopy(_config(False)), log_dir=None, device="cpu")
    recorder = attach(runner, tmp_path / "rec")
    runner.learn(2)
    recorder.detach()
    first = (tmp_path / "rec" / "rollout_000001.h5").read_bytes()
    recorder = attach(runner, tmp_path / "rec")
    runner.learn(1)
    recorder.detach()
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == [f"rollout_00000{i}.h5" for i in range(3)]
    assert (tmp_path / "rec" / "rollout_000001.h5").read_bytes() == first
    fresh = OnPolicyRunner(FakeEnv(), copy.deepcopy(_config(False)), log_dir=None, device="cpu")
    with pytest.raises(RolloutError) as caught:
        attach(fresh, tmp_path / "rec")
    assert str(caught.value) == (
        f"{tmp_path / 'rec'}: attach writes rollout_000000.h5 on; expected no such file there, found "
        "rollout_000000.h5 and 2 more of an earlier recording (they would be replaced one by one, the rest left). "
        "Choose a new folder, or move them."
    )
    assert caught.value.exit_code == 2
    fresh.current_learning_iteration = 3  # resumed from a checkpoint at iteration 3
    attach(fresh, tmp_path / "rec").detach()


def test_a_stopped_then_killed_writing_process_is_reported_after_a_bounded_wait(tmp_path: Path, monkeypatch) -> None:
    """Issue 40.12: a SIGSTOPped writing process does not block training forever; when it dies, the files
    published and those not are named exactly."""
    import os
    import signal

    from rolloutcli.errors import RolloutError
    from rolloutcli.record import waiting, worker

    torch.manual_seed(0)
    runner = OnPolicyRunner(FakeEnv(), copy.deepcopy(_config(False)), log_dir=None, device="cpu")
    recorder = attach(runner, tmp_path / "rec")
    runner.learn(1)
    first, second = tmp_path / "rec" / "rollout_000000.h5", tmp_path / "rec" / "rollout_000001.h5"
    child = worker._publisher().child
    pid = child.process.pid
    monkeypatch.setattr(waiting, "PUBLISH_WAIT_S", 1.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(RolloutError) as caught:
            runner.learn(1)
        assert str(caught.value) == (
            f"{second}: not published after 1 s: the recording process (pid {pid}) is stopped (SIGSTOP or a "
            f"debugger): resume it with `kill -CONT {pid}`. Published: {first}; not published: {second}."
        )
        assert caught.value.exit_code == 3 and not second.exists()
        child.process.kill()
        child.process.wait()
    finally:
        os.kill(pid, signal.SIGCONT) if child.process.poll() is None else None
    with pytest.raises(RolloutError) as caught:
        recorder.files  # noqa: B018
    assert str(caught.value) == (
        f"{second}: the recording process ended (exit code -9) before publishing it; nothing was published under "
        f"that name. Published: {first}; not published: {second}."
    )
    assert recorder.files == [first]  # reported once; the next recording goes to a new process
    runner.learn(1)
    assert recorder.files == [first, tmp_path / "rec" / "rollout_000002.h5"]
    recorder.detach()
