"""Refresh ``constraints/<env>.txt`` (``make lock``): build the env in a fresh venv without
constraints, exactly as its make target installs it, and write what ``pip freeze`` lists.

Why: ``make setup``, ``verl-env``, ``mock-env`` and ``attest-env`` install with ``-c`` on
these files, so a release on PyPI the day CI runs changes nothing (on 2026-12-04 new
releases of httpcore2 and opentelemetry-api failed nine tests). A refresh is a change
like any other: run ``make test`` on it before it lands.

    python constraints/refresh.py PIP_VERSION ENV [ENV ...]     (ENV: host verl mock attest)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "lock"

INSTALLS: dict[str, tuple[str, list[list[str]]]] = {
    "host": (".venv (make setup: cyclebox's dependencies and the dev tools)",
             [["-e", ".[dev]"]]),
    "verl": ("build/verl-venv (make verl-env: verl, TRL and the CPU torch; torch without "
             "its +cpu label)",
             [["-r", "tests/verl-env.txt"], ["--no-deps", "verl==0.9.1"]]),
    "mock": ("build/mock-venv (make mock-env: the third-party mock upstream)",
             [["--only-binary=:all:", "mock-ai-api==0.1.1"]]),
    "attest": ("build/attest-venv (make attest-env: the third-party attestation verifiers)",
               [["--only-binary=:all:", "-r", "tests/attest-env.txt"]]),
}
SKIP = ("pip==", "setuptools==", "wheel==")


def freeze(env: str, pip_version: str) -> str:
    what, installs = INSTALLS[env]
    venv = WORK / env
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run([*pip, f"pip=={pip_version}"], check=True)
    for args in installs:
        subprocess.run([*pip, *args], check=True, cwd=ROOT)
    out = subprocess.run([str(venv / "bin" / "pip"), "freeze", "--exclude-editable", "--all"],
                         check=True, capture_output=True, text=True).stdout
    pins = []
    for line in out.splitlines():
        if not line or line.startswith(SKIP) or line.startswith("#"):
            continue
        # the CPU wheel's label: `==` without it matches it
        pins.append(line.split("+", 1)[0] if line.startswith("torch==") else line)
    pins.sort(key=str.lower)
    head = (f"# Constraints of {what}.\n"
            "# Every distribution that env installs, at the version CI last passed with; "
            "refresh\n"
            "# with 'make lock' (fresh venvs, unconstrained, then pip freeze) and run make "
            "test.\n")
    return head + "".join(f"{p}\n" for p in pins)


def main() -> int:
    if len(sys.argv) < 3 or any(e not in INSTALLS for e in sys.argv[2:]):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        # every env first: a failed install (or Ctrl-C) leaves every file as it was
        texts = {env: freeze(env, sys.argv[1]) for env in sys.argv[2:]}
    except subprocess.CalledProcessError as exc:
        print(f"make lock: {' '.join(map(str, exc.cmd))} failed (exit {exc.returncode}); "
              "constraints/ unchanged", file=sys.stderr)
        return 1
    for env, text in texts.items():
        dest = ROOT / "constraints" / f"{env}.txt"
        tmp = dest.with_name(f".{env}.txt.tmp")
        try:
            tmp.write_text(text)
            tmp.replace(dest)  # whole or not at all: a full disk never truncates a pin file
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            print(f"make lock: could not write {dest}: {exc.strerror or exc}; fix: make it "
                  "writable (and free some disk), then run make lock again", file=sys.stderr)
            return 1
        print(f"constraints/{env}.txt: {text.count(chr(10)) - 3} pins")
    shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
