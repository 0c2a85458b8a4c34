"""Proposal validation rules (SPEC §5): every named refusal of the pure checks.

No Docker: these are the rules the worker, the apply container and the host re-check
share; each test breaks exactly one rule and asserts the exact reason name.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from sandbox.proposal import (
    MAX_FILE_BYTES,
    Change,
    Refused,
    check_changes,
    check_path,
    check_tree,
    parse_reply,
    strict_json,
    strip_fence,
)

PATHS = {"prompts/system.md", "prompts/new.md", "notes.txt"}
ALLOW = ["prompts/*", "notes.txt"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reason(exc: pytest.ExceptionInfo[Refused]) -> str:
    return exc.value.reason


# -- parse_reply ------------------------------------------------------------------------

GOOD = {"files": [{"path": "prompts/system.md", "content": "be brief\n"}],
        "rationale": "shorter answers"}


def test_parse_reply_accepts_plain_json() -> None:
    changes, rationale = parse_reply(json.dumps(GOOD))
    assert changes == [Change("prompts/system.md", "be brief\n")]
    assert rationale == "shorter answers"


def test_parse_reply_rationale_is_optional() -> None:
    changes, rationale = parse_reply(json.dumps({"files": []}))
    assert changes == []
    assert rationale == ""


@pytest.mark.parametrize("fence", ["```json", "```", "  ```json"])
def test_parse_reply_accepts_whole_message_fence(fence: str) -> None:
    text = f"{fence}\n{json.dumps(GOOD, indent=1)}\n```\n"
    changes, rationale = parse_reply(text)
    assert changes == [Change("prompts/system.md", "be brief\n")]
    assert rationale == "shorter answers"


@pytest.mark.parametrize("text", [
    "Here is my proposal:\n```json\n" + json.dumps(GOOD) + "\n```",   # prose before the fence
    "```json\n" + json.dumps(GOOD) + "\n```\nHope this helps!",       # prose after the fence
    "Sure! " + json.dumps(GOOD),                                       # prefixed JSON
    json.dumps(GOOD) + " trailing",                                    # suffixed JSON
    "I would change the system prompt to be shorter.",                 # not JSON at all
    "",
    "```json\n" + json.dumps(GOOD) + "\n```\n```json\n{}\n```",       # two fences
])
def test_parse_reply_refuses_non_json_or_prefixed(text: str) -> None:
    with pytest.raises(Refused) as exc:
        parse_reply(text)
    assert _reason(exc) == "malformed_proposal"


def test_parse_reply_refuses_duplicate_keys() -> None:
    dup_top = ('{"files": [], "rationale": "a", "rationale": "b"}')
    dup_file = ('{"files": [{"path": "prompts/system.md", "path": "notes.txt", '
                '"content": "x"}], "rationale": ""}')
    for text in (dup_top, dup_file):
        with pytest.raises(Refused) as exc:
            parse_reply(text)
        assert _reason(exc) == "malformed_proposal"
        assert "duplicate key" in exc.value.message


@pytest.mark.parametrize("obj", [
    [GOOD],                                                        # not an object
    {"rationale": "no files"},                                     # files missing
    {**GOOD, "extra": 1},                                          # unknown top-level key
    {"files": {"path": "a", "content": "b"}, "rationale": ""},     # files not a list
    {"files": [], "rationale": 3},                                 # rationale not a string
    {"files": ["prompts/system.md"], "rationale": ""},             # entry not an object
    {"files": [{"path": "prompts/system.md"}], "rationale": ""},   # content missing
    {"files": [{"path": "p", "content": "c", "mode": "755"}], "rationale": ""},  # extra key
    {"files": [{"path": 1, "content": "c"}], "rationale": ""},     # path not a string
    {"files": [{"path": "p", "content": None}], "rationale": ""},  # content not a string
])
def test_parse_reply_refuses_wrong_shape(obj: object) -> None:
    with pytest.raises(Refused) as exc:
        parse_reply(json.dumps(obj))
    assert _reason(exc) == "malformed_proposal"


@pytest.mark.parametrize("text", [
    '{"files": [], "rationale": NaN}',
    '{"files": [], "rationale": Infinity}',
    '{"files": [], "rationale": "", "n": 1e999}',
])
def test_parse_reply_refuses_non_finite_numbers(text: str) -> None:
    with pytest.raises(Refused) as exc:
        parse_reply(text)
    assert _reason(exc) == "malformed_proposal"


def test_strict_json_and_strip_fence_helpers() -> None:
    with pytest.raises(ValueError, match="duplicate key"):
        strict_json('{"a": 1, "a": 2}')
    assert strip_fence("```json\n{}\n```") == "{}"
    assert strip_fence("say ```json\n{}\n```") == "say ```json\n{}\n```"


@pytest.mark.parametrize(("text", "error"), [
    ("[" * 64 + "]" * 64, None),  # at the limit, no more brackets: the scan is skipped
    ("[" * 65 + "]" * 65, "deeper than 64"),
    ("[" * 64 + "[]" + "]" * 64, "deeper than 64"),
    ("[" + "[]," * 100 + "[]]", None),  # many brackets, shallow: scanned and accepted
    ('["' + "[" * 100 + '"]', None),  # brackets inside a string do not nest
    ('{"a": {"b": 1, "c": 2, "b": 3}}', "duplicate key 'b'"),  # named, however deep
    ('[{"k": 1}, {"k": 2}]', None),  # the same key in two objects is no duplicate
])
def test_strict_json_depth_and_duplicate_keys(text: str, error: str | None) -> None:
    if error is None:
        assert strict_json(text) == json.loads(text)
    else:
        with pytest.raises(ValueError, match=error):
            strict_json(text)


@pytest.mark.parametrize(("text", "error"), [
    ("[" + "{}," * 9 + "{}]", "more than 10 objects and arrays"),  # 11 of them
    ("[" + "{}," * 8 + "{}]", None),  # 10: at the cap
    ('["' + "{" * 50 + '"]', None),  # braces inside a string are no objects
    ('[[], [], [[], [], [], []], [], [], []]', "more than 10 objects and arrays"),
])
def test_strict_json_counts_objects_and_arrays(text: str, error: str | None) -> None:
    """A cap on what the parser calls Python for (each object's duplicate-key check):
    4 MiB of ``[{},{},...]`` took 1.1 s of the gateway's CPU before a refusal."""
    if error is None:
        assert strict_json(text, max_containers=10) == json.loads(text)
    else:
        with pytest.raises(ValueError, match=error):
            strict_json(text, max_containers=10)
    assert strict_json(text) == json.loads(text)  # no cap unless asked


@pytest.mark.parametrize("number", ["1e400", "2e308", "1.5E+0400", "1" * 250 + "e99",
                                    "9" * 310 + ".5", "0." + "0" * 300 + "1e999"])
def test_a_float_that_overflows_is_refused_on_either_path(number: str) -> None:
    """Floats are converted in C unless the text could hold one past 1.8e308 (a
    three-digit exponent, or 200 digits in a row); then each is checked."""
    with pytest.raises(ValueError, match="overflows to infinity"):
        strict_json(f'{{"x": [0.5, {number}]}}')


def test_floats_that_cannot_overflow_parse_as_json_does() -> None:
    text = '[0.5, -2.25e-7, 1e99, 1e-400, 123456789.125, 9.999e+99, ' + "1" * 199 + ".5]"
    assert strict_json(text) == json.loads(text)


@pytest.mark.parametrize("tail", ['"' + '\\"' * 200_000, '"' + '\\"' * 200_000 + "\\",
                                  '"' + "x" * 400_000])
def test_the_depth_scan_of_an_unclosed_string_is_linear(tail: str) -> None:
    """More than 64 brackets (so the depth scan runs), then a string that never closes,
    full of escaped quotes: a string pattern that could fail at the end was retried from
    every later quote, each try reading to the end, in one C call holding the GIL. At
    400 KB that took many minutes and froze the gateway's every socket; now milliseconds.
    The bound is a denial-of-service guard, hundreds of times the linear scan's time."""
    text = "[]" * 65 + tail
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"Extra data|Unterminated string"):
        strict_json(text)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("text", [
    pytest.param("```\n" + " \n" * 200_000, id="blank-lines-no-close"),
    pytest.param("```json\n" + "\n" * 200_000 + "x", id="newlines-then-text"),
    pytest.param("```\n" + " \n" * 100_000 + "```", id="blank-lines-closed"),
])
def test_stripping_a_fence_is_linear(text: str) -> None:
    """The fence pattern backtracked cubically on an opening fence followed by blank lines
    (10 000 characters took 137 s in one C call holding the GIL, on the host in the dream
    stage). A denial-of-service guard, hundreds of times the scan's time."""
    t0 = time.perf_counter()
    strip_fence(text)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize(("text", "body"), [
    ('```json\n{"a": 1}\n```', '{"a": 1}'),
    ('  ```\n\n  {"a": 1}\n\n ```  \n', '  {"a": 1}\n'),
    ("```\n\n```", ""),
    ("```\n \n```", " "),
    ("```json x\n{}\n```", "```json x\n{}\n```"),  # a tag with a space: not a fence
    ("```{}```", "```{}```"),
    ("{}", "{}"),
])
def test_strip_fence_keeps_what_the_pattern_took(text: str, body: str) -> None:
    assert strip_fence(text) == body


# -- check_path -------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "reason"), [
    ("prompts/sys\0tem.md", "nul_in_path"),
    ("\0", "nul_in_path"),
    ("/etc/passwd", "absolute_path"),
    ("/prompts/system.md", "absolute_path"),
    ("C:\\Windows\\x", "absolute_path"),
    ("c:/x", "absolute_path"),
    ("../x", "path_traversal"),
    ("prompts/../../x", "path_traversal"),
    ("prompts/..", "path_traversal"),
    ("prompts\\..\\x", "path_traversal"),
    (".git/config", "git_path"),
    ("prompts/.git/hooks/pre-commit", "git_path"),
    (".GIT/config", "git_path"),
    ("sub/.Git/HEAD", "git_path"),
    ("", "not_normalized"),
    ("./prompts/system.md", "not_normalized"),
    ("prompts//system.md", "not_normalized"),
    ("prompts/./system.md", "not_normalized"),
    ("prompts/", "not_normalized"),
    ("prompts\\system.md", "not_normalized"),
    ("prompts/.", "not_normalized"),
    ("prompts/other.md", "outside_invocation_set"),
    ("README.md", "outside_invocation_set"),
    ("Prompts/system.md", "outside_invocation_set"),
])
def test_check_path_reasons(path: str, reason: str) -> None:
    with pytest.raises(Refused) as exc:
        check_path(path, paths=PATHS, allowlist=ALLOW)
    assert _reason(exc) == reason


def test_check_path_outside_allowlist() -> None:
    # in the invocation set but matched by no allowlist glob
    with pytest.raises(Refused) as exc:
        check_path("notes.txt", paths=PATHS, allowlist=["prompts/*"])
    assert _reason(exc) == "outside_allowlist"


def test_check_path_accepts_listed_and_allowlisted() -> None:
    for p in sorted(PATHS):
        check_path(p, paths=PATHS, allowlist=ALLOW)


def test_check_path_order_shape_before_membership() -> None:
    # even when listed in paths and allowlist, shape rules fire first
    for path, reason in [("../x", "path_traversal"), ("/abs", "absolute_path"),
                         (".git/config", "git_path"), ("a/./b", "not_normalized")]:
        with pytest.raises(Refused) as exc:
            check_path(path, paths={path}, allowlist=["*", "**"])
        assert _reason(exc) == reason


# -- check_changes ----------------------------------------------------------------------

def test_check_changes_accepts_good_changes() -> None:
    check_changes([Change("prompts/system.md", "x"), Change("notes.txt", "")],
                  paths=PATHS, allowlist=ALLOW)


def test_check_changes_refuses_invocation_set_outside_allowlist() -> None:
    # the invocation's own path set must sit inside the policy allowlist
    with pytest.raises(Refused) as exc:
        check_changes([], paths={"prompts/system.md", "runner/cli.py"}, allowlist=ALLOW)
    assert _reason(exc) == "outside_allowlist"
    assert "runner/cli.py" in exc.value.message


@pytest.mark.parametrize(("path", "reason"), [
    ("../x", "path_traversal"),
    ("/abs", "absolute_path"),
    (".git/config", "git_path"),
    ("a\0b", "nul_in_path"),
    ("./notes.txt", "not_normalized"),
    ("README.md", "outside_invocation_set"),
])
def test_check_changes_applies_path_rules(path: str, reason: str) -> None:
    with pytest.raises(Refused) as exc:
        check_changes([Change("prompts/system.md", "ok"), Change(path, "x")],
                      paths=PATHS, allowlist=ALLOW)
    assert _reason(exc) == reason


def test_check_changes_duplicate_path() -> None:
    with pytest.raises(Refused) as exc:
        check_changes([Change("prompts/system.md", "a"), Change("notes.txt", "b"),
                       Change("prompts/system.md", "c")], paths=PATHS, allowlist=ALLOW)
    assert _reason(exc) == "duplicate_path"
    assert exc.value.message == "prompts/system.md"


def test_check_changes_duplicate_identical_content_still_refused() -> None:
    with pytest.raises(Refused) as exc:
        check_changes([Change("notes.txt", "a"), Change("notes.txt", "a")],
                      paths=PATHS, allowlist=ALLOW)
    assert _reason(exc) == "duplicate_path"


@pytest.mark.parametrize("content", ["\udcff", "ok \ud800 then"])
def test_check_changes_not_utf8(content: str) -> None:
    # lone surrogates (what json.loads yields for "\\ud800") cannot be encoded as UTF-8
    with pytest.raises(Refused) as exc:
        check_changes([Change("notes.txt", content)], paths=PATHS, allowlist=ALLOW)
    assert _reason(exc) == "not_utf8"


def test_lone_surrogate_escape_is_a_malformed_reply() -> None:
    # strict JSON refuses a lone surrogate before any rule sees it
    with pytest.raises(Refused) as exc:
        parse_reply('{"files": [{"path": "notes.txt", "content": "\\ud800"}]}')
    assert _reason(exc) == "malformed_proposal"


def test_check_changes_not_utf8_in_content() -> None:
    with pytest.raises(Refused) as exc:
        check_changes([Change("notes.txt", "\ud800")], paths=PATHS, allowlist=ALLOW)
    assert _reason(exc) == "not_utf8"


def test_check_changes_oversize_default_limit() -> None:
    check_changes([Change("notes.txt", "a" * MAX_FILE_BYTES)], paths=PATHS, allowlist=ALLOW)
    with pytest.raises(Refused) as exc:
        check_changes([Change("notes.txt", "a" * (MAX_FILE_BYTES + 1))],
                      paths=PATHS, allowlist=ALLOW)
    assert _reason(exc) == "oversize_file"
    assert str(MAX_FILE_BYTES) in exc.value.message


def test_check_changes_oversize_counts_utf8_bytes_not_chars() -> None:
    # 4 characters, 8 bytes
    check_changes([Change("notes.txt", "éééé")], paths=PATHS, allowlist=ALLOW, max_bytes=8)
    with pytest.raises(Refused) as exc:
        check_changes([Change("notes.txt", "éééé")], paths=PATHS, allowlist=ALLOW,
                      max_bytes=7)
    assert _reason(exc) == "oversize_file"


def test_refused_carries_reason_and_message() -> None:
    exc = Refused("path_traversal", "../x")
    assert exc.reason == "path_traversal"
    assert exc.message == "../x"
    assert str(exc) == "path_traversal: ../x"


# -- check_tree -------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "prompts").mkdir(parents=True)
    (root / "prompts" / "system.md").write_bytes(b"be helpful\n")
    (root / "notes.txt").write_bytes(b"notes\n")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "target.md").write_bytes(b"target\n")
    return root


def test_check_tree_accepts_matching_base(tree: Path) -> None:
    base = {"prompts/system.md": _sha(b"be helpful\n"), "prompts/new.md": None}
    check_tree([Change("prompts/system.md", "x"), Change("prompts/new.md", "y")], tree, base)


def test_check_tree_symlinked_directory_component(tree: Path) -> None:
    os.symlink("prompts", tree / "link")
    base: dict[str, str | None] = {"link/system.md": _sha(b"be helpful\n")}
    with pytest.raises(Refused) as exc:
        check_tree([Change("link/system.md", "x")], tree, base)
    assert _reason(exc) == "symlink_in_path"
    assert "at link" in exc.value.message


def test_check_tree_symlinked_directory_pointing_outside(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, tree / "escape")
    with pytest.raises(Refused) as exc:
        check_tree([Change("escape/new.md", "x")], tree, {"escape/new.md": None})
    assert _reason(exc) == "symlink_in_path"
    assert not (outside / "new.md").exists()


def test_check_tree_symlinked_final_file(tree: Path) -> None:
    os.symlink("../elsewhere/target.md", tree / "prompts" / "alias.md")
    base: dict[str, str | None] = {"prompts/alias.md": _sha(b"target\n")}
    with pytest.raises(Refused) as exc:
        check_tree([Change("prompts/alias.md", "x")], tree, base)
    assert _reason(exc) == "symlink_in_path"
    assert "prompts/alias.md" in exc.value.message


def test_check_tree_dangling_symlink_final_file(tree: Path) -> None:
    os.symlink("/nonexistent/target", tree / "prompts" / "dangling.md")
    with pytest.raises(Refused) as exc:
        check_tree([Change("prompts/dangling.md", "x")], tree, {"prompts/dangling.md": None})
    assert _reason(exc) == "symlink_in_path"


def test_check_tree_symlink_checked_before_hash(tree: Path) -> None:
    # a wrong hash and a symlink: the symlink is named
    os.symlink("prompts", tree / "link")
    with pytest.raises(Refused) as exc:
        check_tree([Change("link/system.md", "x")], tree, {"link/system.md": "0" * 64})
    assert _reason(exc) == "symlink_in_path"


def test_check_tree_base_hash_mismatch_changed_file(tree: Path) -> None:
    base: dict[str, str | None] = {"prompts/system.md": _sha(b"be helpful\n")}
    (tree / "prompts" / "system.md").write_bytes(b"changed since the proposal\n")
    with pytest.raises(Refused) as exc:
        check_tree([Change("prompts/system.md", "x")], tree, base)
    assert _reason(exc) == "base_hash_mismatch"
    assert _sha(b"changed since the proposal\n") in exc.value.message


def test_check_tree_base_hash_mismatch_new_file_exists(tree: Path) -> None:
    # base says "new file" (null) but the tree already has it
    with pytest.raises(Refused) as exc:
        check_tree([Change("notes.txt", "x")], tree, {"notes.txt": None})
    assert _reason(exc) == "base_hash_mismatch"


def test_check_tree_base_hash_mismatch_file_vanished(tree: Path) -> None:
    (tree / "notes.txt").unlink()
    with pytest.raises(Refused) as exc:
        check_tree([Change("notes.txt", "x")], tree, {"notes.txt": _sha(b"notes\n")})
    assert _reason(exc) == "base_hash_mismatch"


def test_check_tree_base_hash_missing_from_request(tree: Path) -> None:
    with pytest.raises(Refused) as exc:
        check_tree([Change("notes.txt", "x")], tree, {})
    assert _reason(exc) == "base_hash_mismatch"
    assert "no base hash" in exc.value.message


def test_check_tree_checks_every_change(tree: Path) -> None:
    base: dict[str, str | None] = {"prompts/system.md": _sha(b"be helpful\n"),
                                   "notes.txt": "f" * 64}
    with pytest.raises(Refused) as exc:
        check_tree([Change("prompts/system.md", "x"), Change("notes.txt", "y")], tree, base)
    assert _reason(exc) == "base_hash_mismatch"
    assert exc.value.message.startswith("notes.txt")


def test_directory_target_and_path_through_file_are_named_refusals(tmp_path: Path) -> None:
    """Regression: a directory as target, or a file as a parent, used to crash apply."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "README.md").write_text("x")
    with pytest.raises(Refused) as exc:
        check_tree([Change("prompts", "x\n")], tmp_path, {"prompts": None})
    assert exc.value.reason == "not_a_regular_file"
    with pytest.raises(Refused) as exc:
        check_tree([Change("README.md/x", "x")], tmp_path, {"README.md/x": None})
    assert exc.value.reason == "path_through_file"
    with pytest.raises(Refused) as exc:
        check_path(".", paths={"."}, allowlist=["*"])
    assert exc.value.reason == "not_normalized"


def test_the_hosts_copies_of_the_apply_containers_names_agree() -> None:
    """The host rebuilds the container's commit (identity, dates, branch) and accepts
    only the refusal reasons the container names: both are held equal to sandbox's."""
    import inspect
    import re as _re

    import sandbox.apply
    import sandbox.proposal
    from runner.cycle.apply import CANDIDATE_BRANCH, CANDIDATE_GIT_ENV, CONTAINER_REASONS

    assert sandbox.apply.BRANCH == CANDIDATE_BRANCH
    assert {k: sandbox.apply.GIT_ENV[k] for k in CANDIDATE_GIT_ENV} == CANDIDATE_GIT_ENV
    src = inspect.getsource(sandbox.proposal) + inspect.getsource(sandbox.apply)
    assert set(_re.findall(r'Refused\("([a-z0-9_]+)"', src)) | {
        "malformed_proposal", "git_failed"} == CONTAINER_REASONS
    assert '"cyclebox candidate\\n\\n" + str(proposal.get("rationale", ""))[:2000]' in \
        inspect.getsource(sandbox.apply)


@pytest.mark.parametrize(("reason", "want"), [
    ("host_verification_failed", "output_refused"),  # a host reason, claimed by the container
    ("x" * 100_000, "output_refused"),
    ("oversize_file", "oversize_file"),
])
def test_a_container_refusal_keeps_only_a_named_rule_and_a_bounded_message(
        reason: str, want: str) -> None:
    from runner.cycle.apply import MAX_REFUSAL_MESSAGE, read_claim
    from runner.isolation.sandbox import RunRecord, StopReason

    rec = RunRecord(run_id="x", role="apply", image_id="i", container_name="c", exit_code=2,
                    stop_reason=StopReason.PROCESS_FAILED, wall_s=0.1, stdout_bytes=0,
                    stderr_bytes=0, stdout_tail="", stderr_tail="", cleanup_confirmed=True)
    got = read_claim({"status": "refused", "reason": reason,
                      "message": "m\x1b[2J" * 2_000_000}, rec)
    assert got.status == "refused" and got.reason == want  # type: ignore[union-attr]
    assert len(got.message) <= MAX_REFUSAL_MESSAGE + 200  # type: ignore[union-attr]
    assert "\x1b" not in got.message  # type: ignore[union-attr]
