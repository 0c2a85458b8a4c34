"""Evaluator (runs in the evaluator container): per-case scorers plus an optional judge.

Reads /in/answers.jsonl ({case_id, trial, answer}), /ref/references.json ({case_id:
resolved reference}, each with its ``scorer``) and /cfg/evaluator.json ({judge: null |
{model, threshold}, questions, inputs, scoring: {vocabulary, max_extra, project}}).
Writes /out/grades.jsonl ({case_id, trial, grades}). A project scorer, when the manifest
declares one, is mounted read-only at /scorer/scorer.py and runs in a child process
(sandbox.scorer_host), never in this one. The scorer identity frozen in the plan is the
sha256 of this file, sandbox/scoring.py, sandbox/scorer_host.py, the scoring config and
the project scorer's bytes (runner/cycle/scoring.py).

Criteria (None where a criterion does not apply):
- correctness: the case's scorer (docs/scorers.md);
- evidence: the evidence rule (sandbox.scoring.evidence);
- refusal: the agent refused exactly when the reference says it must.
A scorer that fails (a project scorer raising, hanging, dying or returning garbage; a
built-in one running out of time) gives ``scorer_error`` with a named reason instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from sandbox import scoring

JUDGE_PROMPT = """You grade an analyst's answer against a reference answer.
Question: {question}
Reference: {reference}
Answer: {answer}
Reply with exactly one JSON object: {{"score": <number from 0 to 1>}}."""

PROJECT_FILE = Path("/scorer/scorer.py")
BUILTIN_TIMEOUT_S = 2.0
"""Wall time one built-in scorer call may take (a regex is the only slow one)."""
MAX_REQUEST_BYTES = 1 << 20
"""Largest request sent to the project scorer; a bigger answer is a scorer_error."""
MAX_REPLY_BYTES = 1 << 16
"""Largest reply line read from the project scorer."""
MAX_RESTARTS = 3
"""Project scorer processes started after a failure; then it is given up for the run."""


class ScorerFailed(Exception):
    """A scorer could not grade one case; the message is the named reason."""


# -- built-in scorers --------------------------------------------------------------------------
class _Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (SIGALRM; the re engine checks signals)."""
    def expire(_sig: int, _frame: FrameType | None) -> None:
        raise _Timeout
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score(answer: dict[str, Any] | None, ref: dict[str, Any],
          scoring_cfg: dict[str, Any] | None = None) -> dict[str, bool | None]:
    """Deterministic per-criterion grades for one answer under a built-in scorer (``ref``
    resolved, with its ``scorer``; ``scoring_cfg`` the evidence vocabulary and max_extra,
    none when omitted). Raises ScorerFailed when the scorer runs out of time."""
    answer = answer if isinstance(answer, dict) else {}
    scoring_cfg = scoring_cfg or {}
    refused = answer.get("refused") is True
    spec = ref["scorer"]
    if spec["name"] == "refusal":
        return {"correctness": None, "evidence": None, "refusal": refused}
    try:
        with time_limit(BUILTIN_TIMEOUT_S):
            correct = scoring.correctness(spec, answer.get("answer"), ref.get("value"))
    except _Timeout:
        raise ScorerFailed(f"{spec['name']} scorer took longer than {BUILTIN_TIMEOUT_S:g}s "
                           "(a backtracking regex?)") from None
    return {"correctness": correct, "evidence": evidence(answer, ref, scoring_cfg),
            "refusal": not refused}


def evidence(answer: dict[str, Any], ref: dict[str, Any],
             scoring_cfg: dict[str, Any]) -> bool | None:
    return scoring.evidence(answer.get("evidence"), list(ref.get("evidence") or []),
                            vocabulary=list(scoring_cfg.get("vocabulary") or []),
                            max_extra=int(scoring_cfg.get("max_extra", 0)))


# -- the project's scorer --------------------------------------------------------------------
class ProjectScorer:
    """The project's score() in a child process: bounded replies, a time limit per call,
    a restart after a failure (at most MAX_RESTARTS), never an exception to the caller
    other than ScorerFailed."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.given_up: str | None = None

    def score(self, answer: Any, reference: dict[str, Any],
              case: dict[str, Any]) -> dict[str, bool | None]:
        if self.given_up:
            raise ScorerFailed(self.given_up)
        try:
            request = (json.dumps({"answer": answer, "reference": reference, "case": case},
                                  sort_keys=True) + "\n").encode()
        except (TypeError, ValueError) as exc:
            raise ScorerFailed(f"request not JSON: {exc}") from None
        if len(request) > MAX_REQUEST_BYTES:
            raise ScorerFailed(f"answer too large for the project scorer "
                               f"({len(request)} bytes > {MAX_REQUEST_BYTES})")
        try:
            reply = self._exchange(request)
        except ScorerFailed as exc:
            self._stop()
            if self.starts > MAX_RESTARTS:
                self.given_up = f"project scorer given up after {self.starts} failures; " \
                                f"last: {exc}"
            raise
        if "fatal" in reply:
            self._stop()
            self.given_up = f"project scorer failed to load: {scoring.clip(str(reply['fatal']))}"
            raise ScorerFailed(self.given_up)
        if "error" in reply:
            raise ScorerFailed(f"project scorer raised {scoring.clip(str(reply['error']))}")
        try:
            return scoring.check_project_grades(reply.get("grades"))
        except (TypeError, ValueError) as exc:
            raise ScorerFailed(f"project scorer {exc}") from None

    def _exchange(self, request: bytes) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.starts += 1
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandbox.scorer_host", str(self.path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
        if self.proc.stdin is None or self.proc.stdout is None:
            raise ScorerFailed("project scorer started without pipes")
        deadline = time.monotonic() + self.timeout_s
        _write_all(self.proc.stdin.fileno(), request, deadline, self)
        line = _read_line(self.proc.stdout.fileno(), deadline, self)
        try:
            reply = json.loads(line)
        except ValueError:
            raise ScorerFailed("project scorer replied with something that is not JSON") \
                from None
        if not isinstance(reply, dict):
            raise ScorerFailed("project scorer replied with something that is not an object")
        return reply

    def exit_detail(self) -> str:
        code = self.proc.poll() if self.proc else None
        return "" if code is None else f" (exit code {code})"

    def _stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            for f in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    if f is not None:
                        f.close()
            self.proc = None

    def close(self) -> None:
        self._stop()


def _write_all(fd: int, data: bytes, deadline: float, who: ProjectScorer) -> None:
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ScorerFailed(f"project scorer did not read its request within "
                               f"{who.timeout_s:g}s")
        _r, w, _x = select.select([], [fd], [], left)
        if not w:
            continue
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except (BrokenPipeError, OSError):
            time.sleep(0.05)
            raise ScorerFailed(f"project scorer exited{who.exit_detail()}") from None


def _read_line(fd: int, deadline: float, who: ProjectScorer) -> bytes:
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ScorerFailed(f"project scorer took longer than {who.timeout_s:g}s")
        r, _w, _x = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            if who.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    who.proc.wait(timeout=2)
            raise ScorerFailed(f"project scorer exited{who.exit_detail()}")
        buf += chunk
        if len(buf) > MAX_REPLY_BYTES and b"\n" not in buf[:MAX_REPLY_BYTES]:
            raise ScorerFailed(f"project scorer reply longer than {MAX_REPLY_BYTES} bytes")
    line = buf.split(b"\n", 1)[0]
    if len(line) > MAX_REPLY_BYTES:
        raise ScorerFailed(f"project scorer reply longer than {MAX_REPLY_BYTES} bytes")
    return line


def grade(row: dict[str, Any], ref: dict[str, Any], cfg: dict[str, Any],
          project: ProjectScorer | None) -> dict[str, Any]:
    """Grades for one answer row; a failing scorer gives scorer_error, never an exception."""
    try:
        return _grade(row, ref, cfg, project)
    except ScorerFailed as exc:
        why = str(exc)
    except Exception as exc:
        why = f"scorer crashed: {type(exc).__name__}: {exc}"
    return {"correctness": None, "evidence": None, "refusal": None,
            "scorer_error": scoring.clip(why)}


def _grade(row: dict[str, Any], ref: dict[str, Any], cfg: dict[str, Any],
           project: ProjectScorer | None) -> dict[str, Any]:
    scoring_cfg = cfg.get("scoring") or {}
    answer = row.get("answer")
    if ref["scorer"]["name"] != "project":
        return dict(score(answer, ref, scoring_cfg))
    if project is None:
        raise ScorerFailed("the reference selects the project scorer but none is mounted")
    case = {"id": row["case_id"], "trial": row["trial"],
            "input": (cfg.get("inputs") or {}).get(row["case_id"])}
    decided = project.score(answer, ref, case)
    safe = answer if isinstance(answer, dict) else {}
    grades: dict[str, Any] = {"correctness": None, "evidence": evidence(safe, ref, scoring_cfg),
                              "refusal": safe.get("refused") is not True}
    grades.update(decided)
    return grades


def judge(question: str, answer: Any, ref: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Ask the judge model (through the gateway) for a score; errors are recorded, not hidden."""
    try:
        from sandbox.gateway_client import client

        text = client().chat.completions.create(
            model=cfg["model"], temperature=0,
            messages=[{"role": "user", "content": JUDGE_PROMPT.format(
                question=question, reference=json.dumps(ref, sort_keys=True),
                answer=json.dumps(answer, sort_keys=True))}],
        ).choices[0].message.content or ""
        obj = json.loads(text)
        s = obj["score"] if isinstance(obj, dict) else None
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= 1:
            return {"judge_error": "malformed judge reply"}
        return {"judge_score": float(s), "judge_pass": float(s) >= float(cfg["threshold"])}
    except Exception as exc:
        return {"judge_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def main(in_dir: Path = Path("/in"), ref_dir: Path = Path("/ref"), cfg_dir: Path = Path("/cfg"),
         out_dir: Path = Path("/out"), project_file: Path = PROJECT_FILE) -> int:
    refs = json.loads((ref_dir / "references.json").read_text())
    cfg = json.loads((cfg_dir / "evaluator.json").read_text())
    proj_cfg = (cfg.get("scoring") or {}).get("project")
    project = ProjectScorer(project_file, float(proj_cfg["timeout_s"])) if proj_cfg else None
    lines = []
    try:
        for line in (in_dir / "answers.jsonl").read_text().split("\n"):  # JSON Lines: "\n" only
            if not line:
                continue
            row = json.loads(line)
            ref = refs[row["case_id"]]
            grades = grade(row, ref, cfg, project)
            if cfg.get("judge"):
                # The judge sees the reference as the manifest states it, not the scorer.
                plain = {k: v for k, v in ref.items() if k != "scorer"}
                grades.update(judge(cfg["questions"].get(row["case_id"], ""), row.get("answer"),
                                    plain, cfg["judge"]))
            lines.append(json.dumps({"case_id": row["case_id"], "trial": row["trial"],
                                     "grades": grades}, sort_keys=True))
    finally:
        if project is not None:
            project.close()
    (out_dir / "grades.jsonl").write_text("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
