"""Keys, keyids, the write-once bundle writer and the step summary, without Docker.

Third-party acceptance (securesystemslib, in-toto-attestation) is tests/e2e/test_attest.py;
here: the keyid formula, DER ECDSA signatures, old Ed25519 receipt envelopes (16-digit
keyid) still verifying, and the writer leaving nothing behind on Ctrl-C or a race.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from runner import outdir as outdir_mod
from runner.attest.bundle import Attested
from runner.attest.statement import ResourceDescriptor, Statement
from runner.attest.summary import summary_markdown
from runner.cycle import keys
from runner.cycle.receipt import _unbound
from runner.cycle.signing import ENVELOPE, PAYLOAD_TYPE, pae, sign, verify_signature
from runner.errors import ConfigError, IntegrityError
from runner.hashing import sha256_bytes, sha256_json


def test_ed25519_keyid_is_securesystemslibs_default(tmp_path: Path) -> None:
    pub = keys.load_public(keys.keygen(tmp_path / "k"))
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    canonical = '{"keytype":"ed25519","keyval":{"public":"' + raw + '"},"scheme":"ed25519"}'
    assert keys.keyid(pub) == hashlib.sha256(canonical.encode()).hexdigest()
    d = json.loads((tmp_path / "k.pub.json").read_text())
    assert d == {"keyid": keys.keyid(pub), "keytype": "ed25519", "scheme": "ed25519",
                 "keyval": {"public": raw}}


def test_p256_keyid_hashes_the_pem_with_raw_newlines(tmp_path: Path) -> None:
    # OLPC canonical JSON escapes only quote and backslash: the PEM's newlines stay bytes
    pub = keys.load_public(keys.keygen(tmp_path / "k", "ecdsa-p256"))
    pem = (tmp_path / "k.pub").read_text()
    canonical = ('{"keytype":"ecdsa","keyval":{"public":"' + pem
                 + '"},"scheme":"ecdsa-sha2-nistp256"}')
    assert "\n" in canonical
    assert keys.keyid(pub) == hashlib.sha256(canonical.encode()).hexdigest()
    assert oct(os.stat(tmp_path / "k").st_mode & 0o777) == "0o600"


def test_p256_signatures_are_der_and_verify(tmp_path: Path) -> None:
    keys.keygen(tmp_path / "k", "ecdsa-p256")
    key = keys.load_private(tmp_path / "k")
    sig = keys.sign_bytes(key, b"data")
    r, s = decode_dss_signature(sig)  # raises unless ASN.1 DER
    assert r > 0 and s > 0
    assert keys.verify_bytes(key.public_key(), sig, b"data")
    assert not keys.verify_bytes(key.public_key(), sig, b"other")


def test_an_old_receipt_envelope_with_the_16_digit_keyid_still_verifies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "receipt.json").write_bytes(b'{"plan_hash":"abc","schema":1}')
    key = Ed25519PrivateKey.generate()
    (tmp_path / "k.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    payload = (run / "receipt.json").read_bytes()
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    old = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
           "signatures": [{"keyid": hashlib.sha256(raw).hexdigest()[:16],
                           "sig": base64.b64encode(key.sign(pae(PAYLOAD_TYPE, payload)))
                           .decode()}]}
    (run / ENVELOPE).write_text(json.dumps(old))
    verify_signature(run, keys.load_public(tmp_path / "k.pub"))
    old["signatures"][0]["keyid"] = "0" * 16
    (run / ENVELOPE).write_text(json.dumps(old))
    with pytest.raises(IntegrityError, match="no signature by key"):
        verify_signature(run, keys.load_public(tmp_path / "k.pub"))


def test_receipt_sign_and_verify_with_a_p256_key(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    plan = json.dumps({"plan": {"n": 1}, "plan_hash": sha256_json({"n": 1})})
    (run / "plan.json").write_text(plan)
    (run / "receipt.json").write_text(json.dumps(
        {"schema": 1, "plan_hash": sha256_json({"n": 1}), "external": {},
         "files": {"plan.json": sha256_bytes(plan.encode())}}))
    pub = keys.load_public(keys.keygen(tmp_path / "k", "ecdsa-p256"))
    sign(run, tmp_path / "k")
    verify_signature(run, pub)
    other = keys.load_public(keys.keygen(tmp_path / "o", "ecdsa-p256"))
    with pytest.raises(IntegrityError):
        verify_signature(run, other)


def test_a_p384_key_is_refused_by_name(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    k = ec.generate_private_key(ec.SECP384R1())
    (tmp_path / "k").write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                                 serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    with pytest.raises(ConfigError, match="not an Ed25519 or ECDSA P-256"):
        keys.load_private(tmp_path / "k")


def test_bundles_at_the_top_level_are_unbound_nested_ones_are_not() -> None:
    assert _unbound("receipt.intoto.jsonl") and _unbound("ecdsa.intoto.jsonl")
    assert not _unbound("stages/x/out/receipt.intoto.jsonl")
    assert not _unbound("receipt.intoto.jsonl.tmp")


def _write_once(path: Path, data: bytes) -> None:
    outdir_mod.write_once(path, data, what="an attestation bundle", field="--out", fix="x")


def test_write_once_never_replaces_a_bundle_that_appeared(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "b.intoto.jsonl"
    real_link = os.link

    def racing_link(src: str | Path, dst: str | Path) -> None:
        Path(dst).write_bytes(b"theirs\n")  # another writer won the name meanwhile
        real_link(src, dst)

    monkeypatch.setattr(outdir_mod.os, "link", racing_link)
    with pytest.raises(ConfigError, match="never overwritten"):
        _write_once(target, b"ours\n")
    assert target.read_bytes() == b"theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.intoto.jsonl"]


def test_ctrl_c_while_writing_leaves_nothing(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(outdir_mod.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _write_once(tmp_path / "b.intoto.jsonl", b"x" * 100_000)
    assert list(tmp_path.iterdir()) == []


def test_summary_markdown_escapes_what_the_run_named(tmp_path: Path) -> None:
    st = Statement(subject=(ResourceDescriptor(name="a|b<script>x</script>`](http://e)",
                                               digest={"sha256": "ab" * 32}),),
                   predicateType="https://cyclebox.dev/attestations/evaluation/v1",
                   predicate={"x": 1})
    text = summary_markdown(Attested(path=tmp_path / "b.intoto.jsonl", keyid="k",
                                     keytype="ed25519", statements=(st,)))
    row = text.splitlines()[-1]
    assert "<script>" not in row and "http://" not in row
    assert row.count("|") - row.count("\\|") == 4  # three cells, the name's pipe escaped
    assert f"sha256&#58;{'ab' * 32}" in row


def test_the_published_schema_names_exactly_the_predicate_models_fields() -> None:
    """A field added to the model but not to docs/attestations/evaluation-v1.schema.json
    (or the reverse) fails here, before any run: the schema is the contract."""
    from pydantic import BaseModel

    from runner.attest.evaluation import EvaluationPredicate
    from runner.paths import PROJECT_ROOT

    schema = json.loads((PROJECT_ROOT / "docs/attestations/evaluation-v1.schema.json")
                        .read_text())

    def fields(model: type[BaseModel], node: dict[str, object], where: str) -> None:
        props = node["properties"]
        assert isinstance(props, dict)
        assert set(props) == set(model.model_fields) == set(node["required"]), where  # type: ignore[arg-type]
        assert node["additionalProperties"] is False, where
        for name, f in model.model_fields.items():
            sub = f.annotation
            args = getattr(sub, "__args__", ())
            inner = next((a for a in (sub, *args) if isinstance(a, type)
                          and issubclass(a, BaseModel)), None)
            if inner is None:
                continue
            child = props[name]
            child = child.get("items", child) if isinstance(child, dict) else child
            assert isinstance(child, dict)
            fields(inner, child, f"{where}.{name}")

    fields(EvaluationPredicate, schema, "predicate")


@pytest.mark.parametrize(("timing", "generated_at", "field"), [
    pytest.param({"x": 1e15}, "2026-01-01T00:00:00+00:00", "timing", id="1e15-seconds"),
    pytest.param({"a": 1.7e308, "b": 1.7e308}, "2026-01-01T00:00:00+00:00", "timing",
                 id="sum-is-infinite"),
    pytest.param({"x": 46.0}, "0001-01-01T00:00:00+00:00", "generated_at", id="year-1"),
])
def test_provenance_times_that_cannot_be_dated_are_named(
        timing: dict[str, float], generated_at: str, field: str) -> None:
    """A receipt that verifies (timing and generated_at are not bound by a file) made
    attest exit 10 with an OverflowError; now exit 3 naming the field."""
    from types import SimpleNamespace

    from runner.attest.provenance import _times
    from runner.errors import ConfigError

    f = SimpleNamespace(receipt=SimpleNamespace(timing=timing, generated_at=generated_at),
                        run_dir=Path("/run"))
    with pytest.raises(ConfigError, match=rf"{field}: "):
        _times(f)  # type: ignore[arg-type]
