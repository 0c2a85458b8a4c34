"""A multi-stage build leaves no untagged step images behind (helper-43 #3).

The legacy builder keeps every step of a build as an image; those of a stage the final
image does not derive from (a derived analyst image's build stage, with its wheels and
.debs) are untagged and nothing removed them. ``DockerSandbox.build(...,
drop_other_stages=True)`` removes the ones the build created, on success and failure.
Real engine, the analyst image as base, network none.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from runner.errors import SandboxError
from runner.isolation.docker.backend import DockerSandbox
from runner.isolation.docker.images import resolve_image

DOCKERFILE = """ARG BASE
FROM ${BASE} AS build
ARG BUILD_NONCE
LABEL io.cyclebox.build_stage=${BUILD_NONCE}
USER 0:0
RUN echo %s > /made && head -c 65536 /dev/zero > /bulk
RUN echo "---> %s"
FROM ${BASE}
COPY --from=build /made /made
"""


def _ids(box: DockerSandbox) -> set[str]:
    """Every image, but those of a derived analyst build running meanwhile on the shared
    engine (labelled with its input hash; this test's builds carry no such label)."""
    return {str(i["Id"]) for i in box.client.api.images(all=True)
            if "io.cyclebox.input_hash" not in (i.get("Labels") or {})}


@pytest.mark.parametrize("fails", [False, True])
def test_no_step_image_of_another_stage_is_left(tmp_path: Path, fails: bool) -> None:
    box = DockerSandbox()
    base = box.image_id(resolve_image("analyst"))
    assert base is not None
    nonce = secrets.token_hex(8)  # a fresh build: no step comes from the cache
    # helper-48 #3: an untagged image of someone else's, whose id the build prints as the
    # builder prints a step's (step ids were read off the log): it must stay
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "Dockerfile").write_text(f"FROM {base}\nLABEL other={nonce}\n")
    other = next(str(c["aux"]["ID"]) for c in box.client.api.build(
        path=str(tmp_path / "other"), network_mode="none", decode=True, rm=True,
        forcerm=True) if "aux" in c)
    text = DOCKERFILE % (nonce, other[7:19]) + ("RUN false\n" if fails else "")
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(text)
    tag = f"cyclebox-test/stages:{nonce}"
    before = _ids(box) | {other}
    try:
        def build() -> list[str]:
            return list(box.build(tmp_path / "ctx", tag, buildargs={"BASE": base}, labels={},
                                  drop_other_stages=True))
        if fails:
            with pytest.raises(SandboxError, match="non-zero code"):
                build()
        else:
            assert any(nonce in line for line in build())
            final = box.image_id(tag)
            assert final is not None
        left = _ids(box) - before
        if fails:
            assert left == set(), left
        else:  # the final image and its own step images (its layers) only
            layers = {str(h["Id"]) for h in box.client.api.history(tag)}
            assert left <= layers, left - layers
        assert box.image_id(other) is not None, "an image this build did not make is gone"
    finally:
        if box.image_id(tag):
            box.client.api.remove_image(tag, force=True)
        if box.image_id(other):
            box.client.api.remove_image(other, force=True)
