"""Signed receipts: DSSE envelope round trip, tampering and wrong keys caught."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from runner.cycle.signing import ENVELOPE, keygen, load_public, pae, sign, verify_signature
from runner.errors import ConfigError, IntegrityError
from runner.hashing import sha256_bytes, sha256_json


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory that verifies: its plan, and a receipt naming it."""
    d = tmp_path / "run"
    d.mkdir()
    plan = json.dumps({"plan": {"name": "t"}, "plan_hash": sha256_json({"name": "t"})})
    (d / "plan.json").write_text(plan)
    (d / "receipt.json").write_text(json.dumps(
        {"schema": 1, "plan_hash": sha256_json({"name": "t"}), "external": {},
         "files": {"plan.json": sha256_bytes(plan.encode())}}, sort_keys=True))
    return d


def test_pae_matches_the_dsse_spec() -> None:
    assert pae("t", b"hello") == b"DSSEv1 1 t 5 hello"


def test_sign_and_verify(run_dir: Path, tmp_path: Path) -> None:
    pub = keygen(tmp_path / "k")
    assert oct(os.stat(tmp_path / "k").st_mode & 0o777) == "0o600"
    sign(run_dir, tmp_path / "k")
    verify_signature(run_dir, load_public(pub))
    env = json.loads((run_dir / ENVELOPE).read_text())
    assert base64.b64decode(env["payload"]) == (run_dir / "receipt.json").read_bytes()
    with pytest.raises(ConfigError, match="never overwritten"):
        keygen(tmp_path / "k")
    with pytest.raises(ConfigError, match="signed once"):
        sign(run_dir, tmp_path / "k")


def test_tampered_receipt_or_envelope_fails(run_dir: Path, tmp_path: Path) -> None:
    pub = load_public(keygen(tmp_path / "k"))
    sign(run_dir, tmp_path / "k")
    original = (run_dir / "receipt.json").read_bytes()
    (run_dir / "receipt.json").write_bytes(original.replace(b'"schema": 1', b'"schema":1'))
    with pytest.raises(IntegrityError, match=r"differs from receipt\.json"):
        verify_signature(run_dir, pub)
    # rewrite both payload and receipt consistently: the signature still catches it
    env = json.loads((run_dir / ENVELOPE).read_text())
    env["payload"] = base64.b64encode((run_dir / "receipt.json").read_bytes()).decode()
    (run_dir / ENVELOPE).write_text(json.dumps(env))
    with pytest.raises(IntegrityError, match="does not verify"):
        verify_signature(run_dir, pub)


def test_other_key_is_refused(run_dir: Path, tmp_path: Path) -> None:
    keygen(tmp_path / "a")
    other = load_public(keygen(tmp_path / "b"))
    sign(run_dir, tmp_path / "a")
    with pytest.raises(IntegrityError, match="no signature by key"):
        verify_signature(run_dir, other)


def test_unsigned_run_fails_when_a_key_is_required(run_dir: Path, tmp_path: Path) -> None:
    pub = load_public(keygen(tmp_path / "k"))
    with pytest.raises(IntegrityError, match="missing or unreadable"):
        verify_signature(run_dir, pub)


@pytest.mark.parametrize("case", ["receipt-link", "envelope-link", "edited-run"])
def test_sign_refuses_a_link_or_a_run_that_does_not_verify(run_dir: Path, tmp_path: Path,
                                                           case: str) -> None:
    """helper-39 F2: ``sign`` read a receipt.json that was a link to a host file (and put
    it, signed, in the envelope), and wrote the envelope through a dangling link out of
    the run. Now only a run that verifies is signed, read and written with no link
    followed."""
    keygen(tmp_path / "k")
    secret = tmp_path / "secret.txt"
    secret.write_text("AWS_SECRET=hunter2\n")
    planted = tmp_path / "elsewhere" / "planted.json"
    if case == "receipt-link":
        (run_dir / "receipt.json").unlink()
        (run_dir / "receipt.json").symlink_to(secret)
        want = "receipt.json"
    elif case == "envelope-link":
        planted.parent.mkdir()
        (run_dir / ENVELOPE).symlink_to(planted)
        want = "signed once"
    else:
        (run_dir / "plan.json").write_text("{}")
        want = "run_altered"
    with pytest.raises((ConfigError, IntegrityError), match=want):
        sign(run_dir, tmp_path / "k")
    assert not planted.exists()
    assert (run_dir / ENVELOPE).is_symlink() or not (run_dir / ENVELOPE).exists()


def test_the_bytes_verified_are_the_bytes_signed(run_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-42 #6: sign verified the run, then read receipt.json again; a receipt
    swapped in between was signed unverified."""
    import runner.cycle.receipt as receipt_mod

    keygen(tmp_path / "k")
    original = (run_dir / "receipt.json").read_bytes()
    real_verify = receipt_mod.verify

    def verify_then_swap(*a: object, **k: object) -> list[str]:
        problems = real_verify(*a, **k)  # type: ignore[arg-type]
        (run_dir / "receipt.json").write_bytes(original.replace(b"plan.json", b"plan.jsoN"))
        return problems

    monkeypatch.setattr(receipt_mod, "verify", verify_then_swap)
    sign(run_dir, tmp_path / "k")
    env = json.loads((run_dir / ENVELOPE).read_text())
    assert base64.b64decode(env["payload"]) == original
