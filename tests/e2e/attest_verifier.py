"""A third party verifying a cyclebox attestation bundle with other people's tools.

Runs in build/attest-venv (`make attest-env`), where cyclebox is NOT installed, and imports
nothing of it: securesystemslib checks each DSSE envelope against the public key (from its
securesystemslib key dict and from its PEM, whose default keyids must agree), in-toto-
attestation's protobuf bindings parse and validate each Statement (and the SLSA provenance
v1 predicate, strictly: an unknown field fails), every subject digest is recomputed from
the run directory (sha256 of files; the candidate tree from its commit object, read
without git: git obeys a directory's own config), and the evaluation
predicate is validated with jsonschema against the schema cyclebox publishes.

usage: attest_verifier.py BUNDLE --key-dict KEY.pub.json --pem KEY.pub --run RUN
                          --schema docs/attestations/evaluation-v1.schema.json

Prints one JSON object (the decoded Statements' subjects, types and predicate keys) and
exits 0 when everything holds; prints ``FAIL: why`` and exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zlib
from pathlib import Path

import google.protobuf.json_format as pb_json
import jsonschema
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.statement import Statement
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError
from securesystemslib.signer import SSlibKey

IN_TOTO = "application/vnd.in-toto+json"
EVALUATION = "https://cyclebox.dev/attestations/evaluation/v1"
SLSA = "https://slsa.dev/provenance/v1"


class Fail(Exception):
    pass


def load_key(key_dict: Path, pem: Path) -> SSlibKey:
    d = json.loads(key_dict.read_text())
    keyid = d.pop("keyid")
    key = SSlibKey.from_dict(keyid, d)
    from_pem = SSlibKey.from_crypto(load_pem_public_key(pem.read_bytes()))
    if from_pem.keyid != keyid or from_pem.keyval != key.keyval:
        raise Fail(f"key dict keyid {keyid} is not securesystemslib's keyid {from_pem.keyid} "
                   "of the PEM")
    return key


def sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree_of(git: Path, commit: str) -> str:
    """The tree a commit names, from its loose object file, hashed to its id: no git is
    run in a directory someone else wrote (its config could name a command to run)."""
    try:
        d = zlib.decompressobj()  # bounded: a small object may inflate to gigabytes
        raw = d.decompress((git / "objects" / commit[:2] / commit[2:]).read_bytes(), 1 << 20)
    except (OSError, zlib.error):
        return ""
    if d.unconsumed_tail:
        return ""
    if hashlib.sha1(raw).hexdigest() != commit:  # noqa: S324 - git's object id
        return ""
    _, _, body = raw.partition(b"\0")
    first = body.split(b"\n", 1)[0]
    return first[5:].decode("ascii", "replace") if first.startswith(b"tree ") else ""


def check_subject(run: Path, name: str, digest: dict[str, str], annotations: dict) -> None:
    if "sha256" in digest:
        p = run / name
        if not p.is_file() or sha256_file(p) != digest["sha256"]:
            raise Fail(f"subject {name}: sha256 differs from the file in the run directory")
    if "gitTree" in digest:
        commit = str(annotations.get("gitCommit"))
        tree = tree_of(run / "stages/apply/candidate.git", commit)
        if tree != digest["gitTree"]:
            raise Fail(f"subject {name}: gitTree {digest['gitTree']} is not the tree of "
                       f"commit {commit} ({tree or 'unknown'})")
    if not {"sha256", "gitTree"} & set(digest):
        raise Fail(f"subject {name}: no digest this verifier can recompute")


def verify(bundle: Path, key: SSlibKey, run: Path, schema: dict) -> list[dict]:
    seen = []
    for n, line in enumerate(bundle.read_text().splitlines(), 1):
        env = Envelope.from_dict(json.loads(line))
        try:
            env.verify([key], 1)
        except VerificationError as exc:
            raise Fail(f"line {n}: DSSE signature does not verify: {exc}") from None
        if env.payload_type != IN_TOTO:
            raise Fail(f"line {n}: payloadType {env.payload_type}")
        pb = pb_json.Parse(env.payload, statement_pb2.Statement())
        st = Statement.copy_from_pb(pb)
        st.validate()
        doc = json.loads(env.payload)
        for s in doc["subject"]:
            check_subject(run, s["name"], s["digest"], s.get("annotations", {}))
        if doc["predicateType"] == SLSA:
            pb_json.ParseDict(doc["predicate"], provenance_pb2.Provenance())  # strict
        elif doc["predicateType"] == EVALUATION:
            jsonschema.validate(doc["predicate"], schema,
                                format_checker=jsonschema.FormatChecker())
        else:
            raise Fail(f"line {n}: unknown predicateType {doc['predicateType']}")
        seen.append({"predicateType": doc["predicateType"],
                     "subject": doc["subject"],
                     "predicate_keys": sorted(doc["predicate"])})
    if sorted(s["predicateType"] for s in seen) != sorted({EVALUATION, SLSA}):
        raise Fail(f"expected one evaluation and one provenance Statement, got "
                   f"{[s['predicateType'] for s in seen]}")
    return seen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--key-dict", type=Path, required=True)
    ap.add_argument("--pem", type=Path, required=True)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--schema", type=Path, required=True)
    a = ap.parse_args()
    assert "runner" not in sys.modules and "cyclebox" not in sys.modules
    try:
        key = load_key(a.key_dict, a.pem)
        seen = verify(a.bundle, key, a.run, json.loads(a.schema.read_text()))
    except (Fail, jsonschema.ValidationError, pb_json.ParseError, ValueError) as exc:
        print(f"FAIL: {type(exc).__name__}: {str(exc)[:500]}")
        return 1
    print(json.dumps({"ok": True, "keyid": key.keyid, "scheme": key.scheme,
                      "statements": seen}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
