"""Generalised advantage estimation (GAE) exactly as RSL-RL computes it: pure functions on ``[T, N]`` tensors.

The recurrence is RSL-RL's ``PPO.compute_returns`` (written out in :mod:`rolloutcli.core.gae_numpy`).

* CPU tensors (``backend="cpu"``, the default there): the kernel of :mod:`rolloutcli.core.gae_numpy` on numpy
  views: the same bits as RSL-RL's loop at every shape and thread count, and as ``rolloutcli gae``.
* Other devices (``backend="torch"``): a log-depth associative scan, ``ceil(log2 T)`` rounds of whole-tensor ops
  and no host-device sync. It reorders the float32 sums, so it agrees with RSL-RL to float32 rounding at the
  scale of the largest terms (``|error| <= 1e-5 * max_t sum_u |c_t..c_{u-1}| |terms_u|``, tested), not bit for bit.

Values, last values and (after the time-out bootstrap, in the rewards' own precision) rewards are rounded to
float32, the dtype of RSL-RL's storage; outputs are float32 ``[T, N]`` on the inputs' device.
"""

from __future__ import annotations

from typing import Literal

import torch

from rolloutcli.core.gae_numpy import bootstrap_rewards, gae_arrays
from rolloutcli.core.timeouts import RULES

__all__ = ["bootstrap_time_outs", "compute_gae", "normalize_advantages"]

Backend = Literal["auto", "cpu", "torch"]


def _as_tn(x: torch.Tensor, name: str) -> torch.Tensor:
    """View ``[T, N]`` or ``[T, N, 1]`` as ``[T, N]`` (no copy)."""
    if x.dim() == 3 and x.shape[2] == 1:
        return x[:, :, 0]
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape [T, N] or [T, N, 1], found {list(x.shape)}")
    return x


def _as_float(x: torch.Tensor, name: str, keep_float64: bool = False) -> torch.Tensor:
    """Contiguous float32 (float64 kept where asked); integers are accepted as numbers."""
    if x.dtype == torch.bool or x.is_complex():
        raise ValueError(f"{name}: expected a float (or integer) tensor, found dtype {x.dtype}")
    dtype = torch.float64 if keep_float64 and x.dtype == torch.float64 else torch.float32
    return x.to(dtype).contiguous()


def _as_flag(x: torch.Tensor) -> torch.Tensor:
    """Contiguous one-byte flags, nonzero = set. bool and (u)int8 are reinterpreted without a copy."""
    if x.dtype in (torch.bool, torch.int8, torch.uint8):
        return x.contiguous().view(torch.uint8)
    return (x != 0).view(torch.uint8).contiguous()


def _apply_rule(
    rule: str,
    r: torch.Tensor,
    v32: torch.Tensor,
    d: torch.Tensor,
    to: torch.Tensor,
    fv: torch.Tensor | None,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards, dones)`` under a time-out rule: :func:`rolloutcli.core.timeouts.apply_timeouts` (the commands'
    rules, whose docstring says what each does) on tensors, operation for operation, so both give the same bits."""
    hit = to != 0
    if rule == "rsl":
        return bootstrap_rewards(r, v32, to, gamma), d
    if rule == "final-value":
        assert fv is not None
        final = torch.where(hit, fv, torch.zeros((), dtype=fv.dtype, device=fv.device))  # NaN elsewhere stays out
        return bootstrap_rewards(r, final, to, gamma), d
    ended = ((d != 0) | hit).to(torch.uint8)
    if rule == "proper":
        return torch.where(hit, v32.to(r.dtype), r), ended
    return r, ended


def _prepare(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    time_outs: torch.Tensor | None,
    gamma: float,
    rule: str = "rsl",
    final_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked contiguous float32 ``r`` (under the time-out rule), ``v``, uint8 ``d`` ``[T, N]`` and float32 ``lv``
    ``[N]``."""
    r = _as_tn(rewards.detach(), "rewards")
    v = _as_tn(values.detach(), "values")
    d = _as_tn(dones.detach(), "dones")
    to = None if time_outs is None else _as_tn(time_outs.detach(), "time_outs")
    fv = None if final_values is None or to is None else _as_tn(final_values.detach(), "final_values")
    lv = last_values.detach()
    if lv.dim() == 2 and lv.shape[1] == 1:
        lv = lv[:, 0]
    if tuple(lv.shape) != (r.shape[1],):
        raise ValueError(f"last_values: expected shape [{r.shape[1]}] or [{r.shape[1]}, 1], found {list(lv.shape)}")
    for name, x in (("values", v), ("dones", d), ("time_outs", to), ("final_values", fv), ("last_values", lv)):
        if x is not None and x.device != r.device:
            raise ValueError(f"all inputs must be on one device, found {r.device} and {x.device}")
        if x is not None and name != "last_values" and x.shape != r.shape:
            raise ValueError(f"{name}: expected shape {list(r.shape)} like rewards, found {list(x.shape)}")
    v32 = _as_float(v, "values")
    r = _as_float(r, "rewards", keep_float64=to is not None)
    d = _as_flag(d)
    if to is not None:
        fv32 = None if fv is None else _as_float(fv, "final_values")
        r, d = _apply_rule(rule, r, v32, d, to, fv32, gamma)
    return r.to(torch.float32).contiguous(), v32, d.contiguous(), _as_float(lv, "last_values")


def _outputs(r: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return torch.empty_like(r), torch.empty_like(r)
    for name, x in (("out[0]", out[0]), ("out[1]", out[1])):
        if x.shape != r.shape or x.dtype != torch.float32 or x.device != r.device or not x.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous float32 tensor of shape {list(r.shape)} on {r.device}, found "
                f"{x.dtype} {list(x.shape)} on {x.device}"
            )
    return out


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    time_outs: torch.Tensor | None = None,
    timeouts_rule: str = "rsl",
    final_values: torch.Tensor | None = None,
    backend: Backend = "auto",
    num_threads: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by RSL-RL's GAE; inputs are never modified.

    ``rewards``, ``values``, ``dones`` (nonzero = the episode ended after step ``t``) and ``time_outs`` (nonzero =
    the trainer bootstrapped there) are ``[T, N]`` or ``[T, N, 1]``; ``last_values`` ``V(s_T)`` is ``[N]`` or
    ``[N, 1]``. ``timeouts_rule`` says what a time-out does, as ``rolloutcli gae --timeouts`` (same bits):
    ``"rsl"`` (RSL-RL: ``r += gamma * V(s_t)`` on a copy of the rewards), ``"final-value"`` (SB3, TorchRL:
    ``r += gamma * final_values``, V of the observation that ended the episode, ``[T, N]``, read only at time-outs),
    ``"proper"`` (ikostrikov's ``use_proper_time_limits``: advantage 0, return ``V(s_t)`` there), ``"ignore"`` (a
    time-out ends the episode like a termination). Without ``time_outs`` every rule gives the same result.
    ``backend``: ``"cpu"`` (the exact kernel), ``"torch"`` (the scan, any device) or ``"auto"``. ``num_threads``
    never changes a bit. ``out``: optional contiguous float32 ``(advantages, returns)`` buffers on the inputs'
    device, not overlapping them.

    Returns ``(advantages, returns)``, float32 ``[T, N]``, not normalised; ``advantages = returns - values``.
    """
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name}: expected a number in [0, 1], found {value}")
    if backend not in ("auto", "cpu", "torch"):
        raise ValueError(f"backend: expected 'auto', 'cpu' or 'torch', found {backend!r}")
    if timeouts_rule not in RULES:
        raise ValueError(f"timeouts_rule: expected one of {', '.join(map(repr, RULES))}, found {timeouts_rule!r}")
    if timeouts_rule == "final-value" and time_outs is not None and final_values is None:
        raise ValueError("final_values: expected a [T, N] tensor for timeouts_rule='final-value', found None")
    r, v, d, lv = _prepare(rewards, values, dones, last_values, time_outs, gamma, timeouts_rule, final_values)
    adv, ret = _outputs(r, out)
    if backend == "auto":
        backend = "cpu" if r.device.type == "cpu" else "torch"
    if backend == "torch":  # the scan: A_t = delta_t + c_t * A_{t+1}, c_t = not_done_t * gamma * lam
        nd_gamma = (d == 0).to(torch.float32) * gamma  # RSL-RL's operation order
        delta = r + nd_gamma * torch.cat([v[1:], lv.unsqueeze(0)], dim=0) - v
        torch.add(_reverse_linear_scan(nd_gamma * lam, delta), v, out=ret)
        torch.sub(ret, v, out=adv)
    elif r.device.type != "cpu":
        raise ValueError(f"backend 'cpu' needs CPU tensors, found {r.device}; use backend='torch' or 'auto'")
    else:
        arrays = (r.numpy(), v.numpy(), d.numpy(), lv.numpy())
        gae_arrays(*arrays, gamma, lam, threads=num_threads, out=(adv.numpy(), ret.numpy()))
    return adv, ret


def bootstrap_time_outs(
    rewards: torch.Tensor, values: torch.Tensor, time_outs: torch.Tensor, gamma: float
) -> torch.Tensor:
    """RSL-RL's time-out bootstrap ``rewards + gamma * (values * time_outs)`` as a new float32 ``[T, N]`` tensor
    (float64 rewards are bootstrapped in float64, then rounded)."""
    r, v, to = _as_tn(rewards, "rewards"), _as_tn(values, "values"), _as_tn(time_outs, "time_outs")
    if tuple(v.shape) != tuple(r.shape) or tuple(to.shape) != tuple(r.shape):
        raise ValueError(
            f"rewards, values and time_outs must have one shape, found {list(r.shape)}, {list(v.shape)}, "
            f"{list(to.shape)}"
        )
    bootstrapped = bootstrap_rewards(_as_float(r, "rewards", True), _as_float(v, "values"), to, gamma)
    return bootstrapped.to(torch.float32)


def normalize_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """RSL-RL's whole-rollout normalisation ``(A - A.mean()) / (A.std() + 1e-8)`` with torch's float32 mean and
    unbiased std: RSL-RL's own expression, so the bits are RSL-RL's in the same process (the rounding of torch's
    reduction depends on the thread count and the device). One element gives NaN, as in RSL-RL."""
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def _reverse_linear_scan(c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve ``A_t = b_t + c_t * A_{t+1}`` (``A_T = 0``) along dim 0 by Hillis-Steele doubling.

    Invariant after the round with offset ``s``: ``A_t = sum_{u=t}^{t+2s-1} (c_t...c_{u-1}) b_u`` and ``C_t`` is the
    product of ``c`` over the same window, so ``A_t + C_t * A_{t+2s}`` doubles the window. Buffers ping-pong
    because torch may not read and write overlapping slices in one op; ``b`` and ``c`` are used as scratch.
    """
    steps = b.shape[0]
    a_cur, a_nxt = b, torch.empty_like(b)
    c_cur, c_nxt = c, torch.empty_like(c)
    s = 1
    while s < steps:
        head = steps - s
        torch.addcmul(a_cur[:head], c_cur[:head], a_cur[s:], out=a_nxt[:head])
        a_nxt[head:].copy_(a_cur[head:])
        if 2 * s < steps:  # the products are needed only by a further round
            torch.mul(c_cur[:head], c_cur[s:], out=c_nxt[:head])
            c_nxt[head:].copy_(c_cur[head:])
            c_cur, c_nxt = c_nxt, c_cur
        a_cur, a_nxt = a_nxt, a_cur
        s *= 2
    return a_cur
