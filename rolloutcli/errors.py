"""The one user-facing exception of rolloutcli (printed as one line on stderr) and its exit codes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

EXIT_BAD_DATA = 1
EXIT_USAGE = 2
EXIT_IO = 3
EXIT_UNSAFE = 4
EXIT_HANGUP = 129  # SIGHUP: the terminal or ssh session closed (128 + 1)
EXIT_INTERRUPTED = 130  # SIGINT, as shells report it (128 + 2)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15)


class RolloutError(Exception):
    """A problem with the user's data, options or files, with a message that says how to fix it.

    Attributes:
        exit_code: 1 bad data, 2 usage, 3 I/O fault, 4 refused as unsafe.
        problems: the individual problems (one line each) when several were found at once.
    """

    def __init__(self, message: str, *, exit_code: int = EXIT_BAD_DATA, problems: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.problems = list(problems) or [message]

    @classmethod
    def field(
        cls, path: object, field: str, expected: str, found: str, fix: str = "", *, exit_code: int = EXIT_BAD_DATA
    ) -> RolloutError:
        """Build the standard message: ``<file>: field '<f>': expected <x>, found <y>. <fix>``."""
        return cls(problem_line(path, field, expected, found, fix), exit_code=exit_code)

    @classmethod
    def many(cls, path: object, problems: list[str], *, exit_code: int = EXIT_BAD_DATA) -> RolloutError:
        """Report several problems of one file at once, on one line: the file named once, the problems
        joined with ``; `` (each problem's own line stays in ``problems``)."""
        if len(problems) == 1:
            return cls(problems[0], exit_code=exit_code)
        parts = [problem.removeprefix(f"{path}: ") for problem in problems]
        joined = "; ".join([*(part.removesuffix(".") for part in parts[:-1]), parts[-1]])
        return cls(f"{path}: {len(problems)} problems: {joined}", exit_code=exit_code, problems=problems)


def one_line(text: str) -> str:
    """``text`` as one printable line: line breaks become spaces, other control characters are escaped
    (messages quote multi-line HDF5 errors and names from untrusted files)."""
    out = []
    for char in text:
        if char in "\r\n\t\v\f":
            out.append(" ")
        elif char.isprintable():
            out.append(char)
        else:
            out.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(out).strip()


def problem_line(path: object, field: str, expected: str, found: str, fix: str = "") -> str:
    """One problem as a sentence naming the file, the field, what was expected and what was found."""
    text = f"{path}: field '{field}': expected {expected}, found {found}"
    return f"{text}. {fix}" if fix else f"{text}."


def out_of_memory(error: ImportError) -> bool:
    """An import that failed for want of memory (a low ``ulimit -v``), not for a missing module."""
    return any(words in str(error).lower() for words in ("memory", "failed to map segment"))


class Signalled(BaseException):
    """SIGTERM or SIGHUP to the command: unwinds it like Ctrl-C (temporaries removed), with its own exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


_SIGNAL: list[int] = []  # the exit code of the signal the command got (the CLI's handler notes it), if any


def note_signal(code: int) -> None:
    """Remember a signal (``EXIT_INTERRUPTED``, ``EXIT_HANGUP``, ``EXIT_TERMINATED``) until the command ends."""
    _SIGNAL[:] = [code]


def signal_code() -> int | None:
    """The exit code of the signal the command got, or None."""
    return _SIGNAL[0] if _SIGNAL else None


def forget_signal() -> None:
    _SIGNAL.clear()


def stop_if_signalled() -> None:
    """Raise the noted signal's exception (``KeyboardInterrupt`` for Ctrl-C). Called where a command may stop
    (its progress, before an output is published): the handler's own exception can be lost (raised inside a
    weakref callback or a library's ``except``) or held back (inside an import), and the command must still stop
    before it publishes anything."""
    code = signal_code()
    if code == EXIT_INTERRUPTED:
        raise KeyboardInterrupt
    if code is not None:
        raise Signalled(code)


_HELD: list[bool] = []  # inside ``signals_held``: the command's signal handler notes a signal, raises nothing


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Inside the block the command's signal handler only notes a signal, which ``stop_if_signalled`` raises once
    the block is left. For C code that runs Python's signal handlers itself and breaks when one raises (Ray's
    ``wait``: a ``SystemError`` traceback, or a wait that went on)."""
    _HELD.append(True)
    try:
        yield
    finally:
        _HELD.pop()


def signals_are_held() -> bool:
    return bool(_HELD)
