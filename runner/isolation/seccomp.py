"""The seccomp profile every role container runs under; checks are pure over bytes.

``policies/seccomp.json`` is the Docker engine's default profile, byte for byte
as moby ships it for the engine here (``profiles/seccomp/default.json`` at tag
v20.10.24, blob dbf1fa86f151, sha256 ce3585b856aa...), minus the three
``io_uring_*`` syscalls: io_uring reaches large, frequently patched kernel code
and no role needs it; and ``prlimit64`` only on the caller itself (pid 0, what
``setrlimit`` calls) or without a new limit: a role shares the holder's uid, and
lowered PID 1's ``RLIMIT_SIGPENDING`` to have a ``SIGUSR1`` of its own delivered
without details, as the host's (``sandbox/holder.py``, ``SIGPENDING_ROLE``).
Everything else (``keyctl`` denied, ``unshare`` and ``clone`` with namespace flags
only with CAP_SYS_ADMIN, which roles never have) stays as upstream has it.

Invariants a profile must meet to be used: it parses as one JSON object of
bounded size, its default action refuses, and no io_uring syscall sits in a rule
that allows it. The profile's sha256 is bound into the plan (frozen copy under
``inputs/``) and the text goes to the engine as ``security_opt=["seccomp=<json>"]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.errors import ConfigError
from runner.hashing import sha256_bytes
from runner.isolation.sandbox import Frozen
from runner.paths import PROJECT_ROOT

PROFILE_PATH = PROJECT_ROOT / "policies" / "seccomp.json"
FORBIDDEN = ("io_uring_setup", "io_uring_enter", "io_uring_register")
"""Syscalls no role may call (x86_64 numbers 425, 426, 427)."""
MAX_BYTES = 256 * 1024
DENY_ACTIONS = frozenset({"SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS",
                          "SCMP_ACT_KILL_THREAD", "SCMP_ACT_TRAP"})
_FIX = "restore the shipped profile: git checkout -- policies/seccomp.json"


class SeccompProfile(Frozen):
    """A checked profile, ready to hand to the engine."""

    path: str
    """Where it was read from."""
    sha256: str
    """sha256 of the file's bytes as read."""
    text: str
    """Compact JSON of the profile (what the engine receives)."""
    rules: int
    """Number of syscall rules, for doctor's report."""


def check_profile(data: bytes, *, path: str, field: str = "seccomp") -> SeccompProfile:
    """Validate profile bytes; ConfigError naming the file and the reason otherwise."""
    from sandbox.proposal import strict_json

    def bad(why: str) -> ConfigError:
        return ConfigError(why, path=path, field=field, fix=_FIX)

    if len(data) > MAX_BYTES:
        raise bad(f"profile is {len(data)} bytes, more than {MAX_BYTES}")
    try:
        doc = strict_json(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise bad("a seccomp profile is a JSON object")
    default = doc.get("defaultAction")
    if default not in DENY_ACTIONS:
        raise bad(f"defaultAction must refuse ({sorted(DENY_ACTIONS)}), got {default!r}")
    rules = doc.get("syscalls")
    if not isinstance(rules, list) or not rules:
        raise bad("'syscalls' must be a non-empty list of rules")
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict):
            raise bad(f"syscalls[{i}] is not an object")
        names = rule.get("names", [])
        if "name" in rule:
            names = [*names, rule["name"]]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad(f"syscalls[{i}].names must be a list of strings")
        allowed = sorted(set(names) & set(FORBIDDEN))
        if allowed and rule.get("action") not in DENY_ACTIONS:
            raise bad(f"syscalls[{i}] allows {allowed}; io_uring must stay refused")
    text = json.dumps(doc, separators=(",", ":"), sort_keys=True)
    return SeccompProfile(path=path, sha256=sha256_bytes(data), text=text, rules=len(rules))


def load_profile(path: Path | None = None, *, field: str = "seccomp") -> SeccompProfile:
    """Read and check a profile (the shipped one when ``path`` is None)."""
    from runner.loading import read_capped

    p = path or PROFILE_PATH
    # a regular file, opened non-blocking: a FIFO or a device is refused unread (a FIFO
    # named here held freeze, doctor and sandbox exec forever)
    data = read_capped(p, max_bytes=MAX_BYTES, what="seccomp profile", fix=_FIX,
                       ref=(str(p), field))
    return check_profile(data, path=str(p), field=field)


GVISOR_RUNTIMES = frozenset({"runsc"})


def for_runtime(text: str, runtime: str | None) -> str:
    """The profile as the engine receives it for ``runtime``: ``text`` itself, except
    under gVisor, where the rule that answers ``clone3`` with ``ENOSYS`` becomes an allow.

    Why: runc's filter returns the rule's ``errnoRet`` (38, ENOSYS) and glibc then falls
    back to ``clone``, whose flags the profile does check. gVisor applies the profile in
    its own sentry, whose version here ignores a rule's ``errnoRet`` and answers EPERM, on
    which glibc gives up: no thread could start (``pthread_create`` fails, Python's
    "can't start new thread"). Allowed through, ``clone3`` reaches the sentry, which does
    not implement it and says ENOSYS itself, so the fallback to the checked ``clone``
    happens as under runc; no host kernel sees either call. Anything else, and a profile
    without that rule, is passed unchanged."""
    if runtime not in GVISOR_RUNTIMES:
        return text
    doc = json.loads(text)
    changed = False
    for rule in doc.get("syscalls", []):
        if (isinstance(rule, dict) and rule.get("names") == ["clone3"]
                and rule.get("action") == "SCMP_ACT_ERRNO" and rule.get("errnoRet") == 38):
            rule["action"] = "SCMP_ACT_ALLOW"
            del rule["errnoRet"]
            changed = True
    return json.dumps(doc, separators=(",", ":")) if changed else text
