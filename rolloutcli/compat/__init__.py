"""Storages with other libraries' APIs over the rollout format (``IkostrikovRolloutStorage``)."""

from rolloutcli.compat.ikostrikov import IkostrikovRolloutStorage

__all__ = ["IkostrikovRolloutStorage"]
