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


EXIT_CODES: dict[type[CycleboxError], int] = {
    ConfigError: 3,
    PolicyViolation: 3,
    PrerequisiteError: 5,
    SandboxError: 6,
    OutputRejected: 7,
    IntegrityError: 8,
}


def exit_code_for(err: CycleboxError) -> int:
    """Exit code for an error: the most specific class listed in :data:`EXIT_CODES`."""
    for cls in type(err).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1
