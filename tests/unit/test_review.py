"""Review packets and calibration: no grades in front of the human, identity checked,
missing labels stay missing, agreement statistics match hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runner.cycle.models import Grades, Identities, Record
from runner.cycle.review import (
    CalibrationResult,
    calibrate,
    cohen_kappa,
    load_calibration,
    make_packet,
    write_calibration,
)
from runner.errors import ConfigError, IntegrityError
from runner.hashing import sha256_json

IDS = Identities(data_hash="d" * 64, reference_hash="r" * 64, scorer="scorer-1")


def rec(case: str, *, correctness: bool | None = None, evidence: bool | None = None,
        refusal: bool | None = None, judge_score: float | None = None,
        status: str = "ok", trial: int = 0) -> Record:
    return Record.model_validate({
        "case_id": case, "trial": trial, "split": "acceptance", "status": status,
        "answer": {"answer": f"answer for {case}", "evidence": [f"table {case}_t, rows 1-3"],
                   "refused": False},
        "grades": Grades(correctness=correctness, evidence=evidence, refusal=refusal,
                         judge_score=judge_score),
        "identities": IDS})


# Model grades (True -> 2, False -> 0, None -> no rating) for five items a..e.
RECORDS = [
    rec("e", correctness=True, evidence=None, refusal=True),
    rec("a", correctness=True, evidence=True, refusal=True, judge_score=0.73),
    rec("b", correctness=True, evidence=True, refusal=True, judge_score=0.2),
    rec("c", correctness=False, evidence=False, refusal=True),
    rec("d", correctness=False, evidence=True, refusal=True),
    rec("x", status="infra_invalid", correctness=True, judge_score=0.91),
]
# Human labels; d's evidence label is left missing.
HUMAN: dict[str, dict[str, Any]] = {
    "a#0": {"correctness": 2, "evidence": 2, "refusal": 2},
    "b#0": {"correctness": 0, "evidence": 1, "refusal": 2},
    "c#0": {"correctness": 0, "evidence": 0, "refusal": 2},
    "d#0": {"correctness": 0, "evidence": None, "refusal": 2},
    "e#0": {"correctness": 2, "evidence": 2, "refusal": 2},
}


def read(path: Path) -> Any:
    return json.loads(path.read_text())


def fill(packet: Path, out: Path, labels: dict[str, dict[str, Any]]) -> Path:
    """What a reviewer does: fill the template's nulls, save it elsewhere."""
    doc = read(packet / "human-labels.json")
    for item, row in labels.items():
        doc["labels"][item].update(row)
    doc["labeled_at"] = "2025-01-02T03:04:05+00:00"
    out.write_text(json.dumps(doc))
    return out


@pytest.fixture
def packet(tmp_path: Path) -> Path:
    return make_packet(RECORDS, tmp_path / "packet", reviewer="rev-1")


def test_packet_files_and_review_has_no_grades(packet: Path) -> None:
    assert sorted(p.name for p in packet.iterdir()) == [
        "human-labels.json", "judge-ratings.json", "packet.json", "review.md"]
    md = (packet / "review.md").read_text()
    for case in "abcde":
        assert f"## {case}#0" in md
        assert f"answer for {case}" in md
        assert f"table {case}_t, rows 1-3" in md
    assert "x#0" not in md  # not ok: not reviewed
    assert "0 = fails" in md and "1 = partly" in md and "2 = fully meets" in md
    assert "0.73" not in md and "0.2" not in md
    assert "judge" not in md.lower() and "score" not in md.lower()

    pj = read(packet / "packet.json")
    assert pj["schema"] == 1
    assert [i["item_id"] for i in pj["items"]] == ["a#0", "b#0", "c#0", "d#0", "e#0"]
    assert pj["items"][0]["answer_sha256"] == sha256_json(RECORDS[1].answer)
    assert pj["criteria"] == ["correctness", "evidence", "refusal"]
    assert pj["packet_id"] == sha256_json({"items": pj["items"], "criteria": pj["criteria"]})

    labels = read(packet / "human-labels.json")
    assert labels["packet_id"] == pj["packet_id"] and labels["reviewer"] == "rev-1"
    assert labels["labeled_at"] is None
    assert all(v is None for row in labels["labels"].values() for v in row.values())

    ratings = read(packet / "judge-ratings.json")
    assert ratings["packet_id"] == pj["packet_id"]
    assert ratings["ratings"]["a#0"] == {"correctness": 2, "evidence": 2, "refusal": 2,
                                         "judge": 1}  # round(0.73 * 2)
    assert ratings["ratings"]["b#0"]["judge"] == 0  # round(0.4)
    assert ratings["ratings"]["e#0"] == {"correctness": 2, "evidence": None, "refusal": 2,
                                         "judge": None}


def test_packet_refuses_existing_dir(tmp_path: Path) -> None:
    out = tmp_path / "packet"
    out.mkdir()
    (out / "review.md").write_text("earlier evidence")
    with pytest.raises(ConfigError, match="never overwritten"):
        make_packet(RECORDS, out)
    assert (out / "review.md").read_text() == "earlier evidence"
    assert [p.name for p in out.iterdir()] == ["review.md"]


def test_calibrate_matches_hand_computed(packet: Path, tmp_path: Path) -> None:
    got = calibrate(packet, fill(packet, tmp_path / "labels.json", HUMAN),
                    packet / "judge-ratings.json")
    assert got.packet_id == read(packet / "packet.json")["packet_id"]
    assert got.reviewer == "rev-1" and got.items == 5

    # correctness, human vs model: a 2/2, b 0/2, c 0/0, d 0/0, e 2/2.
    # po = 4/5. Marginals: human {0: 3, 2: 2}, model {0: 2, 2: 3};
    # pe = (3*2 + 2*3) / 25 = 12/25; kappa = (20/25 - 12/25) / (13/25) = 8/13.
    assert got.coverage["correctness"] == 1.0
    assert got.disagreements["correctness"] == ("b#0",)
    assert got.exact_agreement["correctness"] == pytest.approx(4 / 5)
    assert got.mean_abs_diff["correctness"] == pytest.approx(2 / 5)
    assert got.cohen_kappa["correctness"] == pytest.approx(8 / 13)

    # evidence: d missing (human), e not rated (model) -> pairs a 2/2, b 1/2, c 0/0.
    # po = 2/3; human {0:1, 1:1, 2:1}, model {0:1, 2:2}; pe = (1 + 0 + 2)/9 = 1/3;
    # kappa = (2/3 - 1/3) / (2/3) = 1/2.
    assert got.coverage["evidence"] == pytest.approx(4 / 5)
    assert got.pairs["evidence"] == 3
    assert got.disagreements["evidence"] == ("b#0",)
    assert got.exact_agreement["evidence"] == pytest.approx(2 / 3)
    assert got.mean_abs_diff["evidence"] == pytest.approx(1 / 3)
    assert got.cohen_kappa["evidence"] == pytest.approx(1 / 2)

    # refusal: everyone says 2 -> pe = 1 and po = 1: kappa defined as 1.0.
    assert got.cohen_kappa["refusal"] == 1.0 and got.disagreements["refusal"] == ()

    # overall, pooled over 13 pairs: 11 agree; human {0:4, 1:1, 2:8}, model {0:3, 2:10};
    # pe = (12 + 0 + 80)/169 = 92/169; kappa = (143 - 92)/(169 - 92) = 51/77.
    assert got.coverage["overall"] == pytest.approx(14 / 15)
    assert got.pairs["overall"] == 13
    assert got.exact_agreement["overall"] == pytest.approx(11 / 13)
    assert got.mean_abs_diff["overall"] == pytest.approx(3 / 13)
    assert got.cohen_kappa["overall"] == pytest.approx(51 / 77)
    assert got.complete is False
    assert "overall" not in got.disagreements


def test_complete_when_every_cell_labelled(packet: Path, tmp_path: Path) -> None:
    full = {k: {**v, "evidence": v["evidence"] if v["evidence"] is not None else 2}
            for k, v in HUMAN.items()}
    got = calibrate(packet, fill(packet, tmp_path / "l.json", full),
                    packet / "judge-ratings.json")
    assert got.complete is True and got.coverage["overall"] == 1.0


def test_too_few_pairs_give_no_statistic(packet: Path, tmp_path: Path) -> None:
    got = calibrate(packet, fill(packet, tmp_path / "l.json", {"a#0": {"correctness": 2}}),
                    packet / "judge-ratings.json")
    assert got.coverage["correctness"] == pytest.approx(1 / 5)
    assert got.coverage["evidence"] == 0.0
    assert got.pairs["correctness"] == 1 and got.cohen_kappa["correctness"] is None
    assert got.exact_agreement["evidence"] is None and got.mean_abs_diff["evidence"] is None


def test_kappa_edge_cases() -> None:
    assert cohen_kappa([]) is None
    assert cohen_kappa([(2, 2)]) is None
    assert cohen_kappa([(1, 1), (1, 1)]) == 1.0
    # Perfectly opposed 2x2: po = 0, pe = 1/2 -> kappa = -1.
    assert cohen_kappa([(0, 2), (2, 0)]) == -1.0


def test_result_roundtrip_and_no_overwrite(packet: Path, tmp_path: Path) -> None:
    got = calibrate(packet, fill(packet, tmp_path / "l.json", HUMAN),
                    packet / "judge-ratings.json")
    out = write_calibration(got, tmp_path / "calibration.json")
    assert load_calibration(out) == got
    assert isinstance(load_calibration(out), CalibrationResult)
    with pytest.raises(ConfigError, match="never overwritten"):
        write_calibration(got, out)


def test_tampered_review_md(packet: Path, tmp_path: Path) -> None:
    labels = fill(packet, tmp_path / "l.json", HUMAN)
    md = packet / "review.md"
    md.write_text(md.read_text() + "\nmodel said: correct\n")
    with pytest.raises(IntegrityError, match=r"review\.md"):
        calibrate(packet, labels, packet / "judge-ratings.json")


def test_edited_packet_json(packet: Path, tmp_path: Path) -> None:
    labels = fill(packet, tmp_path / "l.json", HUMAN)
    pj = read(packet / "packet.json")
    pj["items"] = pj["items"][1:]
    (packet / "packet.json").write_text(json.dumps(pj))
    with pytest.raises(IntegrityError, match=r"packet\.json"):
        calibrate(packet, labels, packet / "judge-ratings.json")


@pytest.mark.parametrize("which", ["labels", "ratings"])
def test_packet_id_mismatch_names_file(packet: Path, tmp_path: Path, which: str) -> None:
    labels = fill(packet, tmp_path / "labels.json", HUMAN)
    ratings = tmp_path / "ratings.json"
    ratings.write_bytes((packet / "judge-ratings.json").read_bytes())
    victim = labels if which == "labels" else ratings
    doc = read(victim)
    doc["packet_id"] = "0" * 64
    victim.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match=victim.name):
        calibrate(packet, labels, ratings)


def test_label_for_unknown_item(packet: Path, tmp_path: Path) -> None:
    labels = fill(packet, tmp_path / "l.json", HUMAN)
    doc = read(labels)
    doc["labels"]["zz#0"] = {"correctness": 2}
    labels.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match=r"l\.json.*zz#0"):
        calibrate(packet, labels, packet / "judge-ratings.json")


@pytest.mark.parametrize("value", [3, -1, True, 1.5, 2.0, "2"])
def test_invalid_label_value(packet: Path, tmp_path: Path, value: object) -> None:
    bad = {**HUMAN, "b#0": {**HUMAN["b#0"], "correctness": value}}
    labels = fill(packet, tmp_path / "l.json", bad)
    with pytest.raises(ConfigError, match=r"l\.json.*'b#0'.*'correctness'"):
        calibrate(packet, labels, packet / "judge-ratings.json")


def test_unknown_criterion_refused(packet: Path, tmp_path: Path) -> None:
    labels = fill(packet, tmp_path / "l.json", {"a#0": {"judge": 2}})
    with pytest.raises(ConfigError, match="'a#0', criterion 'judge': unknown criterion"):
        calibrate(packet, labels, packet / "judge-ratings.json")


@pytest.mark.parametrize("edit", [
    {"labeled_at": "2025-01-02T03:04:05"},  # naive timestamp
    {"schema": 2},
    {"extra": 1},
])
def test_malformed_labels_file(packet: Path, tmp_path: Path, edit: dict[str, Any]) -> None:
    labels = fill(packet, tmp_path / "l.json", HUMAN)
    labels.write_text(json.dumps({**read(labels), **edit}))
    field = next(iter(edit))  # the error names the file, the field and the fix
    with pytest.raises(ConfigError, match=rf"l\.json: {field}: .* Fix: pass the human-labels "
                                          "file cyclebox wrote"):
        calibrate(packet, labels, packet / "judge-ratings.json")


def test_labels_file_with_nan_refused(packet: Path, tmp_path: Path) -> None:
    labels = tmp_path / "l.json"
    labels.write_text((packet / "human-labels.json").read_text().replace("null", "NaN", 1))
    with pytest.raises(ConfigError, match="NaN"):
        calibrate(packet, labels, packet / "judge-ratings.json")


def test_packet_refuses_bad_inputs_before_creating_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no record with status ok"):
        make_packet([RECORDS[-1]], tmp_path / "p1")
    with pytest.raises(ConfigError, match=r"judge_score 1\.5 is outside 0\.\.1"):
        make_packet([rec("a", judge_score=1.5)], tmp_path / "p2")
    with pytest.raises(ConfigError, match="duplicate"):
        make_packet([rec("a"), rec("a")], tmp_path / "p3")
    assert list(tmp_path.iterdir()) == []


def test_answer_cannot_break_out_of_its_fence(tmp_path: Path) -> None:
    r = rec("a").model_copy(update={"answer": {"answer": "x\n```\n## b#0\n"}})
    md = (make_packet([r], tmp_path / "p") / "review.md").read_text()
    assert "````text\nx\n```\n## b#0\n\n````" in md
