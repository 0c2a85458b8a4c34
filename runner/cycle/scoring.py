"""Scoring on the host side: what the evaluator is given, the scorer identity, and reading
its grades back as hostile input. The scoring itself runs in the evaluator container
(sandbox/evaluator.py, sandbox/scoring.py); a project's scorer file is read here only as
bytes (hashed, syntax-checked with ``ast``), never imported or run (docs/scorers.md).

Invariants: every reference resolves to exactly one scorer before freeze; the scorer
identity covers the evaluator's sources, the scoring config and the project file's bytes,
so a change to any of them shows as an identity difference in compare; a grades file
that is not exactly one valid row per expected (case, trial) fails the stage.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runner.cycle.models import Grades, Manifest, Record, Reference
from runner.errors import ConfigError, OutputRejected
from runner.hashing import sha256_bytes, sha256_file, sha256_json
from runner.isolation.collect import loads_strict
from runner.loading import is_inside, read_capped, show
from runner.paths import sandbox_src
from sandbox import scoring

EVALUATOR_SOURCES = ("evaluator.py", "scoring.py", "scorer_host.py")
"""sandbox/ files whose bytes decide grades; all hashed into the scorer identity."""
PROJECT_SCORER_INPUT = "scorer/scorer.py"
"""Where freeze copies the project's scorer under ``DIR/inputs/`` (mounted at /scorer)."""
MAX_PROJECT_SCORER_BYTES = 256 * 1024
MAX_GRADE_ROWS = 100_000
MAX_ERROR_CHARS = 400
"""Longest judge_error / scorer_error accepted from the evaluator."""
SCORER_FIX = ("see docs/scorers.md: scoring.project.file names a Python file next to the "
              "manifest that defines score(answer, reference, case)")

Key = tuple[str, int]


def resolved_reference(ref: Reference, manifest: Manifest | None = None) -> dict[str, Any]:
    """The reference as the evaluator reads it: its fields plus the scorer that applies
    (its own, its kind's, or the manifest's default)."""
    sc = manifest.scoring if manifest else None
    spec = ref.selected(sc.default if sc else None)
    if spec is None:  # the Manifest validator refuses this; never grade by a guess
        raise ValueError("reference without a scorer")
    return {**ref.model_dump(mode="json"), "scorer": spec.model_dump(mode="json")}


def vocabulary(manifest: Manifest) -> list[str]:
    """Every evidence entry any reference requires, plus the declared vocabulary; each as
    its normalised token phrase, sorted."""
    entries: set[str] = set()
    declared = manifest.scoring.evidence_vocabulary if manifest.scoring else ()
    for e in (*declared, *(e for s in manifest.scenarios for e in s.reference.evidence)):
        entries.add(" ".join(scoring.phrase(e)))
    return sorted(e for e in entries if e)


def evaluator_scoring(manifest: Manifest) -> dict[str, Any]:
    """The ``scoring`` section of /cfg/evaluator.json (part of the scorer identity)."""
    sc = manifest.scoring
    project = sc.project if sc else None
    return {"vocabulary": vocabulary(manifest),
            "max_extra": sc.evidence_max_extra if sc else 0,
            "project": {"timeout_s": project.timeout_s} if project else None}


def scorer_identity(manifest: Manifest, project_sha256: str | None) -> str:
    """sha256 over the evaluator's sources, the scoring config and the project scorer."""
    root = sandbox_src()
    return sha256_json({"sources": {n: sha256_file(root / n) for n in EVALUATOR_SOURCES},
                        "scoring": evaluator_scoring(manifest), "project": project_sha256})


def project_scorer_file(manifest: Manifest, manifest_path: Path) -> Path | None:
    """The project scorer file a manifest declares, checked: inside the manifest's
    directory, a regular UTF-8 file of at most 256 KiB that parses as Python and defines
    a top-level ``score`` taking three arguments. Parsed with ``ast``, never imported."""
    sc = manifest.scoring
    if sc is None or sc.project is None:
        return None
    where, field = show(str(manifest_path)), "scoring.project.file"
    base = manifest_path.parent
    path = base / sc.project.file
    if not is_inside(path, base):
        raise ConfigError(f"{show(sc.project.file)} resolves outside {show(str(base))} "
                          "(through a symlink?)", path=where, field=field, fix=SCORER_FIX)
    data = read_capped(path, max_bytes=MAX_PROJECT_SCORER_BYTES, what="scorer file",
                       fix=SCORER_FIX, ref=(where, field))
    check_project_source(data, path=where, field=field)
    return path


def check_project_source(data: bytes, *, path: str, field: str) -> None:
    """ConfigError unless ``data`` is UTF-8 Python defining ``def score(a, b, c)``."""
    try:
        tree = ast.parse(data.decode("utf-8"), filename="scorer.py")
    except UnicodeDecodeError:
        raise ConfigError("the scorer file is not UTF-8", path=path, field=field,
                          fix=SCORER_FIX) from None
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ConfigError(f"the scorer file does not parse: {show(str(exc), 200)}", path=path,
                          field=field, fix=SCORER_FIX) from None
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "score"]
    if not fns:
        raise ConfigError("the scorer file defines no top-level function score", path=path,
                          field=field, fix="define def score(answer, reference, case) "
                          "returning e.g. {'correctness': True}")
    a = fns[-1].args
    if len(a.posonlyargs) + len(a.args) < 3 and a.vararg is None:
        raise ConfigError("score must take three arguments (answer, reference, case)",
                          path=path, field=field, fix=SCORER_FIX)


def project_sha256(path: Path | None) -> str | None:
    return None if path is None else sha256_bytes(path.read_bytes())


def parse_grades(raw: bytes, expected: Iterable[Key], *,
                 judge_threshold: float | None = None) -> dict[Key, Grades]:
    """Grades from the evaluator's grades.jsonl, read as hostile input: every line one
    JSON object ``{case_id, trial, grades}`` for an expected (case, trial), every expected
    one present once, grades valid strictly (no coercion: "yes" is not true). The judge
    fields must agree with the plan: none without a judge (``judge_threshold`` None);
    with one, either a score with ``judge_pass`` exactly ``score >= threshold`` or a
    ``judge_error``, never both. Error strings are kept escaped (no control character).
    ValueError naming the line."""
    want = set(expected)
    out: dict[Key, Grades] = {}
    lines = [ln for ln in raw.split(b"\n") if ln.strip()]
    if len(lines) > MAX_GRADE_ROWS:
        raise ValueError(f"{len(lines)} rows, more than {MAX_GRADE_ROWS}")
    for n, line in enumerate(lines, 1):
        try:
            row = loads_strict(line, source=f"grades.jsonl line {n}")
        except OutputRejected as exc:
            raise ValueError(str(exc)) from None
        if not isinstance(row, dict) or set(row) != {"case_id", "trial", "grades"}:
            raise ValueError(f"line {n}: expected an object with case_id, trial, grades")
        key = (row["case_id"], row["trial"])
        if not isinstance(key[0], str) or type(key[1]) is not int or key not in want:
            raise ValueError(f"line {n}: grades for an unexpected (case, trial) "
                             f"{show(str(key), 80)}")
        if key in out:
            raise ValueError(f"line {n}: (case {key[0]}, trial {key[1]}) graded twice")
        try:
            g = Grades.model_validate(row["grades"], strict=True)
        except ValidationError as exc:
            e = exc.errors(include_url=False)[0]
            raise ValueError(f"line {n}: grades.{'.'.join(map(str, e['loc']))}: "
                             f"{show(e['msg'], 120)}") from None
        if g.judge_score is not None and not 0 <= g.judge_score <= 1:
            raise ValueError(f"line {n}: grades.judge_score {g.judge_score!r} is outside 0..1")
        if len(g.judge_error or "") > MAX_ERROR_CHARS:
            raise ValueError(f"line {n}: grades.judge_error longer than {MAX_ERROR_CHARS}")
        if problem := _judge_problem(g, judge_threshold):
            raise ValueError(f"line {n}: {problem}")
        out[key] = g.model_copy(update={
            k: show(v, MAX_ERROR_CHARS)[:MAX_ERROR_CHARS]
            for k in ("judge_error", "scorer_error") if (v := getattr(g, k)) is not None})
    if missing := sorted(want - out.keys()):
        c, t = missing[0]
        raise ValueError(f"no grades for {len(missing)} expected (case, trial), the first "
                         f"(case {show(c, 80)}, trial {t})")
    return out


def _judge_problem(g: Grades, threshold: float | None) -> str | None:
    """Why the row's judge fields disagree with the plan's judge; None when they agree."""
    fields = {"judge_score": g.judge_score, "judge_pass": g.judge_pass,
              "judge_error": g.judge_error}
    if threshold is None:
        given = [k for k, v in fields.items() if v is not None]
        return (f"grades.{given[0]} given, but the plan has no judge" if given else None)
    if g.judge_error is not None:
        if g.judge_score is not None or g.judge_pass is not None:
            return "grades.judge_error given beside a judge verdict"
        return None
    if g.judge_score is None or g.judge_pass is None:
        return ("grades.judge_score and grades.judge_pass: the plan has a judge, so each row "
                "needs both (or a judge_error)")
    if g.judge_pass is not (g.judge_score >= threshold):
        return (f"grades.judge_pass {g.judge_pass} disagrees with judge_score "
                f"{g.judge_score!r} at the plan's threshold {threshold!r}")
    return None


def apply_grades(records: Sequence[Record], grades: dict[Key, Grades]) -> list[Record]:
    """Each ok record with its grades; one whose scorer failed becomes infra_invalid with
    the named reason ``scorer_error: ...`` (its grades kept for the reviewer)."""
    out = []
    for r in records:
        if r.status != "ok":
            out.append(r)
            continue
        g = grades.get((r.case_id, r.trial))
        if g is not None and g.scorer_error is not None:
            reason = f"scorer_error: {show(g.scorer_error, 300)}"
            out.append(r.model_copy(update={"grades": g, "status": "infra_invalid",
                                            "reason": reason}))
        else:
            out.append(r.model_copy(update={"grades": g}))
    return out
