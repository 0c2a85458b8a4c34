"""Reports of the demo run end to end: `cycle run` with every output flag, the HTML in
headless Chromium (screenshot, DOM, a hostile answer that must not run), JUnit read by
junitparser, and `cyclebox report` on a past run.

Chromium comes from `make chromium`; without it these tests fail, never skip.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from junitparser import JUnitXml

from runner.paths import PROJECT_ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
EXAMPLE = PROJECT_ROOT / "examples" / "shop-analyst"
CLI = str(Path(sys.executable).with_name("cyclebox"))
SCRIPT = "<script>document.title='pwned'</script>"
IMG = "<img src=x onerror=\"document.body.id='pwned'\">"


def cyclebox(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    assert exe, "chromium is missing: run `make chromium` (Debian package chromium)"
    return subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'chromium-profile'}",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--no-proxy-server",
         "--virtual-time-budget=3000", *args],
        capture_output=True, text=True, timeout=120, check=False)


def png_colours(data: bytes, step: int = 7) -> int:
    """Distinct RGB colours sampled from an 8-bit RGB/RGBA PNG (stdlib decode)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = depth = ctype = 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert depth == 8 and ctype in (2, 6), (depth, ctype)
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours = set()
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 255
        if y % step == 0:
            colours.update(bytes(line[x * bpp:x * bpp + 3]) for x in range(0, width, step))
        prev = line
    return len(colours)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("report")
    run = base / "run"
    res = cyclebox("cycle", "run", str(EXAMPLE / "cycle.yaml"), "--out", str(run), "--json",
                   "--junit", str(base / "junit.xml"), "--markdown", str(base / "summary.md"),
                   "--html", str(base / "report.html"))
    assert res.returncode == 0, res.stdout + res.stderr
    return {"base": base, "run": run, "json": json.loads(res.stdout), "stderr": res.stderr}


def test_cycle_run_json_carries_the_report_and_progress_shows_on_stderr(
        demo: dict[str, Any]) -> None:
    rep = demo["json"]["report"]
    assert rep["verdict"] == demo["json"]["verdict"] == "accept_for_review"
    assert rep["schema"] == 1 and rep["receipt_sha256"]
    rates = {(p["arm"], p["split"]): (p["passed"], p["rows"]) for p in rep["pass_rates"]}
    assert rates[("candidate", "acceptance")] == (7, 8)
    assert rates[("baseline", "acceptance")] == (4, 8)
    lines = [ln for ln in demo["stderr"].splitlines() if ln.startswith("cyclebox [")]
    assert any(ln.endswith("baseline: started") for ln in lines), demo["stderr"]
    assert any(re.search(r"candidate: (\d+)/\1 cases$", ln) for ln in lines), demo["stderr"]


def test_markdown_summary(demo: dict[str, Any]) -> None:
    text = (demo["base"] / "summary.md").read_text()
    print(text)  # the lead pastes it into the issue (pytest -s)
    assert "`accept_for_review`" in text and "scripted fixtures" in text
    assert "| candidate | acceptance | 7 | 8 | 0 | 87.5% |" in text


def test_junit_counts_by_junitparser(demo: dict[str, Any]) -> None:
    suites = {s.name: s for s in JUnitXml.fromfile(str(demo["base"] / "junit.xml"))}
    assert set(suites) == {"baseline", "candidate"}
    assert (suites["baseline"].tests, suites["baseline"].failures) == (14, 6)
    assert (suites["candidate"].tests, suites["candidate"].failures) == (14, 1)
    failed = [c for c in suites["candidate"] if c.result]
    assert [c.result[0].message for c in failed] == ["failed: correctness"]


def test_html_renders_in_headless_chromium(demo: dict[str, Any], tmp_path: Path) -> None:
    page = demo["base"] / "report.html"
    shot = tmp_path / "report.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri(),
                   tmp=tmp_path)
    assert shot.is_file(), res.stderr
    shutil.copy(shot, PROJECT_ROOT / "build" / "report-screenshot.png")
    assert png_colours(shot.read_bytes()) >= 8  # a blank or single-colour page fails
    dom = chromium("--dump-dom", page.as_uri(), tmp=tmp_path).stdout
    assert '<div class="banner accept_for_review" id="verdict">accept_for_review</div>' in dom
    ids = {c["case_id"] for c in demo["json"]["report"]["cases"]}
    assert len(ids) == 14 and all(f"<code>{i}</code>" in dom for i in ids)
    # links to each case's logs are relative and resolve inside the run directory
    hrefs = re.findall(r'href="([^"]+)"', dom)
    assert hrefs and all(h.startswith("./") for h in hrefs)
    assert all((page.parent / h).resolve().is_file() for h in hrefs)


def test_hostile_answer_is_text_and_never_runs(demo: dict[str, Any], tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(demo["run"], copy, symlinks=True)
    recs = copy / "stages/candidate/records.jsonl"
    rows = [json.loads(ln) for ln in recs.read_text().splitlines()]
    rows[0]["answer"]["answer"] = SCRIPT + IMG
    rows[1]["status"], rows[1]["reason"] = "infra_invalid", IMG + SCRIPT
    recs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "hostile.html"
    res = cyclebox("report", str(copy), "--html", str(page))
    assert res.returncode == 0, res.stdout + res.stderr
    dom = chromium("--dump-dom", page.as_uri(), tmp=tmp_path).stdout
    assert "<title>cyclebox shop-analyst: accept_for_review</title>" in dom
    assert "pwned</title>" not in dom and 'id="pwned"' not in dom
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom

    # Control: the same payload unescaped and without the CSP does run in this Chromium,
    # so the assertions above would catch an escaping bug.
    control = tmp_path / "control.html"
    control.write_text(f"<!DOCTYPE html><html><head><title>t</title></head><body>{SCRIPT}"
                       f"{IMG}</body></html>")
    dom = chromium("--dump-dom", control.as_uri(), tmp=tmp_path).stdout
    assert "<title>pwned</title>" in dom and 'id="pwned"' in dom


def test_report_command_on_a_past_run(demo: dict[str, Any]) -> None:
    res = cyclebox("report", str(demo["run"]), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["receipt_sha256"] == demo["json"]["report"]["receipt_sha256"]
    res = cyclebox("report", str(demo["run"]))
    assert res.returncode == 0 and "accept_for_review" in res.stdout
    assert cyclebox("receipt", "verify", str(demo["run"])).returncode == 0
