"""Signed receipts: DSSE envelope round trip, tampering and wrong keys caught."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from runner.cycle.signing import ENVELOPE, keygen, load_public, pae, sign, verify_signature
from runner.errors import ConfigError, IntegrityError


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "receipt.json").write_bytes(b'{"plan_hash":"abc","schema":1}')
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
    (run_dir / "receipt.json").write_bytes(original.replace(b"abc", b"abd"))
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
