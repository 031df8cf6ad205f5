"""Every process a command starts ends when the command does, however it ended (SIGKILL and a crash included).

A command with a local pool starts multiprocessing's resource tracker and process server, the server forks the
workers, and each of them may start a probe helper (``rolloutcli.hdf5.probe_helper``) that forks probers. None
of them noticed a SIGKILLed command: each worker holds both ends of its pool's queues and the server's
"alive" pipe, so it waited for work for ever, the server for its workers and the tracker for them all, each
holding the dead command's stderr open (a pipe reading it never ended). So each process that cannot count on an
end-of-file from its parent asks Linux to kill it when its parent ends (``prctl(PR_SET_PDEATHSIG)``): the server
dies with the command, the workers with the server, the probers with their helper. The helpers end at the
end-of-file of their stdin (their owner's end, which no other process holds), and the tracker at the
end-of-file of its pipe once all of those are gone: nothing is left a moment after the command died.

The kernel sends the signal when the *thread* that started the process ends, so it is asked for only where
that thread lives as long as the process is wanted: the command's main thread (the server), the server's
only thread (the workers), the helper's thread serving the prober's connection (which kills its prober
anyway when it ends). Elsewhere than Linux nothing is asked.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "ROLLOUTCLI_PARENT_PID"  # set while the command starts its pool's server: the pid it dies with


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> bool:
    """Have Linux send ``signum`` to this process when its parent ``parent`` (the pid that started it) ends; if
    ``parent`` has already ended (the request came too late to be honoured), send it now. Whether the kernel
    took the request (False elsewhere than Linux)."""
    prctl = loaded_prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # reparented: the parent ended before the request
        os.kill(os.getpid(), signum)
    return True


_PRCTL: list = []  # libc's prctl, once loaded (None where there is none)


def loaded_prctl() -> Any:
    """libc's ``prctl`` (loaded once: call it before forking from a process with threads, so that a child never
    loads a library while another thread of its parent held the loader's lock at the fork), or None."""
    if not _PRCTL:
        prctl = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                prctl = ctypes.CDLL(None, use_errno=True).prctl
            except (OSError, AttributeError):  # no libc to load (a static interpreter): nothing asked
                prctl = None
        _PRCTL.append(prctl)
    return _PRCTL[0]


def parent_from_env() -> int | None:
    """The pid ``PARENT_ENV`` names (removed, so that this process's own children do not take it for theirs)."""
    value = os.environ.pop(PARENT_ENV, "")
    return int(value) if value.isdigit() else None
