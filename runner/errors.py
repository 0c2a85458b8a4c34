"""One exception root for cyclebox, leaves grouped by how a caller reacts.

Messages carry what was expected and what was found, the path to look at, and
the fix. The CLI maps each leaf to an exit code (see :data:`EXIT_CODES`).
"""

from __future__ import annotations


class CycleboxError(Exception):
    """Root of every error cyclebox raises on purpose; catch this to catch them all."""


class ConfigError(CycleboxError):
    """Raised when operator input (a policy, cycle file, manifest, CLI flag) is invalid.

    The message names the file, the field and the fix. Nothing was started.
    """

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None,
                 fix: str | None = None) -> None:
        parts = []
        if path:
            parts.append(path)
        if field:
            parts.append(field)
        head = ": ".join(parts)
        text = f"{head}: {message}" if head else message
        if fix:
            text += f" Fix: {fix}"
        super().__init__(text)
        self.path = path
        self.field = field
        self.fix = fix


class PolicyViolation(ConfigError):
    """Raised when a role policy or mount asks for something the isolation contract forbids."""


class PrerequisiteError(CycleboxError):
    """Raised before any work when the machine lacks something (engine, image, disk).

    The message says what to install or run.
    """


class SandboxError(CycleboxError):
    """Raised when the container engine fails to create, start or inspect a role container.

    A run that *started* never raises this for its own misbehaviour: that becomes a
    run record with a ``stop_reason``.
    """


class OutputRejected(CycleboxError):
    """Raised when a role's output directory breaks the reading rules (symlink, hard link,
    non-regular file, size cap, invalid JSON). The run's result is ``invalid_output``."""


class IntegrityError(CycleboxError):
    """Raised when a frozen hash no longer matches (plan, data store, image id, receipt)."""


class CheckFailed(CycleboxError):
    """Raised when a gate the operator asked for did not pass (calibration coverage or
    agreement, a training proof the board did not approve). Nothing is broken."""


class EnvironmentFailure(CycleboxError):
    """Raised when the machine failed under us (disk full, out of file descriptors).

    Whatever was recorded stays; nothing that claims success is written.
    """


class Interrupted(CycleboxError):
    """Raised when SIGINT or SIGTERM stopped the work; what was recorded stays."""


# The one exit-code table (README "Exit codes", `cyclebox --help`). No code has two
# meanings: verdicts are 0/1/2, errors 3 and up.
EXIT_OK = 0
"""Success; for a cycle or compare: ``accept_for_review``."""
EXIT_REJECT = 1
"""Verdict ``reject``."""
EXIT_INVALID = 2
"""Verdict ``invalid_comparison`` (the reasons are named), or an apply that was refused."""
EXIT_BAD_INPUT = 3
EXIT_CHECK_FAILED = 4
EXIT_PREREQUISITE = 5
EXIT_ENGINE = 6
EXIT_OUTPUT_REFUSED = 7
EXIT_INTEGRITY = 8
EXIT_ENVIRONMENT = 9
EXIT_UNEXPECTED = 10
"""A bug: one line on stderr names the log file holding the traceback."""
EXIT_INTERRUPTED = 130

EXIT_CODES: dict[type[CycleboxError], int] = {
    ConfigError: EXIT_BAD_INPUT,
    PolicyViolation: EXIT_BAD_INPUT,
    CheckFailed: EXIT_CHECK_FAILED,
    PrerequisiteError: EXIT_PREREQUISITE,
    SandboxError: EXIT_ENGINE,
    OutputRejected: EXIT_OUTPUT_REFUSED,
    IntegrityError: EXIT_INTEGRITY,
    EnvironmentFailure: EXIT_ENVIRONMENT,
    Interrupted: EXIT_INTERRUPTED,
}

EXIT_TABLE: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "ok; cycle/compare verdict accept_for_review"),
    (EXIT_REJECT, "verdict reject"),
    (EXIT_INVALID, "verdict invalid_comparison (reasons named); apply refused"),
    (EXIT_BAD_INPUT, "bad input: the message names the file, the field and the fix"),
    (EXIT_CHECK_FAILED, "a requested check did not pass (calibration, training proof)"),
    (EXIT_PREREQUISITE, "missing prerequisite (engine, image, credential, tool)"),
    (EXIT_ENGINE, "container engine failure or engine lost"),
    (EXIT_OUTPUT_REFUSED, "a container's output was refused"),
    (EXIT_INTEGRITY, "integrity drift: a frozen hash or receipt does not match"),
    (EXIT_ENVIRONMENT, "environment failure (disk full, out of file descriptors, output pipe "
                      "closed)"),
    (EXIT_UNEXPECTED, "unexpected error: one line names the log with the traceback"),
    (EXIT_INTERRUPTED, "interrupted by SIGINT/SIGTERM; what was recorded is kept"),
)
"""(code, meaning) for help texts and the README; keep it the only copy."""


def exit_code_for(err: CycleboxError) -> int:
    """Exit code for an error: the most specific class listed in :data:`EXIT_CODES`."""
    for cls in type(err).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return EXIT_UNEXPECTED
