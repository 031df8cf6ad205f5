"""``--engine ray``'s connection: Ray imported (or exit 2 saying how to install it) and connected to
``--address``, ``RAY_ADDRESS`` or a new local cluster; an address nothing answers on is exit 3 with one line.

Ray retries an absent cluster for minutes and writes its own log lines and tracebacks on stderr while it does
(its C++ core writes to the process's stderr itself): the address is probed first, within ``RAY_TIMEOUT_S``,
and whatever Ray writes while it connects goes to a temporary file, dropped, so only our line reaches the user.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from rolloutcli.errors import EXIT_IO, EXIT_USAGE, RolloutError

RAY_INSTALL = 'pip install "rolloutcli[ray]"'
RAY_TIMEOUT_S = 10.0  # an unreachable --address is reported within this
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray connects there instead of --address auto (or a new local cluster)


def import_ray() -> Any:
    """``ray``, or exit 2 saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RolloutError(
            f"--engine ray: expected Ray to be installed, found none. Install it: {RAY_INSTALL}", exit_code=EXIT_USAGE
        ) from exc
    return ray


def _unreachable(address: str, why: object) -> RolloutError:
    return RolloutError(
        f"{address}: cannot reach the Ray cluster ({why}). Check --address (auto, host:6379, ray://host:10001) "
        "and that the cluster runs.",
        exit_code=EXIT_IO,
    )


def _target(address: str | None) -> tuple[str, str] | None:
    """``(address Ray will connect to, how the message names it)``; None where Ray starts a local cluster or
    finds one itself (``auto`` without ``RAY_ADDRESS``: Ray fails at once when it finds none)."""
    env = os.environ.get(RAY_ADDRESS_ENV, "")
    if address in (None, "auto") and env:  # Ray takes RAY_ADDRESS over auto and over a new local cluster
        return env, f"{RAY_ADDRESS_ENV}={env}"
    if address in (None, "auto"):
        return None
    return address, address


def _probe(address: str, named: str) -> None:
    """Connect to ``host:port`` within ``RAY_TIMEOUT_S``: Ray itself retries an absent cluster for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=RAY_TIMEOUT_S):
            pass
    except ValueError:
        raise _unreachable(named, "expected host:port") from None
    except OSError as exc:
        raise _unreachable(named, exc.strerror or exc) from exc


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The process's stderr (file descriptor 2, which Ray's C++ core writes to) into a dropped temporary file."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def connect_ray(options: Any) -> Any:
    """``ray`` connected to ``--address`` (or a new local cluster); unreachable: exit 3 naming the address."""
    ray = import_ray()
    address = options.address
    target = _target(address)
    if target is not None:
        _probe(*target)
    if ray.is_initialized():
        return ray
    env = {"env_vars": options.env()} if options.env() else None
    try:
        with _quiet_stderr():
            if address is None:
                ray.init(include_dashboard=False, runtime_env=env, log_to_driver=False)
            else:
                ray.init(address=address, runtime_env=env, log_to_driver=False)
    except (ConnectionError, TimeoutError) as exc:
        named = target[1] if target is not None else str(address)
        raise _unreachable(named, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    return ray
