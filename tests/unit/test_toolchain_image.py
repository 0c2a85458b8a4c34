"""The derived-image builder's pure pieces for toolchains (issue 22): the input hash moves
with every toolchain's digest, the label summary reads a hostile engine label safely,
and the plan's record of what was installed."""

from __future__ import annotations

import json

from runner.isolation.docker.agent_image import _summary, agent_input_hash
from runner.toolchain import AgentToolchains, DerivedAnalyst, NpmInput


def test_the_input_hash_covers_each_stage_and_its_digest() -> None:
    base = agent_input_hash("sha256:a", "", "", b"FROM x")
    with_npm = agent_input_hash("sha256:a", "", "", b"FROM x", (("npm", "1" * 64),))
    other_npm = agent_input_hash("sha256:a", "", "", b"FROM x", (("npm", "2" * 64),))
    with_apt = agent_input_hash("sha256:a", "", "", b"FROM x", (("apt", "1" * 64),))
    both = agent_input_hash("sha256:a", "", "", b"FROM x",
                            (("apt", "1" * 64), ("npm", "1" * 64)))
    assert len({base, with_npm, other_npm, with_apt, both}) == 5
    # a pip-only image keeps the hash it had before toolchains existed
    assert agent_input_hash("sha256:a", "x==1\n", "d", b"F") == agent_input_hash(
        "sha256:a", "x==1\n", "d", b"F", ())


def test_the_label_summary_is_bounded_and_never_trusts_the_label() -> None:
    assert _summary(None) == "pip"
    assert _summary(json.dumps({"apt": ["a=1"] * 10, "npm": ["b@1"] * 27})) == "apt 10, npm 27"
    assert _summary("not json") == "?"
    assert _summary("[1, 2]") == "?"
    assert _summary(json.dumps({"k" * 50: "nope"})) == "kkkkkkkk ?"  # bounded; the CLI
    # escapes what it prints (safe())
    assert len(_summary(json.dumps({f"k{i}": [] for i in range(100)}))) < 100
    assert _summary(json.dumps({})) == "none"


def test_what_was_installed_is_recorded_for_the_plan() -> None:
    d = DerivedAnalyst(id="sha256:b", installed={"apt": ["nodejs=18"], "npm": ["tsx@4"]})
    assert json.loads(d.record()) == {"schema": 1, "image": "sha256:b",
                                      "apt": ["nodejs=18"], "npm": ["tsx@4"]}


def test_toolchains_know_when_they_are_empty_and_name_package_json() -> None:
    assert AgentToolchains().empty()
    assert not AgentToolchains(apt=("nodejs",)).empty()
    npm = NpmInput(lockfile=b"{}", package_json=b"{}", source="web/package-lock.json")
    assert npm.pkg_source == "web/package.json"
    assert NpmInput(lockfile=b"", package_json=b"", source="package-lock.json").pkg_source \
        == "package.json"
