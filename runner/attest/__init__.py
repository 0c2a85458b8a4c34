"""Standard attestations of a recorded run (SPEC §10): in-toto Statements v1 in DSSE.

``cyclebox receipt attest RUN --key KEY`` writes a JSON-lines bundle
(``receipt.intoto.jsonl``, in-toto's ``.intoto.jsonl`` convention: one DSSE envelope a
line) of two Statements made from a run whose receipt verifies:

- :mod:`runner.attest.evaluation`: the cyclebox evaluation predicate
  (``https://cyclebox.dev/attestations/evaluation/v1``, schema in
  docs/attestations/evaluation-v1.schema.json) about the candidate patch, the candidate
  tree and receipt.json;
- :mod:`runner.attest.provenance`: SLSA provenance v1 for the candidate.

Nothing here reads a container's output except through a receipt that verified first;
the bundle is written once (never overwritten) and atomically (:mod:`runner.attest.bundle`).
"""
