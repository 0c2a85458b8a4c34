"""The analyst image plus a project's own requirements: derived offline, reused while unchanged.

A project may declare pip requirements (``project.requirements`` in cycle.yaml: a file in
its source tree, read from the frozen base tree; see docs/agent-dependencies.md). Freezing
then derives an analyst image for it:

1. The requirement lines are checked (:func:`check_requirements`): names, extras and
   version specifiers only. No pip option, URL, file reference or marker reaches the
   host's ``pip download``, and only wheels are fetched (``--only-binary=:all:``), so
   nothing from the project runs on the host.
2. Their wheels are downloaded on the host into ``build/wheels/agent/<sha>/``, once per
   requirements content.
3. ``images/agent.Dockerfile`` builds ``FROM`` the analyst image's id with
   ``--network none``; the venv's own packages are pip constraints, so an agent
   requirement cannot move the openai SDK the gateway client relies on.

Invariant: the tag ``cyclebox/analyst-deps:<hash>`` covers the analyst image id, the
checked requirements, the wheel digest and the Dockerfile; an existing tag is reused
(nothing is downloaded or built), and the plan freezes the resulting image id as the
analyst's.
"""

from __future__ import annotations

import collections
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runner.errors import PrerequisiteError, SandboxError
from runner.isolation import image_use
from runner.isolation.docker.images import (
    MAX_REASON_CHARS,
    Log,
    download_wheels,
    link_or_copy,
)
from runner.paths import images_dir, state_dir
from runner.requirements import RequirementsRefused, check_requirements, pip_reason

TAG_REPO = "cyclebox/analyst-deps"
REQUIREMENTS_LABEL = "io.cyclebox.agent_requirements"
"""Label every derived image carries (the sha256 of its requirement lines)."""
STATE_LABEL = "io.cyclebox.state_dir"
"""The state directory whose freezes built it (where its users' locks live)."""

__all__ = ["TAG_REPO", "AgentImage", "DerivedImage", "check_requirements", "derived_images",
           "ensure_agent_image", "gc_derived"]

@dataclass(frozen=True)
class AgentImage:
    """The derived analyst image for one requirements content."""

    tag: str
    id: str
    analyst_id: str
    """The analyst image it was built from."""
    requirements_sha256: str
    """sha256 of the checked requirement lines (as written to the build context)."""
    wheels_digest: str
    input_hash: str
    built: bool
    """True when this call built it; False when the tag already existed."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def agent_input_hash(analyst_id: str, requirements: str, wheels_digest: str,
                     dockerfile: bytes) -> str:
    """Hash of everything the derived image is built from."""
    h = hashlib.sha256()
    h.update(f"analyst={analyst_id}\nwheels={wheels_digest}\n".encode())
    h.update(b"requirements\0" + requirements.encode() + b"\0")
    h.update(b"Dockerfile\0" + dockerfile + b"\0")
    return h.hexdigest()


def ensure_agent_image(analyst_id: str, requirements: str, log: Log, *,
                       field: str = "project.requirements") -> AgentImage:
    """The derived analyst image for ``requirements`` (checked lines), building it when
    its tag is missing. ConfigError naming ``field`` when pip cannot satisfy them offline
    (a conflict with the analyst's own packages, a wheel that does not fit)."""
    from runner.isolation.docker.backend import DockerSandbox

    req_sha = _sha(requirements.encode())
    req_file = state_dir() / "agent" / f"{req_sha[:16]}.txt"
    req_file.parent.mkdir(parents=True, exist_ok=True)
    if not req_file.is_file() or req_file.read_text() != requirements:
        req_file.write_text(requirements)
    wheels = download_wheels(req_file, state_dir() / "wheels" / "agent" / req_sha[:16], log,
                             what="the agent's requirements", field=field)
    digest = (wheels / ".digest").read_text().strip()
    dockerfile = images_dir() / "agent.Dockerfile"
    ih = agent_input_hash(analyst_id, requirements, digest, dockerfile.read_bytes())
    tag = f"{TAG_REPO}:{ih[:16]}"
    backend = DockerSandbox()
    existing = backend.image_id(tag)
    built = existing is None
    if built:
        (state_dir() / "context").mkdir(parents=True, exist_ok=True)
        ctx = Path(tempfile.mkdtemp(prefix="agent-", dir=state_dir() / "context"))
        tail: collections.deque[str] = collections.deque(maxlen=25)
        try:
            shutil.copy2(dockerfile, ctx / "Dockerfile")
            shutil.copy2(req_file, ctx / "requirements.txt")
            (ctx / "wheels").mkdir()
            for whl in wheels.glob("*.whl"):
                link_or_copy(whl, ctx / "wheels" / whl.name)
            log(f"building {tag} from the analyst image (network none)")
            for line in backend.build(ctx, tag, buildargs={"ANALYST_IMAGE": analyst_id},
                                      labels={"io.cyclebox.role": "analyst",
                                              "io.cyclebox.input_hash": ih,
                                              "io.cyclebox.base": analyst_id,
                                              "io.cyclebox.agent_requirements": req_sha,
                                              STATE_LABEL: str(state_dir())}):
                tail.append(line)
                log(line)
        except SandboxError as exc:
            if "returned a non-zero code" not in str(exc):
                raise  # the engine failed, not the install
            shown = pip_reason("\n".join(tail), MAX_REASON_CHARS)
            raise RequirementsRefused(
                f"the agent's requirements do not install offline into the analyst image "
                f"({pip_reason(str(exc), 300)}); the build said: {shown}", field=field,
                fix="pin versions that agree with the analyst's own packages "
                    "(images/analyst/requirements.txt) and publish cp311 manylinux or "
                    "pure-Python wheels") from None
        finally:
            shutil.rmtree(ctx, ignore_errors=True)
        existing = backend.image_id(tag)
    if existing is None:
        raise PrerequisiteError(f"build of {tag} reported success but no image exists")
    image_use.hold([existing])  # until this process ends: `images gc` leaves it alone
    if backend.image_id(tag) != existing:
        raise PrerequisiteError(f"{tag} was removed while this freeze used it (a "
                                "concurrent `cyclebox images gc`). Fix: run the command again")
    return AgentImage(tag=tag, id=existing, analyst_id=analyst_id,
                      requirements_sha256=req_sha, wheels_digest=digest, input_hash=ih,
                      built=built)


@dataclass(frozen=True)
class DerivedImage:
    """One derived analyst image in the engine (``images list``, ``images gc``)."""

    tag: str
    id: str
    size_bytes: int
    derived_from: str
    """The analyst image id it was built from."""
    requirements_sha256: str
    state_dir: str | None
    """The state directory whose freeze built it (None: built before this was labelled)."""
    used_by: tuple[str, ...]
    """Containers (any state) created from it."""


@dataclass(frozen=True)
class ImageSweep:
    """What ``images gc`` did with one derived image."""

    tag: str
    id: str
    size_bytes: int
    would_remove: bool
    removed: bool
    reason: str


def derived_images() -> list[DerivedImage]:
    """Every derived analyst image in the engine, with the containers that use it."""
    from runner.isolation.docker.backend import DockerSandbox

    api = DockerSandbox().client.api
    users: dict[str, list[str]] = {}
    for c in api.containers(all=True):
        users.setdefault(str(c.get("ImageID", "")), []).append(
            str((c.get("Names") or [c.get("Id", "?")])[0]).lstrip("/"))
    rows = []
    for img in api.images(filters={"label": REQUIREMENTS_LABEL}):
        labels = img.get("Labels") or {}
        tags = [t for t in img.get("RepoTags") or [] if t != "<none>:<none>"]
        rows.append(DerivedImage(
            tag=", ".join(sorted(tags)) or "<untagged>", id=str(img["Id"]),
            size_bytes=int(img.get("Size", 0)), derived_from=str(labels.get(
                "io.cyclebox.base", "?")),
            requirements_sha256=str(labels.get(REQUIREMENTS_LABEL, "?")),
            state_dir=labels.get(STATE_LABEL),
            used_by=tuple(sorted(users.get(str(img["Id"]), [])))))
    return sorted(rows, key=lambda r: r.tag)


def gc_derived(*, dry_run: bool = False, other_state: bool = False) -> list[ImageSweep]:
    """Remove derived analyst images no container and no live cyclebox process uses.

    Kept: an image a container (running or stopped) was created from; one a live
    process holds (:mod:`runner.isolation.image_use`: a freeze or a run of this state
    directory); one built from another state directory, whose users' locks are not
    visible here, unless ``other_state``. The engine itself refuses to remove an image a
    container uses (never forced)."""
    from runner.isolation.docker.backend import DockerSandbox

    api = DockerSandbox().client.api
    here = str(state_dir())
    out = []
    for img in derived_images():
        def row(remove: bool, removed: bool, reason: str, img: DerivedImage = img
                ) -> ImageSweep:
            return ImageSweep(tag=img.tag, id=img.id, size_bytes=img.size_bytes,
                              would_remove=remove, removed=removed, reason=reason)

        if img.used_by:
            out.append(row(False, False, f"used by container(s) {', '.join(img.used_by[:5])}"))
            continue
        if img.state_dir != here and not other_state:
            out.append(row(False, False, f"built from another state directory "
                           f"({img.state_dir or 'unrecorded'}); --other-state removes it"))
            continue
        with image_use.unused(img.id) as free:
            if not free:
                out.append(row(False, False, "a live cyclebox process uses it"))
                continue
            if dry_run:
                out.append(row(True, False, "unused"))
                continue
            try:
                for tag in img.tag.split(", ") if img.tag != "<untagged>" else [img.id]:
                    api.remove_image(tag, force=False, noprune=False)
            except Exception as exc:  # the engine refused (a container appeared): kept
                from runner.failures import one_line

                out.append(row(True, False, f"engine refused: {one_line(str(exc), 300)}"))
                continue
            image_use.forget(img.id)
            out.append(row(True, True, "unused"))
    return out
