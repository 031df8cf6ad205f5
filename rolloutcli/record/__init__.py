"""Recording rollouts from training loops: :class:`RolloutWriter` (any loop) and adapters for RSL-RL
(:mod:`rolloutcli.record.rsl_rl`), gymnasium, SB3 and TorchRL."""

from __future__ import annotations

from rolloutcli.record.writer import RolloutWriter

__all__ = ["RolloutWriter"]
