"""Child process that runs a project's scorer file (evaluator container only).

``python -m sandbox.scorer_host /scorer/scorer.py`` loads the file, then answers one JSON
request per stdin line (``{"answer", "reference", "case"}``) with one JSON line on the
original stdout: ``{"grades": <what score() returned>}`` or ``{"error": "..."}``. A file
that fails to load answers ``{"fatal": "..."}`` once and exits. The project's own prints
go to stderr, so they cannot forge a reply; the evaluator bounds and validates every
reply anyway (sandbox.scoring.check_project_grades) and survives this process dying.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from sandbox.scoring import clip


def _describe(exc: BaseException) -> str:
    return clip(f"{type(exc).__name__}: {exc}")


def _load(path: str) -> Callable[..., Any]:
    spec = importlib.util.spec_from_file_location("project_scorer", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "score", None)
    if not callable(fn):
        raise TypeError("defines no function score(answer, reference, case)")
    return fn  # type: ignore[no-any-return]


def _send(channel: TextIO, reply: dict[str, Any]) -> None:
    try:
        text = json.dumps(reply, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as exc:
        text = json.dumps({"error": f"score() returned a value that is not JSON: "
                                    f"{_describe(exc)}"})
    channel.write(text + "\n")
    channel.flush()


def main(path: str) -> int:
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        fn = _load(path)
    except BaseException as exc:
        _send(channel, {"fatal": _describe(exc)})
        return 3
    for line in sys.stdin:
        try:
            req = json.loads(line)
            result = fn(req["answer"], req["reference"], req["case"])
            reply: dict[str, Any] = {"grades": result}
        except BaseException as exc:
            reply = {"error": _describe(exc)}
        _send(channel, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
