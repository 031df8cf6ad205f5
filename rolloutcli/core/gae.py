"""Generalised advantage estimation (GAE) exactly as RSL-RL computes it, fast on CPU and GPU.

Pure functions on tensors: no file I/O, no printing. Shapes: ``T`` steps (time) by ``N`` envs, time first,
as in RSL-RL's ``RolloutStorage``.

The recurrence (RSL-RL ``PPO.compute_returns``), reversed over ``t``::

    next_value_t = last_values            if t == T - 1 else values[t + 1]
    not_done_t   = 1 - dones_t
    delta_t      = r_t + not_done_t * gamma * next_value_t - values_t
    A_t          = delta_t + not_done_t * gamma * lam * A_{t+1}          (A_T = 0)
    returns_t    = A_t + values_t

With ``time_outs``, RSL-RL's bootstrap ``r_t += gamma * values_t * time_out_t`` is applied first (never to the
caller's tensor). ``A_t = b_t + c_t * A_{t+1}`` with ``b_t = delta_t`` and ``c_t = gamma * lam * not_done_t`` is a
*linear* recurrence, which is what makes both fast paths possible:

* CPU (``backend="numba"``): compiled loops over time, vectorised over contiguous env slices, one env block per
  thread. When there are fewer env blocks than threads (few envs, long rollouts), time is cut into chunks that are
  scanned in parallel assuming a zero carry; the true carries are then propagated backwards across chunks and
  added back, ``A_t += (c_t * ... * c_{chunk end}) * carry``, stopping as soon as that term is exactly 0. A
  single env (N = 1) always uses four chunks per thread, interleaved, to hide the latency of the serial chain.
  The returns are bit-identical to RSL-RL's (same float32 operations in the same order, no fused multiply-add)
  except where chunk carries are added, which changes the rounding only.
* Any device (``backend="torch"``): a log-depth associative scan (Hillis-Steele doubling on the pairs
  ``(c, b)``), ``ceil(log2 T)`` rounds of whole-tensor ops, no Python loop over ``T`` and no host-device sync.
  It reorders the float32 sums, so it agrees with RSL-RL to float32 rounding at the scale of the largest terms.

Everything is computed in float32, the dtype of RSL-RL's storage: float16/bfloat16 inputs are upcast and float64
inputs are rounded to float32 first, so a float64 file gives the same numbers RSL-RL would. Outputs are always
float32 ``[T, N]`` on the inputs' device.

Advantages are returned as ``A`` itself. RSL-RL stores ``returns - values`` as its advantages; that equals ``A``
up to one float32 rounding at the scale of ``|returns|``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rolloutcli.core import gae_kernels

__all__ = [
    "bootstrap_time_outs",
    "compute_gae",
    "normalize_advantages",
    "normalize_with",
]

Backend = Literal["auto", "numba", "torch"]

# ----------------------------------------------------------------------------------------------------------------
# Input checking and conversion
# ----------------------------------------------------------------------------------------------------------------


def _as_tn(x: torch.Tensor, name: str) -> torch.Tensor:
    """View ``[T, N]`` or ``[T, N, 1]`` as ``[T, N]`` (no copy)."""
    if x.dim() == 3 and x.shape[2] == 1:
        return x[:, :, 0]
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape [T, N] or [T, N, 1], found {list(x.shape)}")
    return x


def _as_f32(x: torch.Tensor, name: str) -> torch.Tensor:
    """Contiguous float32 (a no-op for a contiguous float32 tensor)."""
    if not (x.is_floating_point() or x.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)):
        raise ValueError(f"{name}: expected a float (or integer) tensor, found dtype {x.dtype}")
    return x.to(torch.float32).contiguous()


def _as_flag(x: torch.Tensor) -> torch.Tensor:
    """Contiguous one-byte flags, nonzero = set. bool and (u)int8 are reinterpreted without a copy."""
    if x.dtype == torch.bool or x.dtype == torch.int8:
        return x.contiguous().view(torch.uint8)
    if x.dtype == torch.uint8:
        return x.contiguous()
    return (x != 0).view(torch.uint8).contiguous()


def _check_coefficients(gamma: float, lam: float) -> None:
    # The carry fix-up stops once (product of c) * carry underflows to 0, which is final only if |c| <= 1.
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not (0.0 <= float(value) <= 1.0):
            raise ValueError(f"{name}: expected a number in [0, 1], found {value}")


def _prepare(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    time_outs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check shapes and devices; return contiguous ``r, v`` float32 ``[T, N]``, ``d, to`` uint8, ``lv`` ``[N]``."""
    r = _as_tn(rewards.detach(), "rewards")
    v = _as_tn(values.detach(), "values")
    d = _as_tn(dones.detach(), "dones")
    shape = tuple(r.shape)
    for name, x in (("values", v), ("dones", d)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} like rewards, found {list(x.shape)}")
    n = shape[1]
    last_values = last_values.detach()
    if last_values.dim() == 2 and last_values.shape[1] == 1:
        last_values = last_values[:, 0]
    if tuple(last_values.shape) != (n,):
        raise ValueError(f"last_values: expected shape [{n}] or [{n}, 1], found {list(last_values.shape)}")
    tensors = [rewards, values, dones, last_values]
    to = None
    if time_outs is not None:
        to = _as_tn(time_outs.detach(), "time_outs")
        if tuple(to.shape) != shape:
            raise ValueError(f"time_outs: expected shape {list(shape)} like rewards, found {list(to.shape)}")
        tensors.append(time_outs)
    device = rewards.device
    for x in tensors:
        if x.device != device:
            raise ValueError(f"all inputs must be on one device, found {device} and {x.device}")
    return (
        _as_f32(r, "rewards"),
        _as_f32(v, "values"),
        _as_flag(d),
        _as_f32(last_values, "last_values"),
        None if to is None else _as_flag(to),
    )


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    time_outs: torch.Tensor | None = None,
    backend: Backend = "auto",
    num_threads: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by RSL-RL's GAE; inputs are never modified.

    Args:
        rewards: ``[T, N]`` or ``[T, N, 1]``, any float dtype.
        values: ``[T, N]`` or ``[T, N, 1]``, the critic's ``V(s_t)``.
        dones: ``[T, N]`` or ``[T, N, 1]``, bool or numbers; nonzero = the episode ended after step ``t``.
        last_values: ``[N]`` or ``[N, 1]``, ``V(s_T)`` for bootstrapping after the last step.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.
        time_outs: optional ``[T, N]`` / ``[T, N, 1]`` flags (nonzero = truncated); applies RSL-RL's bootstrap
            ``r_t + gamma * (V(s_t) * time_out_t)`` to a copy of the rewards before the recurrence.
        backend: ``"numba"`` (CPU tensors only), ``"torch"`` (any device), or ``"auto"``: numba on CPU, torch
            elsewhere.
        num_threads: CPU threads for the numba backend; default ``torch.get_num_threads()``.
        out: optional ``(advantages, returns)`` buffers to write into and return: contiguous float32 ``[T, N]`` on
            the inputs' device, not overlapping the inputs. Reusing buffers (as RSL-RL's storage does) saves the
            page faults of fresh memory, which can cost more than the computation itself.

    Returns:
        ``(advantages, returns)``, both float32 ``[T, N]`` on the inputs' device, not normalised (see
        :func:`normalize_advantages`). ``returns = advantages + values``.
    """
    _check_coefficients(gamma, lam)
    r, v, d, lv, to = _prepare(rewards, values, dones, last_values, time_outs)
    if out is None:
        adv = torch.empty(r.shape, dtype=torch.float32, device=r.device)
        ret = torch.empty(r.shape, dtype=torch.float32, device=r.device)
    else:
        adv, ret = out
        for name, x in (("out[0]", adv), ("out[1]", ret)):
            if x.shape != r.shape or x.dtype != torch.float32 or x.device != r.device or not x.is_contiguous():
                raise ValueError(
                    f"{name}: expected a contiguous float32 tensor of shape {list(r.shape)} on {r.device}, found "
                    f"{x.dtype} {list(x.shape)} on {x.device}"
                )
    if backend == "auto":
        backend = "numba" if r.device.type == "cpu" else "torch"
    if backend == "torch":
        _gae_torch(r, v, d, lv, to, gamma, lam, adv, ret)
    elif backend != "numba":
        raise ValueError(f"backend: expected 'auto', 'numba' or 'torch', found {backend!r}")
    elif r.device.type != "cpu":
        raise ValueError(f"backend 'numba' needs CPU tensors, found {r.device}; use backend='torch' or 'auto'")
    else:
        _gae_numba(r, v, d, lv, to, gamma, lam, num_threads or torch.get_num_threads(), adv, ret)
    return adv, ret


def bootstrap_time_outs(
    rewards: torch.Tensor, values: torch.Tensor, time_outs: torch.Tensor, gamma: float
) -> torch.Tensor:
    """RSL-RL's time-out bootstrap: ``rewards + gamma * (values * time_outs)``, as a new float32 ``[T, N]`` tensor.

    A truncated episode did not end in a terminal state, so the value of the state at the step stands in for the
    lost next state. Inputs ``[T, N]`` or ``[T, N, 1]``; ``time_outs`` bool or numbers (nonzero = truncated).
    """
    r = _as_f32(_as_tn(rewards, "rewards"), "rewards")
    v = _as_f32(_as_tn(values, "values"), "values")
    to = _as_tn(time_outs, "time_outs")
    if tuple(v.shape) != tuple(r.shape) or tuple(to.shape) != tuple(r.shape):
        raise ValueError(
            f"rewards, values and time_outs must have one shape, found {list(r.shape)}, {list(v.shape)}, "
            f"{list(to.shape)}"
        )
    # Same operation order as RSL-RL (values * time_outs first, then gamma), so results agree bit for bit.
    return r + gamma * (v * (to != 0).to(torch.float32))


def normalize_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """RSL-RL's whole-rollout normalisation: ``(A - A.mean()) / (A.std() + 1e-8)``, unbiased std.

    Same expression and dtype as RSL-RL, so the result agrees bit for bit. Any shape; returns a new tensor.
    """
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def normalize_with(advantages: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """``(A - mean) / (std + 1e-8)`` with global statistics (e.g. from :class:`rolloutcli.core.stats.EnvMoments`).

    ``mean`` and ``std`` are rounded to float32 first and the expression is RSL-RL's, so with float32
    statistics equal to RSL-RL's the result is identical to :func:`normalize_advantages`.
    """
    m = torch.tensor(mean, dtype=torch.float32, device=advantages.device)
    s = torch.tensor(std, dtype=torch.float32, device=advantages.device)
    return (advantages - m) / (s + 1e-8)


# ----------------------------------------------------------------------------------------------------------------
# Torch backend: log-depth scan, device-agnostic
# ----------------------------------------------------------------------------------------------------------------


def _gae_torch(
    r: torch.Tensor,
    v: torch.Tensor,
    d: torch.Tensor,
    lv: torch.Tensor,
    to: torch.Tensor | None,
    gamma: float,
    lam: float,
    adv: torch.Tensor,
    ret: torch.Tensor,
) -> None:
    """GAE on any device with ``ceil(log2 T)`` rounds of whole-tensor ops; writes float32 ``[T, N]`` adv and ret."""
    nd_gamma = (d == 0).to(torch.float32) * gamma  # not_done * gamma, RSL-RL's operation order
    if to is not None:
        r = r + gamma * (v * (to != 0).to(torch.float32))
    next_v = torch.cat([v[1:], lv.unsqueeze(0)], dim=0)
    b = r + nd_gamma * next_v - v  # delta_t
    c = nd_gamma * lam
    adv.copy_(_reverse_linear_scan(c, b))
    torch.add(adv, v, out=ret)


def _reverse_linear_scan(c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve ``A_t = b_t + c_t * A_{t+1}`` (``A_T = 0``) along dim 0 by Hillis-Steele doubling.

    Invariant after the round with offset ``s``: ``A_t = sum_{u=t}^{t+2s-1} (c_t...c_{u-1}) b_u`` and ``C_t`` is the
    product of ``c`` over the same window, so ``A_t + C_t * A_{t+2s}`` doubles the window. Rows ``t >= T - s`` are
    already final and are copied. Buffers ping-pong because torch may not read and write overlapping slices in
    one op. Shapes ``[T, ...]``; ``b`` and ``c`` are used as scratch space (the caller's own temporaries).
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


# ----------------------------------------------------------------------------------------------------------------
# Numba backend: the kernels of rolloutcli.core.gae_kernels on zero-copy numpy views
# ----------------------------------------------------------------------------------------------------------------


def _gae_numba(
    r: torch.Tensor,
    v: torch.Tensor,
    d: torch.Tensor,
    lv: torch.Tensor,
    to: torch.Tensor | None,
    gamma: float,
    lam: float,
    n_threads: int,
    adv: torch.Tensor,
    ret: torch.Tensor,
) -> None:
    """Numba GAE on the contiguous CPU tensors of :func:`_prepare`; writes float32 ``[T, N]`` ``adv`` and ``ret``."""
    gae_kernels.gae_into(
        r.numpy(),
        v.numpy(),
        d.numpy(),
        lv.numpy(),
        None if to is None else to.numpy(),
        gamma,
        lam,
        n_threads,
        adv.numpy(),
        ret.numpy(),
    )
