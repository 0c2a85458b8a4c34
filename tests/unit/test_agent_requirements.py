"""The agent's requirement lines: only plain requirements reach the host's pip download,
and the derived image's tag hashes everything it is built from (no Docker)."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.isolation.docker.agent_image import agent_input_hash
from runner.requirements import MAX_REQUIREMENTS_BYTES, check_requirements


def _check(data: bytes) -> str:
    return check_requirements(data, source="requirements.txt", path="cycle.yaml",
                              field="project.requirements")


def test_plain_requirements_are_normalised() -> None:
    text = (b"# the agent's own packages\n\nhumanize==4.12.3  # numbers\n"
            b"tabulate>=0.9,<0.11\nrich[jupyter] ~= 13.0\n  attrs\n")
    assert _check(text) == ("humanize==4.12.3\ntabulate>=0.9,<0.11\nrich[jupyter] ~= 13.0\n"
                            "attrs\n")


@pytest.mark.parametrize("line", [
    "-r /etc/passwd",                        # a host file
    "--index-url https://evil.example/simple",
    "--extra-index-url=https://evil.example/simple",
    "-e git+https://example.com/x.git#egg=x",
    "x @ https://example.com/x-1.0-py3-none-any.whl",
    "./local/path",
    "/abs/x.whl",
    "humanize==4.12.3 --hash=sha256:00",
    "humanize; python_version < '3.12'",     # markers: the image is fixed
    "humanize==4.12.3\x1b[2J",
    "hu manize",
    "humanize===",
])
def test_anything_but_a_plain_requirement_is_refused_naming_the_line(line: str) -> None:
    with pytest.raises(ConfigError, match=r"cycle\.yaml: project\.requirements: "
                                          r"requirements\.txt line 2: .* is not a plain"):
        _check(f"humanize==4.12.3\n{line}\n".encode())


def test_size_encoding_and_emptiness_are_refused() -> None:
    with pytest.raises(ConfigError, match="at most"):
        _check(b"a\n" * (MAX_REQUIREMENTS_BYTES // 2 + 1))
    with pytest.raises(ConfigError, match="not UTF-8"):
        _check(b"humanize\xff\n")
    with pytest.raises(ConfigError, match="lists no requirement"):
        _check(b"# nothing\n\n")


def test_the_derived_tag_covers_each_input() -> None:
    base = agent_input_hash("sha256:a", "humanize==4.12.3\n", "w", b"FROM x\n")
    assert base == agent_input_hash("sha256:a", "humanize==4.12.3\n", "w", b"FROM x\n")
    assert len({base,
                agent_input_hash("sha256:b", "humanize==4.12.3\n", "w", b"FROM x\n"),
                agent_input_hash("sha256:a", "humanize==4.12.2\n", "w", b"FROM x\n"),
                agent_input_hash("sha256:a", "humanize==4.12.3\n", "v", b"FROM x\n"),
                agent_input_hash("sha256:a", "humanize==4.12.3\n", "w", b"FROM y\n")}) == 5


def test_unpinned_lines_are_named() -> None:
    """Issue 20 item 6: a requirement line that pins no single version warns, by line."""
    from runner.requirements import unpinned

    text = _check(b"a==1.0\nb>=2\nc\nd===3\ne==1.*\nf[x]==2,!=3\ng~=1.2\n")
    assert unpinned(text) == ["b>=2", "c", "e==1.*", "g~=1.2"]


def test_pip_reason_has_no_escape_codes() -> None:
    from runner.requirements import pip_reason

    raw = ("\x1b[31mERROR: Cannot install a==1 and b==2\x1b[0m\n\x1b]8;;http://x\x07link"
           "\x1b]8;;\x07\nTo fix this you could try to:\n1. loosen\n")
    got = pip_reason(raw, 500)
    assert got == "ERROR: Cannot install a==1 and b==2 / link", got
    assert "\x1b" not in pip_reason("\x1b[2J\x1bc bare \x1b" * 3, 500)
    assert len(pip_reason("ERROR: x" * 10_000, 300)) <= 303


def test_pip_reason_starts_at_the_error_not_at_the_progress_before_it() -> None:
    """CI, 2026-12-04: the derived image's build tail was 24 ``Processing`` lines and then
    pip's conflict; the 1500-character reason showed only the progress."""
    from runner.requirements import pip_reason

    tail = "\n".join([f"Processing /build/wheels/pkg{i}-1.0-py3-none-any.whl" for i in range(40)]
                     + ["Requirement already satisfied: h11==0.16.0 in /opt/venv (0.16.0)",
                        "\x1b[91mERROR: Cannot install httpcore2==2.16.2 because these package "
                        "versions have conflicting dependencies.\x1b[0m", "",
                        "The conflict is caused by:",
                        "    The user requested httpcore2==2.16.2",
                        "    The user requested (constraint) httpcore2==2.17.0", "",
                        "To fix this you could try to:", "1. loosen the range"])
    got = pip_reason(tail, 300)
    assert got.startswith("ERROR: Cannot install httpcore2==2.16.2"), got
    assert "(constraint) httpcore2==2.17.0" in got, got
    assert "Processing" not in got and "already satisfied" not in got
