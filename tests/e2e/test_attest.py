"""`cyclebox receipt attest` on the session's real demo run, checked by other people's tools.

The verifier (tests/e2e/attest_verifier.py) runs in build/attest-venv (`make attest-env`:
securesystemslib, in-toto-attestation, jsonschema from PyPI), where cyclebox is not
installed and which imports nothing of it. Positive: both key types verify. Negative:
a tampered subject, a swapped predicate and a wrong key each fail there, for their own
reason. Around it: an unverified run is refused (8) with nothing written, a bundle is
never overwritten, and a read-only or full destination leaves nothing half-written.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.paths import PROJECT_ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow]
CLI = str(Path(sys.executable).with_name("cyclebox"))
VENV_PY = PROJECT_ROOT / "build" / "attest-venv" / "bin" / "python"
VERIFIER = Path(__file__).with_name("attest_verifier.py")
SCHEMA = PROJECT_ROOT / "docs" / "attestations" / "evaluation-v1.schema.json"
EVALUATION = "https://cyclebox.dev/attestations/evaluation/v1"


def cyclebox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "COLUMNS": "300"})


def third_party(bundle: Path, key: Path, run: Path) -> subprocess.CompletedProcess[str]:
    """The verifier in the third-party venv: isolated mode, run from an empty directory,
    so nothing of this checkout can be imported by accident."""
    if not VENV_PY.exists():
        pytest.fail(f"{VENV_PY} missing: run `make attest-env` (make test does)")
    cwd = run.parent / "verifier-cwd"
    cwd.mkdir(exist_ok=True)
    return subprocess.run([str(VENV_PY), "-I", str(VERIFIER), str(bundle), "--key-dict",
                           f"{key}.pub.json", "--pem", f"{key}.pub", "--run", str(run),
                           "--schema", str(SCHEMA)], capture_output=True, text=True,
                          timeout=120, check=False, cwd=cwd, env={"PATH": os.environ["PATH"]})


def lines(bundle: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in bundle.read_text().splitlines()]


def decoded(env: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(base64.b64decode(env["payload"]))
    return doc


@pytest.fixture(scope="module")
def attested(shop_demo: tuple[Path, dict[str, Any]],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the demo run attested with an Ed25519 and an ECDSA P-256 key."""
    base = tmp_path_factory.mktemp("attest")
    run = base / "run"
    shutil.copytree(shop_demo[0], run, symlinks=True)
    assert cyclebox("receipt", "verify", str(run)).returncode == 0  # positive control
    out = {"run": run}
    for kind in ("ed25519", "ecdsa-p256"):
        key = base / kind
        res = cyclebox("receipt", "keygen", "--out", str(key), "--type", kind)
        assert res.returncode == 0, res.stderr
        bundle = run / f"{kind}.intoto.jsonl"
        res = cyclebox("receipt", "attest", str(run), "--key", str(key), "--out", str(bundle),
                       "--markdown", str(base / f"{kind}.md"))
        assert res.returncode == 0, res.stdout + res.stderr
        out[kind], out[f"{kind}-key"], out[f"{kind}-md"] = bundle, key, base / f"{kind}.md"
    return out


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa-p256"])
def test_securesystemslib_and_in_toto_attestation_accept_the_bundle(
        attested: dict[str, Path], kind: str) -> None:
    res = third_party(attested[kind], attested[f"{kind}-key"], attested["run"])
    print(res.stdout)  # the decoded Statements, for the report (pytest -s)
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads(res.stdout)
    assert got["scheme"] == {"ed25519": "ed25519", "ecdsa-p256": "ecdsa-sha2-nistp256"}[kind]
    types = {s["predicateType"]: s for s in got["statements"]}
    assert set(types) == {EVALUATION, "https://slsa.dev/provenance/v1"}
    names = [s["name"] for s in types[EVALUATION]["subject"]]
    assert names == ["stages/apply/candidate.patch", "candidate-tree", "receipt.json"]
    # the receipt still verifies with the bundles beside it
    assert cyclebox("receipt", "verify", str(attested["run"])).returncode == 0


Attempt = tuple[Path, Path, Path, str]
"""(bundle, key, run directory, what the verifier's FAIL line must say)."""


def _attack(kind: str, attested: dict[str, Path], tmp: Path) -> list[Attempt]:
    """Each variant of one attack, as a verifier input."""
    run, bundle, key = attested["run"], attested["ed25519"], attested["ed25519-key"]
    envs = lines(bundle)

    def write(name: str, rows: list[dict[str, Any]]) -> Path:
        p = tmp / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return p

    def reencoded(doc: dict[str, Any]) -> dict[str, Any]:
        return {**envs[0], "payload": base64.b64encode(json.dumps(doc).encode()).decode()}

    bad_sig = "DSSE signature does not verify"
    if kind == "tampered-subject":
        # the Statement re-encoded naming another patch digest, signature kept ...
        ev = decoded(envs[0])
        ev["subject"][0]["digest"]["sha256"] = "0" * 64
        # ... and the signed subject no longer matching a patch changed on disk
        copy = tmp / "run"
        shutil.copytree(run, copy, symlinks=True)
        patch = copy / "stages/apply/candidate.patch"
        patch.write_bytes(patch.read_bytes() + b"\n")
        return [(write("subject.jsonl", [reencoded(ev), envs[1]]), key, run, bad_sig),
                (bundle, key, copy, "stages/apply/candidate.patch: sha256 differs")]
    if kind == "swapped-predicate":
        # the provenance payload under the evaluation signature, and a flipped verdict
        ev = decoded(envs[0])
        ev["predicate"]["verdict"] = "reject"
        swapped = {**envs[0], "payload": envs[1]["payload"]}
        return [(write("swapped.jsonl", [swapped, envs[1]]), key, run, bad_sig),
                (write("flipped.jsonl", [reencoded(ev), envs[1]]), key, run, bad_sig)]
    # wrong key: the P-256 key, and that key's dict claiming the Ed25519 keyid
    other = attested["ecdsa-p256-key"]
    claimed = json.loads(Path(f"{other}.pub.json").read_text())
    claimed["keyid"] = json.loads(Path(f"{key}.pub.json").read_text())["keyid"]
    liar = tmp / "liar"
    Path(f"{liar}.pub.json").write_text(json.dumps(claimed))
    shutil.copy(f"{other}.pub", f"{liar}.pub")
    return [(bundle, other, run, bad_sig),
            (bundle, liar, run, "is not securesystemslib's keyid")]


@pytest.mark.parametrize("kind", ["tampered-subject", "swapped-predicate", "wrong-key"])
def test_the_attack_fails_in_the_third_party_verifier(attested: dict[str, Path],
                                                     tmp_path: Path, kind: str) -> None:
    for bundle, key, run, why in _attack(kind, attested, tmp_path):
        res = third_party(bundle, key, run)
        print(f"{kind}: exit {res.returncode}: {res.stdout.strip()[:300]}")  # for the report
        assert res.returncode == 1, res.stdout + res.stderr
        assert res.stdout.startswith("FAIL: ") and why in res.stdout, res.stdout
    # positive control: the untouched bundle still verifies
    assert third_party(attested["ed25519"], attested["ed25519-key"],
                       attested["run"]).returncode == 0


def test_the_evaluation_predicate_validates_against_its_published_schema(
        attested: dict[str, Path], tmp_path: Path) -> None:
    statement = decoded(lines(attested["ecdsa-p256"])[0])
    assert statement["predicateType"] == EVALUATION
    good = tmp_path / "predicate.json"
    good.write_text(json.dumps(statement["predicate"]))
    broken = dict(statement["predicate"], verdict="maybe")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(broken))
    script = ("import json,sys,jsonschema\n"
              "schema=json.load(open(sys.argv[1]))\n"
              "jsonschema.Draft202012Validator.check_schema(schema)\n"
              "for p in sys.argv[2:]:\n"
              "    errs=list(jsonschema.Draft202012Validator(schema).iter_errors("
              "json.load(open(p))))\n"
              "    print(p.rsplit('/',1)[-1], len(errs))\n")
    res = subprocess.run([str(VENV_PY), "-I", "-c", script, str(SCHEMA), str(good), str(bad)],
                         capture_output=True, text=True, check=False, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["predicate.json 0", "bad.json 1"], res.stdout


def test_step_summary_shows_every_subject_digest(attested: dict[str, Path]) -> None:
    text = attested["ecdsa-p256-md"].read_text()
    for st in map(decoded, lines(attested["ecdsa-p256"])):
        for s in st["subject"]:
            for algo, value in s["digest"].items():
                assert f"{algo}&#58;{value}" in text


def test_json_output_names_the_bundle_and_every_subject(attested: dict[str, Path]) -> None:
    bundle = attested["run"] / "json.intoto.jsonl"
    res = cyclebox("receipt", "attest", str(attested["run"]), "--key",
                   str(attested["ed25519-key"]), "--out", str(bundle), "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["bundle"] == str(bundle) and got["scheme"] == "ed25519"
    key_dict = json.loads(Path(f"{attested['ed25519-key']}.pub.json").read_text())
    assert got["keyid"] == key_dict["keyid"]
    assert [s["subject"] for s in got["statements"]] == [
        decoded(e)["subject"] for e in lines(bundle)]


def test_unverified_run_is_refused_with_8_and_nothing_written(attested: dict[str, Path],
                                                              tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(attested["run"], copy, symlinks=True)
    (copy / "stages/compare/verdict.json").write_text('{"verdict": "accept_for_review"}')
    before = sorted(p.name for p in copy.iterdir())
    res = cyclebox("receipt", "attest", str(copy), "--key", str(attested["ed25519-key"]),
                   "--out", str(copy / "x.intoto.jsonl"))
    assert res.returncode == 8, res.stdout + res.stderr
    assert "receipt does not verify" in res.stderr and "verdict.json" in res.stderr
    assert sorted(p.name for p in copy.iterdir()) == before


def test_an_existing_bundle_is_never_overwritten(attested: dict[str, Path]) -> None:
    bundle = attested["ed25519"]
    data = bundle.read_bytes()
    res = cyclebox("receipt", "attest", str(attested["run"]), "--key",
                   str(attested["ecdsa-p256-key"]), "--out", str(bundle))
    assert res.returncode == 3 and "never overwritten" in res.stderr, res.stderr
    assert bundle.read_bytes() == data


def test_a_stray_name_inside_the_run_is_refused(attested: dict[str, Path]) -> None:
    res = cyclebox("receipt", "attest", str(attested["run"]), "--key",
                   str(attested["ed25519-key"]), "--out", str(attested["run"] / "a.json"))
    assert res.returncode == 3 and ".intoto.jsonl" in res.stderr, res.stderr
    assert not (attested["run"] / "a.json").exists()


@pytest.fixture
def mount(tmp_path: Path) -> Any:
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root")
    made: list[Path] = []

    def do(name: str, opts: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], check=True)
        made.append(mnt)
        return mnt

    yield do
    for m in made:
        subprocess.run(["umount", "-l", str(m)], check=False)


def test_read_only_destination_is_a_clear_error_and_leaves_nothing(
        attested: dict[str, Path], mount: Any) -> None:
    ro = mount("ro", "ro,size=1m")
    res = cyclebox("receipt", "attest", str(attested["run"]), "--key",
                   str(attested["ed25519-key"]), "--out", str(ro / "b.intoto.jsonl"))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "Read-only file system" in res.stderr and "--out" in res.stderr, res.stderr
    assert os.listdir(ro) == []


def test_full_disk_is_an_environment_failure_and_leaves_nothing(
        attested: dict[str, Path], mount: Any) -> None:
    full = mount("full", "size=4k")
    res = cyclebox("receipt", "attest", str(attested["run"]), "--key",
                   str(attested["ed25519-key"]), "--out", str(full / "b.intoto.jsonl"))
    assert res.returncode == 9, res.stdout + res.stderr
    assert "No space left on device" in res.stderr, res.stderr
    assert os.listdir(full) == []


def test_frozen_agent_artifacts_become_resolved_dependencies(attested: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """A plan that froze inputs/agent-artifacts.json (runner/cycle/artifacts.py) lists each
    artefact with a package URL; the SLSA predicate still parses strictly there."""
    from runner.attest.bundle import statements

    copy = tmp_path / "run"
    shutil.copytree(attested["run"], copy, symlinks=True)
    whl = {"ecosystem": "pypi", "name": "tabulate", "version": "0.9.0",
           "filename": "tabulate-0.9.0-py3-none-any.whl", "sha256": "ab" * 32}
    deb = {"ecosystem": "deb", "name": "jq", "version": "1.6-2.1", "filename":
           "jq_1.6-2.1_amd64.deb", "sha256": "cd" * 32}
    (copy / "inputs" / "agent-artifacts.json").write_text(
        json.dumps({"schema": 1, "artifacts": [whl, deb]}))
    doc = json.loads((copy / "plan.json").read_text())
    doc["plan"]["inputs"]["agent-artifacts.json"] = "00" * 32  # read, not re-hashed, here
    (copy / "plan.json").write_text(json.dumps(doc))
    prov = next(s for s in statements(copy) if s.predicateType.startswith("https://slsa"))
    deps = prov.predicate["buildDefinition"]["resolvedDependencies"]
    assert {"name": whl["filename"], "uri": "pkg:pypi/tabulate@0.9.0",
            "digest": {"sha256": whl["sha256"]},
            "annotations": {"kind": "pypi-artifact"}} in deps
    assert any(d.get("uri") == "pkg:deb/debian/jq@1.6-2.1" for d in deps)
    script = ("import json,sys\nimport google.protobuf.json_format as j\n"
              "from in_toto_attestation.predicates.provenance.v1 import provenance_pb2 as p\n"
              "j.ParseDict(json.load(open(sys.argv[1])), p.Provenance())\n")
    pred = tmp_path / "prov.json"
    pred.write_text(json.dumps(prov.predicate))
    res = subprocess.run([str(VENV_PY), "-I", "-c", script, str(pred)], capture_output=True,
                         text=True, check=False, timeout=60)
    assert res.returncode == 0, res.stderr
