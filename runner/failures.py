"""Classify any exception that ended work into a named reason and an exit code.

A pure function over the exception value, used by the cycle runner (to name the
reason in ``verdict.json``) and by the CLI's one error boundary (to pick the exit
code). Engine errors are recognised by the module of their class (docker,
requests, urllib3), so this module imports neither: only ``docker_backend``
imports docker.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from runner.errors import (
    EXIT_ENGINE,
    EXIT_ENVIRONMENT,
    EXIT_INTERRUPTED,
    EXIT_UNEXPECTED,
    CycleboxError,
    EnvironmentFailure,
    Interrupted,
    SandboxError,
    exit_code_for,
)

_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM}
_ENGINE_MODULES = ("docker.", "requests.", "urllib3.")


@dataclass(frozen=True)
class Failure:
    """Why work stopped: a reason code for records, a message and the CLI exit code."""

    reason: str
    """``interrupted``, ``engine_error``, ``environment_failure`` or ``unexpected_error``
    (or ``cyclebox_error`` for a deliberate error raised by cyclebox itself)."""
    message: str
    """One line: the exception type and its text, control characters replaced."""
    exit_code: int

    @property
    def overrides_verdict(self) -> bool:
        """True when the exit code must say why the cycle stopped (signal, engine, disk)
        rather than report its ``invalid_comparison`` verdict."""
        return self.reason in ("interrupted", "engine_error", "environment_failure")


def one_line(text: str, limit: int = 500) -> str:
    """``text`` as one printable line: surrogates and control characters replaced, capped."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
    safe = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else "?"
                   for c in safe)
    return safe if len(safe) <= limit else safe[:limit] + "..."


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_engine_error(exc: BaseException) -> bool:
    """True for an error of the container engine or the connection to it.

    A deliberate cyclebox error other than :class:`SandboxError` met first in the chain
    wins over an engine error it was raised from (or while handling): cyclebox already
    said what it means (e.g. "engine not reachable" is a missing prerequisite, a build
    refused for a requirements conflict is bad input)."""
    for e in _chain(exc):
        if isinstance(e, SandboxError) or type(e).__module__.startswith(_ENGINE_MODULES):
            return True
        if isinstance(e, CycleboxError):
            return False
    return False


def is_environment_error(exc: BaseException) -> bool:
    """True when the machine failed under us: disk full, quota, out of descriptors/memory."""
    return any(isinstance(e, EnvironmentFailure | MemoryError)
               or (isinstance(e, OSError) and e.errno in _ENVIRONMENT_ERRNOS)
               for e in _chain(exc))


def environment_reason(text: str) -> str | None:
    """The first machine failure a tool's own message names (``No space left on device``,
    ``Input/output error``, ``Too many open files``...), for tools that report an errno
    only as text (git); None when it names none."""
    for code in (*sorted(_ENVIRONMENT_ERRNOS), errno.EIO):
        reason = os.strerror(code)
        if reason in text:
            return reason
    return None


def _signalled(exc: BaseException) -> bool:
    """A signal is the first cause: ``exc`` is its ``KeyboardInterrupt`` (or
    :class:`Interrupted`), or was raised while one unwound (in its context chain: e.g. a
    container's removal that timed out on a hung engine on the way out)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 64:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, KeyboardInterrupt | Interrupted):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return False


def classify(exc: BaseException) -> Failure:
    """The named reason and exit code for an exception that ended work."""
    text = one_line(f"{type(exc).__name__}: {exc}")
    if _signalled(exc):
        return Failure("interrupted", "interrupted by a signal", EXIT_INTERRUPTED)
    if is_environment_error(exc):
        return Failure("environment_failure", text, EXIT_ENVIRONMENT)
    # An explicit cyclebox error wins over the engine error in its context: the class
    # that was raised on purpose names the exit code.
    if is_engine_error(exc):
        return Failure("engine_error", text, EXIT_ENGINE)
    if isinstance(exc, CycleboxError):
        return Failure("cyclebox_error", text, exit_code_for(exc))
    return Failure("unexpected_error", text, EXIT_UNEXPECTED)
