"""Record a small, real CartPole rollout in the rolloutcli HDF5 format (format_version 1).

Dev-only helper: it needs ``gymnasium`` (the ``dev`` extra), which rolloutcli itself never imports.

What it does
------------
* Runs ``gymnasium.vector.SyncVectorEnv`` of ``CartPole-v1`` with a short ``max_episode_steps`` so that
  time-outs (truncations) really happen, in ``AutoresetMode.SAME_STEP``: every recorded step is a real
  transition, ``dones[t] = 1`` when the episode ended after step t's action, and the observation fed in at
  t+1 is already the reset one (RSL-RL's convention).
* Acts with a small recurrent actor-critic (separate actor and critic RNNs, GRU or LSTM, 1 layer), sampling
  actions from a categorical policy over the 2 actions.
* Before recording, the actor is given a few cheap DAgger-style distillation updates towards a hand-coded
  teacher (push towards ``theta + theta_dot``) and the critic a few regressions onto GAE returns, so the
  rollout contains both terminations and time-outs. The recording then continues the same envs and the
  same hidden states (like any RSL-RL rollout after the first), so step 0 is mid-episode.
* Hidden states are recorded as the state fed INTO the network at step t; they are zeroed for envs whose
  episode ended at t-1 (``actor.reset(dones)`` after each step in RSL-RL).

Regenerate the committed files::

    python sample_data/record_cartpole.py --rnn gru --overwrite
    python sample_data/record_cartpole.py --rnn lstm --steps 128 --overwrite
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout: the rolloutcli next to this folder
GAMMA = 0.99
LAM = 0.95


# --------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------
class RecurrentNet(nn.Module):
    """One RNN layer (GRU or LSTM) followed by a small MLP head. The state is always a tuple: (h,) or (h, c)."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int, rnn: str) -> None:
        super().__init__()
        self.rnn_type = rnn
        self.hidden = hidden
        self.num_layers = 1
        self.rnn = (nn.GRU if rnn == "gru" else nn.LSTM)(in_dim, hidden, num_layers=self.num_layers)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ELU(), nn.Linear(hidden, out_dim))

    def initial_state(self, n: int) -> tuple[torch.Tensor, ...]:
        count = 1 if self.rnn_type == "gru" else 2
        return tuple(torch.zeros(self.num_layers, n, self.hidden) for _ in range(count))

    def step(self, x: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One time step: x [N, in] -> out [N, out], new state."""
        if self.rnn_type == "gru":
            y, h = self.rnn(x.unsqueeze(0), state[0])
            new_state: tuple[torch.Tensor, ...] = (h,)
        else:
            y, (h, c) = self.rnn(x.unsqueeze(0), (state[0], state[1]))
            new_state = (h, c)
        return self.head(y.squeeze(0)), new_state

    def unroll(self, xs: torch.Tensor, dones: torch.Tensor, state0: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Re-run a recorded sequence xs [T, N, in] from state0, resetting after dones (for the updates)."""
        state, outs = state0, []
        for t in range(xs.shape[0]):
            out, state = self.step(xs[t], state)
            outs.append(out)
            state = reset_state(state, dones[t])
        return torch.stack(outs)


def reset_state(state: tuple[torch.Tensor, ...], dones: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero the state of envs that are done (RSL-RL's ``reset(dones)``)."""
    keep = (1.0 - dones.float()).view(1, -1, 1)
    return tuple(s * keep for s in state)


def teacher_action(obs: np.ndarray) -> np.ndarray:
    """Hand-coded privileged teacher: push the cart towards where the pole is falling (1 = right)."""
    return (obs[:, 2] + obs[:, 3] > 0.0).astype(np.int64)


# --------------------------------------------------------------------------------------------------------------
# Rollout collection
# --------------------------------------------------------------------------------------------------------------
class Collector:
    """Holds the vector env and everything carried from one rollout to the next (obs, episode steps, states)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.max_steps = args.max_episode_steps
        self.envs = SyncVectorEnv(
            [lambda: gym.make("CartPole-v1", max_episode_steps=args.max_episode_steps) for _ in range(args.num_envs)],
            autoreset_mode=AutoresetMode.SAME_STEP,
        )
        self.envs.action_space.seed(args.seed)
        obs, _ = self.envs.reset(seed=args.seed)
        self.obs = obs.astype(np.float32)
        self.episode_step = np.zeros(args.num_envs, dtype=np.int64)
        self.gen = torch.Generator().manual_seed(args.seed + 12345)
        self.actor = RecurrentNet(4, 2, args.hidden, args.rnn)
        self.critic = RecurrentNet(5, 1, args.hidden, args.rnn)
        self.actor_state = self.actor.initial_state(args.num_envs)
        self.critic_state = self.critic.initial_state(args.num_envs)
        self.completed_lengths: list[int] = []

    def critic_obs(self) -> np.ndarray:
        """Privileged critic observation: policy observation + normalised step within the episode."""
        frac = (self.episode_step / self.max_steps).astype(np.float32)[:, None]
        return np.concatenate([self.obs, frac], axis=1)

    @torch.no_grad()
    def rollout(self, steps: int) -> dict[str, np.ndarray]:
        n = self.obs.shape[0]
        rec: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "cobs", "act", "rew", "done", "tout", "val")}
        rec.update({k: [] for k in ("logp", "logits", "probs", "teacher", "ep_step")})
        h_actor: list[list[np.ndarray]] = [[] for _ in self.actor_state]
        h_critic: list[list[np.ndarray]] = [[] for _ in self.critic_state]
        for _ in range(steps):
            cobs = self.critic_obs()
            for i, s in enumerate(self.actor_state):
                h_actor[i].append(s.numpy().copy())
            for i, s in enumerate(self.critic_state):
                h_critic[i].append(s.numpy().copy())
            logits, self.actor_state = self.actor.step(torch.from_numpy(self.obs), self.actor_state)
            value, self.critic_state = self.critic.step(torch.from_numpy(cobs), self.critic_state)
            dist = torch.distributions.Categorical(logits=logits)
            action = torch.multinomial(dist.probs, 1, generator=self.gen).squeeze(1)
            rec["obs"].append(self.obs)
            rec["cobs"].append(cobs)
            rec["teacher"].append(teacher_action(self.obs))
            rec["ep_step"].append(self.episode_step.copy())
            rec["act"].append(action.numpy())
            rec["logp"].append(dist.log_prob(action).numpy())
            rec["logits"].append(dist.logits.numpy())  # normalised logits (log-probabilities)
            rec["probs"].append(dist.probs.numpy())
            rec["val"].append(value.squeeze(1).numpy())

            obs, reward, terminated, truncated, _ = self.envs.step(action.numpy())
            done = terminated | truncated
            rec["rew"].append(reward.astype(np.float32))
            rec["done"].append(done)
            rec["tout"].append(truncated & ~terminated)
            self.episode_step += 1
            self.completed_lengths.extend(self.episode_step[done].tolist())
            self.episode_step[done] = 0
            self.obs = obs.astype(np.float32)  # SAME_STEP: already the reset observation where done
            done_t = torch.from_numpy(done)
            self.actor_state = reset_state(self.actor_state, done_t)
            self.critic_state = reset_state(self.critic_state, done_t)

        # V(s_T) with the critic's carried hidden state; the state itself is not advanced (as in RSL-RL).
        last_value, _ = self.critic.step(torch.from_numpy(self.critic_obs()), self.critic_state)
        out = {k: np.stack(v) for k, v in rec.items()}
        out["last_values"] = last_value.squeeze(1).numpy()
        out["hidden_actor"] = [np.stack(h) for h in h_actor]  # each [T, L, N, H]
        out["hidden_critic"] = [np.stack(h) for h in h_critic]
        assert out["obs"].shape[:2] == (steps, n)
        return out


def gae_returns(data: dict[str, np.ndarray]) -> np.ndarray:
    """RSL-RL's GAE (with time-out bootstrap), used only for the critic's warm-up targets."""
    rewards = data["rew"] + GAMMA * data["val"] * data["tout"]
    values, dones = data["val"], data["done"].astype(np.float32)
    adv = np.zeros_like(values)
    last = np.zeros_like(values[0])
    for t in reversed(range(values.shape[0])):
        next_value = data["last_values"] if t == values.shape[0] - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        delta = rewards[t] + not_done * GAMMA * next_value - values[t]
        last = delta + not_done * GAMMA * LAM * last
        adv[t] = last
    return adv + values


def warm_up(col: Collector, iterations: int, steps: int, epochs: int) -> None:
    """A few cheap updates: DAgger-style distillation of the actor, value regression for the critic."""
    opt_a = torch.optim.Adam(col.actor.parameters(), lr=3e-3)
    opt_c = torch.optim.Adam(col.critic.parameters(), lr=2e-2)
    for it in range(iterations):
        data = col.rollout(steps)
        dones = torch.from_numpy(data["done"])
        obs, cobs = torch.from_numpy(data["obs"]), torch.from_numpy(data["cobs"])
        teacher = torch.from_numpy(data["teacher"])
        returns = torch.from_numpy(gae_returns(data))
        a0 = tuple(torch.from_numpy(h[0]) for h in data["hidden_actor"])
        c0 = tuple(torch.from_numpy(h[0]) for h in data["hidden_critic"])
        for _ in range(epochs):
            logits = col.actor.unroll(obs, dones, a0)
            loss_a = nn.functional.cross_entropy(logits.reshape(-1, 2), teacher.reshape(-1))
            opt_a.zero_grad()
            loss_a.backward()
            opt_a.step()
            values = col.critic.unroll(cobs, dones, c0).squeeze(-1)
            loss_c = nn.functional.mse_loss(values, returns)
            opt_c.zero_grad()
            loss_c.backward()
            opt_c.step()
        n_done = int(data["done"].sum())
        n_tout = int(data["tout"].sum())
        print(
            f"warm-up {it + 1}/{iterations}: actor CE {loss_a.item():.3f}, critic MSE {loss_c.item():.2f}, "
            f"episodes ended {n_done} (time-outs {n_tout})"
        )


# --------------------------------------------------------------------------------------------------------------
# Writing and checking
# --------------------------------------------------------------------------------------------------------------
def write_file(path: Path, data: dict[str, np.ndarray], attrs: dict[str, object]) -> None:
    """Write the rollout with ``rolloutcli.record.RolloutWriter``, one step at a time as a training loop would
    (validated as it goes, published atomically at ``close``)."""
    from rolloutcli.record import RolloutWriter

    steps, n = data["obs"].shape[:2]
    with RolloutWriter(path, num_envs=n, num_steps=steps, compression="gzip", overwrite=True, attrs=attrs) as writer:
        for t in range(steps):
            writer.add(
                {
                    "observations": {"policy": data["obs"][t], "critic": data["cobs"][t]},
                    "actions": data["act"][t].astype(np.float32)[:, None],
                    "rewards": data["rew"][t],
                    "dones": data["done"][t],
                    "time_outs": data["tout"][t],
                    "values": data["val"][t],
                    "actions_log_prob": data["logp"][t],
                    "distribution": {"logits": data["logits"][t], "probs": data["probs"][t]},
                    "hidden_states": {
                        "actor": tuple(h[t] for h in data["hidden_actor"]),
                        "critic": tuple(h[t] for h in data["hidden_critic"]),
                    },
                    "extras": {"privileged_actions": data["teacher"][t].astype(np.float32)[:, None]},
                }
            )
        writer.close(last_values=data["last_values"])


def verify(path: Path, rnn: str, hidden: int) -> None:
    """Read the file back and check the contract (shapes, dtypes, dones ⊇ time_outs, resets, finiteness)."""
    with h5py.File(path, "r") as f:
        assert f.attrs["rolloutcli_format"] == "rollout" and int(f.attrs["format_version"]) == 1
        steps, n = f["dones"].shape
        n_states = 1 if rnn == "gru" else 2
        expected = {
            "observations/policy": ((steps, n, 4), np.float32),
            "observations/critic": ((steps, n, 5), np.float32),
            "actions": ((steps, n, 1), np.float32),
            "rewards": ((steps, n), np.float32),
            "dones": ((steps, n), np.uint8),
            "time_outs": ((steps, n), np.uint8),
            "values": ((steps, n), np.float32),
            "last_values": ((n,), np.float32),
            "actions_log_prob": ((steps, n), np.float32),
            "distribution/logits": ((steps, n, 2), np.float32),
            "distribution/probs": ((steps, n, 2), np.float32),
            "privileged_actions": ((steps, n, 1), np.float32),
        }
        for who in ("actor", "critic"):
            for i in range(n_states):
                expected[f"hidden_states/{who}/{i}"] = ((steps, 1, n, hidden), np.float32)
        seen: list[str] = []
        f.visititems(lambda name, obj: seen.append(name) if isinstance(obj, h5py.Dataset) else None)
        assert sorted(seen) == sorted(expected), f"unexpected datasets: {sorted(set(seen) ^ set(expected))}"
        d = {name: f[name][()] for name in expected}
    for name, (shape, dtype) in expected.items():
        assert d[name].shape == shape, (name, d[name].shape, shape)
        assert d[name].dtype == dtype, (name, d[name].dtype, dtype)
        if d[name].dtype.kind == "f":
            assert np.isfinite(d[name]).all(), f"non-finite values in {name}"
    dones, touts = d["dones"].astype(bool), d["time_outs"].astype(bool)
    assert set(np.unique(d["dones"])) <= {0, 1} and set(np.unique(d["time_outs"])) <= {0, 1}
    assert not (touts & ~dones).any(), "time_outs must imply dones"
    for who in ("actor", "critic"):
        for i in range(n_states):
            h = d[f"hidden_states/{who}/{i}"]
            after_done = np.broadcast_to(dones[:-1][:, None, :, None], h[1:].shape)
            assert (h[1:][after_done] == 0).all(), f"{who} state {i} not reset after dones"
            assert np.abs(h[1:][~after_done]).max() > 0, f"{who} state {i} is all zeros"
    probs = d["distribution/probs"]
    assert np.allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert np.allclose(np.exp(d["distribution/logits"]), probs, atol=1e-5)
    act = d["actions"][..., 0].astype(np.int64)
    assert set(np.unique(act)) <= {0, 1}
    logp = np.log(np.take_along_axis(probs, act[..., None], -1)[..., 0])
    assert np.allclose(logp, d["actions_log_prob"], atol=1e-4)
    # Where an episode ended, the next observation is a fresh reset (|x| <= 0.05, episode step back to 0).
    nxt_critic = d["observations/critic"][1:][dones[:-1]]
    assert (np.abs(d["observations/policy"][1:][dones[:-1]]) <= 0.05).all()
    assert (nxt_critic[:, 4] == 0).all()
    # CartPole rewards are +1 on every real transition (SAME_STEP autoreset: no reward-less reset steps).
    assert (d["rewards"] == 1.0).all()


def episode_stats(data: dict[str, np.ndarray]) -> dict[str, int | float]:
    dones, touts = data["done"], data["tout"]
    lengths = data["ep_step"][dones] + 1  # episode length (counting steps from before the recording too)
    return {
        "episodes_completed": int(dones.sum()),
        "terminations": int((dones & ~touts).sum()),
        "time_outs": int(touts.sum()),
        "mean_completed_episode_length": float(lengths.mean()) if lengths.size else float("nan"),
        "envs_without_completed_episode": int((~dones.any(0)).sum()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rnn", choices=["gru", "lstm"], default="gru")
    p.add_argument("--output", type=Path, default=None, help="default: sample_data/cartpole_<rnn>.h5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=256, help="T, recorded steps per env")
    p.add_argument("--num-envs", type=int, default=16, help="N, parallel envs")
    p.add_argument("--max-episode-steps", type=int, default=64, help="time limit -> truncations")
    p.add_argument("--hidden", type=int, default=16, help="RNN hidden size (1 layer)")
    p.add_argument("--warmup-iterations", type=int, default=6, help="0 = random-init networks")
    p.add_argument("--warmup-steps", type=int, default=64)
    p.add_argument("--warmup-epochs", type=int, default=8)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    cli_args = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(cli_args)

    out: Path = args.output or HERE / f"cartpole_{args.rnn}.h5"
    if out.exists() and not args.overwrite:
        p.error(f"{out} exists; pass --overwrite to replace it")

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    col = Collector(args)
    warm_up(col, args.warmup_iterations, args.warmup_steps, args.warmup_epochs)
    data = col.rollout(args.steps)
    stats = episode_stats(data)

    attrs: dict[str, object] = {
        "rolloutcli_format": "rollout",
        "format_version": 1,
        "source": "gymnasium CartPole-v1",
        "recorded_with": "sample_data/record_cartpole.py",
        "command": " ".join(["python", "sample_data/record_cartpole.py", *(a for a in cli_args if a != "--overwrite")]),
        "seed": args.seed,
        "num_envs": args.num_envs,
        "num_steps": args.steps,
        "max_episode_steps": args.max_episode_steps,
        "autoreset_mode": "SAME_STEP",
        "rnn_type": args.rnn,
        "rnn_num_layers": 1,
        "rnn_hidden_size": args.hidden,
        "policy": "categorical over 2 actions (actions stored as float32 0/1), separate actor and critic RNNs",
        "warmup_iterations": args.warmup_iterations,
        "hidden_state_convention": "state fed into the network at step t; zeroed where dones[t-1] == 1",
        "critic_observation": "policy observation (4) + episode step / max_episode_steps (1)",
        "privileged_actions_teacher": "1 if pole_angle + pole_angular_velocity > 0 else 0",
        "rewards": "raw environment rewards, not bootstrapped on time-outs",
        "recorder": "sample_data/record_cartpole.py (rolloutcli.record.RolloutWriter)",
        "gymnasium_version": gym.__version__,
        "torch_version": torch.__version__.split("+")[0],
        **{k: v for k, v in stats.items() if k != "mean_completed_episode_length"},
    }
    write_file(out, data, attrs)
    verify(out, args.rnn, args.hidden)
    size = out.stat().st_size
    print(f"wrote {out} ({size} bytes, {size / 1024:.1f} KiB), T={args.steps}, N={args.num_envs}, rnn={args.rnn}")
    shown = (f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())
    print("episode stats: " + ", ".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
