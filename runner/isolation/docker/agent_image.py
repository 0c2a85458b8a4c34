"""The analyst image plus a project's own toolchains: derived offline, reused while unchanged.

A project may declare pip requirements (``project.requirements``), Debian packages
(``project.apt``) and an npm lockfile (``project.npm``) in cycle.yaml, read from the
frozen base tree (docs/agent-dependencies.md). Freezing then derives ONE analyst image
for all of them; each toolchain is one resolver (:mod:`.toolchain_stages`), this module
the one builder:

1. Each resolver checks its input and resolves it on the host without running anything
   from the project: pip downloads wheels only (``--only-binary=:all:``), apt downloads
   .debs with a private state seeded from the analyst image's dpkg status, npm fetches
   registry tarballs whose sha512 the lockfile names (never an install script).
2. ``images/agent.Dockerfile`` builds ``FROM`` the analyst image's id with
   ``--network none``: dpkg installs the .debs, a throwaway pip installs the wheels into
   the venv (its own packages as constraints), node_modules is copied to
   ``/node_modules``; only what those installs changed reaches the final image, which
   is hardened again (images/harden.sh: no setuid file, the same user and entry point).

Invariant: the tag ``cyclebox/analyst-deps:<hash>`` covers the analyst image id, each
toolchain's inputs and artefact digests and the build files; an existing tag is reused
(nothing is downloaded or built), and the plan freezes the resulting image id as the
analyst's.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from runner.errors import PrerequisiteError, SandboxError
from runner.isolation import image_use
from runner.isolation.docker.images import MAX_REASON_CHARS, Log
from runner.paths import images_dir, state_dir
from runner.requirements import RequirementsRefused, check_requirements, pip_reason
from runner.toolchain import AgentToolchains, DerivedAnalyst, ResolvedFile

TAG_REPO = "cyclebox/analyst-deps"
REQUIREMENTS_LABEL = "io.cyclebox.agent_requirements"
"""Label every derived image carries (the sha256 of its requirement lines)."""
TOOLCHAINS_LABEL = "io.cyclebox.agent_toolchains"
"""The versions each toolchain installed (JSON: pip lines, apt name=version, npm
name@version)."""
STATE_LABEL = "io.cyclebox.state_dir"
"""The state directory whose freeze built it (a reuse from another state directory of the
same user holds it in the shared per-user directory of :mod:`runner.isolation.image_use`)."""

__all__ = ["TAG_REPO", "AgentImage", "DerivedImage", "check_requirements", "derived_images",
           "ensure_agent_image", "gc_derived"]

@dataclass(frozen=True)
class AgentImage:
    """The derived analyst image for one set of toolchains."""

    tag: str
    id: str
    analyst_id: str
    """The analyst image it was built from."""
    requirements_sha256: str
    """sha256 of the checked requirement lines ('' hashed when there are none)."""
    wheels_digest: str
    """The pip stage's digest ('' without project.requirements)."""
    input_hash: str
    built: bool
    """True when this call built it; False when the tag already existed."""
    installed: dict[str, list[str]] = field(default_factory=dict)
    """Per toolchain (pip, apt, npm), the pinned versions it installs."""
    artifacts: tuple[ResolvedFile, ...] = ()
    """Every file it was built from (wheels, npm tarballs, .debs), sorted."""

    def derived(self) -> DerivedAnalyst:
        return DerivedAnalyst(id=self.id, installed={k: list(v) for k, v in
                                                     self.installed.items()},
                              artifacts=self.artifacts)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def agent_input_hash(analyst_id: str, requirements: str, wheels_digest: str,
                     dockerfile: bytes, stages: tuple[tuple[str, str], ...] = ()) -> str:
    """Hash of everything the derived image is built from: the analyst image, each
    toolchain stage's (name, digest), the pip lines and the build files."""
    h = hashlib.sha256()
    h.update(f"analyst={analyst_id}\nwheels={wheels_digest}\n".encode())
    h.update(b"requirements\0" + requirements.encode() + b"\0")
    h.update(b"Dockerfile\0" + dockerfile + b"\0")
    for name, digest in stages:
        h.update(f"stage {name}={digest}\n".encode())
    return h.hexdigest()


def _image_file(analyst_id: str, path: str, max_bytes: int) -> bytes:
    """One regular file of an image, read through a created (never started) container;
    kept under the state directory by image id (an image id names fixed content)."""
    key = hashlib.sha256(f"{analyst_id}\n{path}".encode()).hexdigest()[:32]
    memo = state_dir() / "image-files" / key
    if not analyst_id.startswith("sha256:"):  # a tag may name other content tomorrow
        return _read_image_file(analyst_id, path, max_bytes)
    if memo.is_file() and memo.stat().st_size <= max_bytes:
        return memo.read_bytes()
    data = _read_image_file(analyst_id, path, max_bytes)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{key}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, memo)
    return data


def _read_image_file(analyst_id: str, path: str, max_bytes: int) -> bytes:
    import io
    import tarfile

    from runner.isolation.docker.backend import DockerSandbox

    client = DockerSandbox().client
    c = client.containers.create(analyst_id, command=["true"], network_disabled=True,
                                 labels={"io.cyclebox.role": "analyst-status-read"})
    try:
        stream, stat = c.get_archive(path)
        if int(stat.get("size", 0)) > max_bytes:
            raise PrerequisiteError(f"{path} in {analyst_id[:19]} has more than {max_bytes} "
                                    "bytes")
        data = b"".join(stream)
    finally:
        c.remove(force=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        m = tf.next()
        f = tf.extractfile(m) if m is not None and m.isfile() else None
        if f is None:
            raise PrerequisiteError(f"{path} in {analyst_id[:19]} is not a regular file")
        return f.read(max_bytes)


def ensure_agent_image(analyst_id: str, toolchains: AgentToolchains | str, log: Log, *,
                       field: str = "project.requirements") -> AgentImage:
    """The derived analyst image for ``toolchains`` (or checked pip requirement lines),
    building it when its tag is missing. ConfigError naming ``field`` when pip cannot
    satisfy them offline (a conflict with the analyst's own packages, a wheel that does
    not fit); ConfigError naming project.apt / project.npm for what those refuse."""
    from runner.isolation.docker.backend import DockerSandbox
    from runner.isolation.docker.toolchain_stages import empty_context, stages

    tc = (AgentToolchains(requirements=toolchains) if isinstance(toolchains, str)
          else toolchains)
    requirements = tc.requirements or ""
    parts = stages(tc, log, image_status=lambda: _image_file(
        analyst_id, "/var/lib/dpkg/status", 64 * 1024 * 1024), field=field)
    pip = next((s for s in parts if s.name == "pip"), None)
    digest = pip.digest if pip else ""
    dockerfile = images_dir() / "agent.Dockerfile"
    harden = images_dir() / "harden.sh"
    ih = agent_input_hash(analyst_id, requirements, digest,
                          dockerfile.read_bytes() + harden.read_bytes(),
                          tuple((s.name, s.digest) for s in parts if s.name != "pip"))
    tag = f"{TAG_REPO}:{ih[:16]}"
    installed = {s.name: s.installed for s in parts}
    backend = DockerSandbox()
    existing = backend.image_id(tag)
    built = existing is None
    if built:
        (state_dir() / "context").mkdir(parents=True, exist_ok=True)
        ctx = Path(tempfile.mkdtemp(prefix="agent-", dir=state_dir() / "context"))
        tail: collections.deque[str] = collections.deque(maxlen=25)
        try:
            empty_context(ctx)
            shutil.copy2(dockerfile, ctx / "Dockerfile")
            shutil.copy2(harden, ctx / "harden.sh")
            for s in parts:
                s.fill(ctx)
            files = _store_artifacts(ih, [f for s in parts for f in s.artifacts()])
            log(f"building {tag} from the analyst image (network none): "
                f"{', '.join(s.name for s in parts) or 'nothing to add'}")
            for line in backend.build(ctx, tag, buildargs={"ANALYST_IMAGE": analyst_id},
                                      drop_other_stages=True,
                                      labels={"io.cyclebox.role": "analyst",
                                              "io.cyclebox.input_hash": ih,
                                              "io.cyclebox.base": analyst_id,
                                              REQUIREMENTS_LABEL: _sha(requirements.encode()),
                                              TOOLCHAINS_LABEL: _label(installed),
                                              STATE_LABEL: str(state_dir())}):
                tail.append(line)
                log(line)
        except SandboxError as exc:
            if "returned a non-zero code" not in str(exc):
                raise  # the engine failed, not the install
            shown = pip_reason("\n".join(tail), MAX_REASON_CHARS)
            what = ("the agent's requirements" if [s.name for s in parts] == ["pip"] else
                    f"the agent's toolchains ({', '.join(s.name for s in parts)})")
            raise RequirementsRefused(
                f"{what} do not install offline into the analyst image "
                f"({pip_reason(str(exc), 300)}); the build said: {shown}",
                field=field if pip else f"project.{parts[0].name}",
                fix="pin versions that agree with the analyst's own packages "
                    "(images/analyst/requirements.txt) and publish cp311 manylinux or "
                    "pure-Python wheels" if pip else
                    "list packages Debian bookworm can install together") from None
        finally:
            shutil.rmtree(ctx, ignore_errors=True)
        existing = backend.image_id(tag)
    else:
        files = _stored_artifacts(ih) or _store_artifacts(
            ih, [f for s in parts for f in s.artifacts()])
    if existing is None:
        raise PrerequisiteError(f"build of {tag} reported success but no image exists")
    image_use.hold([existing])  # until this process ends: `images gc` leaves it alone
    if backend.image_id(tag) != existing:
        raise PrerequisiteError(f"{tag} was removed while this freeze used it (a "
                                "concurrent `cyclebox images gc`). Fix: run the command again")
    return AgentImage(tag=tag, id=existing, analyst_id=analyst_id,
                      requirements_sha256=_sha(requirements.encode()), wheels_digest=digest,
                      input_hash=ih, built=built, installed=installed, artifacts=files)


_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_ARTIFACTS_BYTES = 16 * 1024 * 1024


def _artifacts_file(input_hash: str) -> Path:
    return state_dir() / "agent" / "artifacts" / f"{input_hash}.json"


def _store_artifacts(input_hash: str, files: list[ResolvedFile]) -> tuple[ResolvedFile, ...]:
    """Keep the files an image was built from beside the state that built it: a reuse of
    the image names them without fetching anything (the input hash covers each digest)."""
    out = tuple(sorted(set(files)))
    dest = _artifacts_file(input_hash)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(f) for f in out], indent=1))
    os.replace(tmp, dest)
    return out


def _stored_artifacts(input_hash: str) -> tuple[ResolvedFile, ...] | None:
    """The stored list, or None when absent or not one this module wrote (recomputed)."""
    path = _artifacts_file(input_hash)
    try:
        if path.is_symlink() or path.stat().st_size > MAX_ARTIFACTS_BYTES:
            return None
        doc = json.loads(path.read_bytes())
        names = [f.name for f in dataclasses.fields(ResolvedFile)]
        files = tuple(ResolvedFile(**{k: str(d[k]) for k in names}) for d in doc
                      if isinstance(d, dict) and sorted(d) == sorted(names))
    except (OSError, ValueError, TypeError):
        return None
    if len(files) != len(doc) or not all(_SHA256.fullmatch(f.sha256) for f in files):
        return None
    return tuple(sorted(files))


def _label(installed: dict[str, list[str]]) -> str:
    """The installed versions as a bounded label (JSON; the plan keeps the full list)."""
    text = json.dumps(installed, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= 32 * 1024 else json.dumps(
        {k: f"{len(v)} pins (see the plan's inputs/agent-toolchains.json)"
         for k, v in installed.items()})


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
    toolchains: str = "pip"
    """What it adds, per toolchain (e.g. ``apt 10, npm 52``; ``pip`` for an image built
    before the toolchains label)."""
    cyclebox: bool = True
    """Tagged ``cyclebox/analyst-deps:<h>`` with its own input hash: built by cyclebox.
    False: it only inherited the label (an image built FROM a derived one); never removed."""
    other_tags: tuple[str, ...] = ()
    """Tags of other repositories on the same image (never removed by gc)."""


@dataclass(frozen=True)
class ImageSweep:
    """What ``images gc`` did with one derived image."""

    tag: str
    id: str
    size_bytes: int
    would_remove: bool
    removed: bool
    reason: str


def _own_tag(tags: list[str], labels: dict[str, str]) -> str | None:
    """The image's ``cyclebox/analyst-deps:<h>`` tag when its own input-hash label
    starts with ``<h>``, else None. Labels are inherited: an image someone builds FROM a
    derived image carries every cyclebox label, but never our tag with its own hash."""
    ih = str(labels.get("io.cyclebox.input_hash", ""))
    if not _SHA256.fullmatch(ih):
        return None
    own = f"{TAG_REPO}:{ih[:16]}"
    return own if own in tags else None


def derived_images() -> list[DerivedImage]:
    """Every image carrying the derived-image label, with the containers that use it.
    Only those tagged ``cyclebox/analyst-deps:<h>`` with a matching input hash are
    cyclebox's (``cyclebox=True``); the others (built FROM one, re-tagged) are listed as
    not cyclebox's and never removed."""
    from runner.isolation.docker.backend import DockerSandbox

    api = DockerSandbox().client.api
    users: dict[str, list[str]] = {}
    for c in api.containers(all=True):
        users.setdefault(str(c.get("ImageID", "")), []).append(
            str((c.get("Names") or [c.get("Id", "?")])[0]).lstrip("/"))
    rows = []
    for img in api.images(filters={"label": REQUIREMENTS_LABEL}):
        labels = img.get("Labels") or {}
        tags = sorted(str(t) for t in img.get("RepoTags") or [] if t != "<none>:<none>")
        own = _own_tag(tags, labels)
        rows.append(DerivedImage(
            tag=own or ", ".join(tags) or "<untagged>", id=str(img["Id"]),
            size_bytes=int(img.get("Size", 0)), derived_from=str(labels.get(
                "io.cyclebox.base", "?")),
            requirements_sha256=str(labels.get(REQUIREMENTS_LABEL, "?")),
            state_dir=labels.get(STATE_LABEL),
            used_by=tuple(sorted(users.get(str(img["Id"]), []))),
            toolchains=_summary(labels.get(TOOLCHAINS_LABEL)),
            cyclebox=own is not None,
            other_tags=tuple(t for t in tags if t != own)))
    return sorted(rows, key=lambda r: (not r.cyclebox, r.tag))


def _summary(label: str | None) -> str:
    """``apt 10, npm 52`` from the toolchains label (an engine label: hostile input, so
    bounded and parsed defensively)."""
    if label is None:
        return "pip"
    try:
        doc = json.loads(label[:64 * 1024])
    except ValueError:
        return "?"
    if not isinstance(doc, dict):
        return "?"
    return ", ".join(f"{str(k)[:8]} {len(v) if isinstance(v, list) else '?'}"
                     for k, v in sorted(doc.items())[:5]) or "none"


def gc_derived(*, dry_run: bool = False, other_state: bool = False) -> list[ImageSweep]:
    """Remove derived analyst images no container and no live cyclebox process uses.

    Only cyclebox's own tag (``cyclebox/analyst-deps:<h>``, the image's input hash) is
    ever removed: an image that merely inherited the label is not touched, and another
    repository's tag on a derived image keeps the image (only our tag goes). Kept: an
    image a container (running or stopped) was created from; one a live process holds
    (:mod:`runner.isolation.image_use`: a freeze or a run of ANY state directory of this
    user, which all hold in one per-user directory); one built from another state
    directory (another user's, whose holds are not visible here), unless ``other_state``.
    The engine itself refuses to remove an image a container uses (never forced)."""
    from runner.isolation.docker.backend import DockerSandbox

    api = DockerSandbox().client.api
    here = str(state_dir())
    out = []
    for img in derived_images():
        def row(remove: bool, removed: bool, reason: str, img: DerivedImage = img
                ) -> ImageSweep:
            return ImageSweep(tag=img.tag, id=img.id, size_bytes=img.size_bytes,
                              would_remove=remove, removed=removed, reason=reason)

        if not img.cyclebox:
            out.append(row(False, False, "not cyclebox's: it carries the derived-image "
                           f"label but not the tag {TAG_REPO}:<its input hash> (built FROM "
                           "a derived image?)"))
            continue
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
            try:  # our tag only: another repository's tag keeps the image
                api.remove_image(img.tag, force=False, noprune=False)
            except Exception as exc:  # the engine refused (a container appeared): kept
                from runner.failures import one_line

                out.append(row(True, False, f"engine refused: {one_line(str(exc), 300)}"))
                continue
            if not img.other_tags:
                image_use.forget(img.id)
            out.append(row(True, True, "unused" if not img.other_tags else
                           f"unused; untagged only (the image stays as "
                           f"{', '.join(img.other_tags[:3])})"))
    return out
