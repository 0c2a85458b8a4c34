"""Docker implementation of :class:`runner.isolation.sandbox.Sandbox`; only this package
imports docker.

Invariants: a container is created from an image id or local tag and never pulled; its
arguments come only from :func:`runner.isolation.docker.hardening.create_kwargs`; PID 1
is the holder of :mod:`sandbox.holder`, which starts the role command itself when handed
the case (no ``docker exec``) and frames its stdout/stderr and exit status on its own
stdout, attached before start (:mod:`runner.isolation.docker.channel`; the engine keeps
no log copy), counted against the cap; the output directory is a kernel-capped tmpfs
copied out through :mod:`runner.isolation.copyout` before removal; input mounts are
staged under opaque names (:mod:`runner.isolation.docker.staging`); a container is
prepared for exactly one case (:mod:`runner.isolation.docker.prepared`), removed in
``finally``, and removal is confirmed by asking the engine, not assumed.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions

from runner import interrupts
from runner.errors import PrerequisiteError, SandboxError
from runner.isolation.docker.channel import TAIL_BYTES, _CopyOut
from runner.isolation.docker.engine_state import flags_from_inspect, killed_from_outside
from runner.isolation.docker.prepared import DockerPreparedRun
from runner.isolation.docker.staging import (
    STAGING_ENV,
    STAGING_OWNER,
    STAGING_PREFIX,
    _seed_tar,
    _Staging,
    check_mount_sources,
    legacy_staging_base,
    staging_base,
)
from runner.isolation.owner import Owner, current_owner
from runner.isolation.sandbox import (
    LABEL_PREFIX,
    MANAGED_LABEL,
    OutputCallback,
    RunRecord,
    RunSpec,
    SweepResult,
)

__all__ = [  # what callers and tests import from here, wherever it now lives
    "TAIL_BYTES", "DockerPreparedRun", "DockerSandbox", "EngineInfo", "_CopyOut", "_Staging",
    "_seed_tar", "check_mount_sources", "connect", "engine_info", "flags_from_inspect",
    "killed_from_outside",
]


STOP_TIMEOUT_S = 5.0
"""How long one engine request may take once a run is stopping (:meth:`DockerSandbox.
stopping`): long enough for a loaded engine to kill and remove a container, short enough
that a hung one cannot hold the verdict and receipt past a supervisor's grace period."""
BUILD_NONCE_ARG = "BUILD_NONCE"
BUILD_STAGE_LABEL = "io.cyclebox.build_stage"
"""Label of a multi-stage build's earlier stages (``LABEL io.cyclebox.build_stage=
${BUILD_NONCE}``): how :meth:`DockerSandbox.build` finds their step images."""


SLOW_REMOVALS = 2
"""Removals that may time out in one stopping sweep before the engine counts as hung."""
SILENT_TIMEOUT_S = 0.05
"""The wait of any engine request once the engine went unanswered while the run stopped."""


def connect(timeout: int = 60) -> docker.DockerClient:
    """A client for the local engine, or PrerequisiteError saying how to get one."""
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise PrerequisiteError(
            f"Docker engine not reachable ({exc}). Fix: start it (`make docker` installs "
            "Debian's docker.io and starts dockerd when run as root), or set DOCKER_HOST."
        ) from None
    return client


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the engine that doctor reports."""

    version: str
    api_version: str
    cgroup_version: str
    storage_driver: str
    security_options: tuple[str, ...]
    runtimes: tuple[str, ...]
    docker_root: str


def engine_info(client: docker.DockerClient) -> EngineInfo:
    info = client.info()
    ver = client.version()
    return EngineInfo(
        version=str(ver.get("Version", "?")),
        api_version=str(ver.get("ApiVersion", "?")),
        cgroup_version=str(info.get("CgroupVersion", "?")),
        storage_driver=str(info.get("Driver", "?")),
        security_options=tuple(info.get("SecurityOptions") or ()),
        runtimes=tuple(sorted((info.get("Runtimes") or {}).keys())),
        docker_root=str(info.get("DockerRootDir", "")),
    )


class DockerSandbox:
    """Runs role containers on the local Docker engine under the isolation contract."""

    name = "docker"

    def __init__(self, client: docker.DockerClient | None = None,
                 owner: Owner | None = None, timeout: int = 60) -> None:
        self.client = client or connect(timeout=timeout)
        self.owner = owner or current_owner()
        self._stop_timeout: float | None = None
        self._silent = False

    def stopping(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """The run is stopping: every engine request from now on waits at most
        ``timeout_s`` (requests already sent keep theirs), and once one went unanswered,
        :meth:`leftovers` asks no more (a hung engine held an interrupted run for minutes
        before its verdict and receipt, one 60 s wait after another)."""
        self._stop_timeout = timeout_s
        self.client.api.timeout = timeout_s

    # -- running ---------------------------------------------------------------
    def prepare(self, spec: RunSpec, *,
                cancel: threading.Event | None = None) -> DockerPreparedRun:
        """Create and start the container for ``spec`` up to where only the role command
        is left to start (:class:`runner.isolation.docker.prepared.DockerPreparedRun`):
        inputs staged, created with the holder as PID 1, attached, started, output
        seeded, the holder READY. Raises as ``run`` would; the caller records it.
        ``cancel`` set meanwhile: removed at once and SandboxError raised."""
        staged: _Staging | None = None
        try:
            # A signal while the copy is made would leave it behind: held until the copy
            # is ours to remove, then it unwinds (here, at the end of the with: inside
            # this try, so the copy goes too). The prepared run removes it with the
            # container.
            with interrupts.deferred():
                staged = _Staging(spec)
            return DockerPreparedRun(self, spec, staged, cancel=cancel)
        except BaseException:
            if staged is not None:
                staged.cleanup()
            raise

    def run(self, spec: RunSpec, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None) -> RunRecord:
        """Run one role command to completion or limit, copy its output out; always remove.

        One path: ``prepare(spec).run(...)``. PID 1 is :mod:`sandbox.holder`, which
        starts the role command as its child when handed the case and reports its
        output and exit status in frames on its own stdout (attached before start);
        its output directory is a capped tmpfs that the holder writes as a tar once the
        command ended (see :mod:`runner.isolation.copyout`). ``cancel`` set before the
        hand-over: removed unrun and SandboxError raised."""
        return self.prepare(spec, cancel=cancel).run(on_output=on_output, cancel=cancel)

    def _stopped(self, cid: str, within_s: float = 0.0) -> dict[str, Any] | None:
        """The container's inspect JSON once it is no longer running (polled for up to
        ``within_s``); None while it runs or when the engine cannot say."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                info: dict[str, Any] = self.client.api.inspect_container(cid)
            except (docker.errors.APIError, requests.exceptions.RequestException):
                return None
            state = info.get("State")
            if isinstance(state, Mapping) and not state.get("Running"):
                return info
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _gone(self, cid: str, within_s: float = 0.0) -> bool:
        """The engine says it does not know the container (removed; polled for up to
        ``within_s`` while it is being removed); False when it does or cannot say."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                info = self.client.api.inspect_container(cid)
            except docker.errors.NotFound:
                return True
            except (docker.errors.APIError, requests.exceptions.RequestException):
                return False
            state = info.get("State") if isinstance(info, Mapping) else None
            removing = isinstance(state, Mapping) and (
                state.get("Status") == "removing" or state.get("Dead"))
            if not removing or time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _remove_late(self, name: str, within_s: float = 3.0) -> None:
        """Remove a container whose create request may still be in flight at the engine."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                self.client.api.remove_container(name, force=True, v=True)
            except docker.errors.NotFound:
                time.sleep(0.2)
                continue
            except (docker.errors.APIError, requests.exceptions.RequestException):
                pass
            return

    def _remove(self, cid: str) -> bool:
        """Force-remove and confirm the engine no longer knows the container."""
        api = self.client.api
        for attempt in range(5):
            try:
                api.remove_container(cid, force=True, v=True)
            except docker.errors.NotFound:
                return True
            except docker.errors.APIError:
                time.sleep(0.2 * (attempt + 1))  # "removal already in progress"
            try:
                api.inspect_container(cid)
            except docker.errors.NotFound:
                return True
        return False

    # -- cleanup ---------------------------------------------------------------
    def managed_containers(self) -> list[tuple[str, str, dict[str, str]]]:
        """(id, name, labels) of every container carrying the cyclebox label."""
        rows = self.client.api.containers(all=True, filters={"label": f"{MANAGED_LABEL}=1"})
        return [(r["Id"], (r.get("Names") or ["?"])[0].lstrip("/"), dict(r.get("Labels") or {}))
                for r in rows]

    def remove(self, cid: str) -> bool:
        return self._remove(cid)

    def leftovers(self, run_id: str) -> list[str]:
        """Remove every container still labelled with ``run_id``; return their names.
        While the run stops (:meth:`stopping`), an engine that does not answer is asked
        once: SandboxError, and every later call refuses at once."""
        if self._silent:
            raise self._unchecked()
        try:
            rows = self.managed_containers()
        except requests.exceptions.Timeout:
            if self._stop_timeout is None:
                raise
            self._go_silent()
            raise self._unchecked() from None
        found: list[str] = []
        slow = 0
        for cid, name, labels in rows:
            if labels.get(f"{LABEL_PREFIX}.run_id") != run_id:
                continue
            if self._silent:
                found.append(f"{name} (not removed: the engine stopped answering; "
                             "`cyclebox gc` removes it)")
                continue
            try:
                if self.remove(cid):
                    found.append(name)
            except requests.exceptions.Timeout:
                if self._stop_timeout is None:
                    raise
                # one slow removal (a loaded engine) neither ends the sweep nor silences
                # the engine: the others are still removed, this one is named; a second
                # one is a hung engine, asked no more
                found.append(f"{name} (removal not confirmed: the engine did not answer "
                             f"within {self._stop_timeout:g} s; `cyclebox gc` removes it)")
                slow += 1
                if slow >= SLOW_REMOVALS:
                    self._go_silent()
        return found

    def _go_silent(self) -> None:
        """The engine is hung: asked no more. The case threads' own calls (a removal, an
        inspect) now fail at once too, so the process ends soon after its verdict and
        receipt are written."""
        self._silent = True
        self.client.api.timeout = SILENT_TIMEOUT_S

    def _unchecked(self) -> SandboxError:
        return SandboxError(f"the engine did not answer within {self._stop_timeout:g} s "
                            "while the run stopped; its containers were not checked "
                            "(`cyclebox gc` removes them once the engine answers)")

    def sweep(self, *, only_orphans: bool = True, dry_run: bool = False) -> list[SweepResult]:
        """Labelled containers (see :func:`runner.isolation.gc.sweep_containers`), then the
        input staging copies of controllers that are gone."""
        from runner.isolation.gc import sweep_containers, sweep_staging_dirs

        return [*sweep_containers(self, only_orphans=only_orphans, dry_run=dry_run),
                *sweep_staging_dirs(staging_base(), owner_name=STAGING_OWNER,
                                    prefix=STAGING_PREFIX, dry_run=dry_run,
                                    remove_base=bool(os.environ.get(STAGING_ENV))),
                *sweep_staging_dirs(legacy_staging_base(), owner_name=STAGING_OWNER,
                                    dry_run=dry_run)]

    # -- images ----------------------------------------------------------------
    def image_id(self, ref: str) -> str | None:
        try:
            return str(self.client.api.inspect_image(ref)["Id"])
        except docker.errors.ImageNotFound:
            return None

    def image_size(self, ref: str) -> int:
        return int(self.client.api.inspect_image(ref)["Size"])

    def save_image(self, image_id: str, chunk_bytes: int) -> Iterator[bytes]:
        """``docker save`` of one image by its id (the tar names no tag), streamed in
        pieces of at most ``chunk_bytes``; SandboxError when the engine refuses."""
        try:
            yield from self.client.api.get_image(image_id, chunk_size=chunk_bytes)
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            raise SandboxError(f"docker save {image_id} failed: {exc}") from None

    def load_image(self, archive: Path) -> None:
        """``docker load`` of a saved tar, streamed from the file (never read whole)."""
        try:
            with archive.open("rb") as f:
                for msg in self.client.api.load_image(f):
                    if isinstance(msg, dict) and msg.get("error"):
                        raise SandboxError(f"docker load failed: {str(msg['error'])[:500]}")
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            raise SandboxError(f"docker load failed: {exc}") from None

    def tag_image(self, image_id: str, ref: str) -> None:
        """Give ``image_id`` the name ``ref`` (``repo[:tag]``; a digest name is refused)."""
        repo, tag = docker.utils.parse_repository_tag(ref)
        if tag is not None and tag.startswith("sha256:"):
            raise SandboxError(f"{ref} names a digest; an image cannot be tagged with it")
        try:
            self.client.api.tag(image_id, repo, tag or "latest")
        except docker.errors.APIError as exc:
            raise SandboxError(f"docker tag {image_id} {ref} failed: {exc}") from None

    def images_with_label(self, label: str) -> list[dict[str, Any]]:
        return list(self.client.api.images(filters={"label": label}))

    def build(self, context: Path, tag: str, *, buildargs: dict[str, str],
              labels: dict[str, str], nocache: bool = False,
              drop_other_stages: bool = False) -> Iterator[str]:
        """Build ``context/Dockerfile`` with no network; yield log lines; raise on error.

        ``drop_other_stages``: the Dockerfile's earlier stages carry
        ``LABEL io.cyclebox.build_stage=${BUILD_NONCE}`` (a build argument made fresh here,
        so no other build shares their step images); afterwards, built or failed, the
        untagged images with this build's nonce that are not layers of ``tag`` are
        removed. The legacy builder keeps every step as an image that nothing removes (a
        derived analyst image's build stage holds its wheels and .debs twice over)."""
        nonce = secrets.token_hex(12) if drop_other_stages else ""
        args = {**buildargs, BUILD_NONCE_ARG: nonce} if drop_other_stages else buildargs
        try:
            for chunk in self.client.api.build(
                path=str(context), tag=tag, buildargs=args, labels=labels,
                network_mode="none", rm=True, forcerm=True, pull=False, decode=True,
                nocache=nocache,
            ):
                if "error" in chunk:
                    raise SandboxError(f"image build for {tag} failed: {chunk['error'].strip()}")
                line = chunk.get("stream")
                if line and line.strip():
                    yield line.rstrip()
        except docker.errors.APIError as exc:
            raise SandboxError(f"image build for {tag} failed: {exc.explanation or exc}") from None
        finally:
            if drop_other_stages:
                self._drop_stage_images(tag, nonce)

    def _drop_stage_images(self, tag: str, nonce: str) -> None:
        """Remove the untagged images labelled with this build's ``nonce`` that are not
        layers of ``tag``, one at a time, in passes while one removes something (what the
        engine keeps refusing stays)."""
        api = self.client.api
        try:
            final = {str(h.get("Id", "")) for h in api.history(tag)}
        except (docker.errors.APIError, requests.exceptions.RequestException):
            final = set()  # no such image: the build failed, none of its steps is kept
        try:
            found = api.images(all=True, filters={"label": f"{BUILD_STAGE_LABEL}={nonce}"})
        except (docker.errors.APIError, requests.exceptions.RequestException):
            return
        left: list[str] = []
        for img in found:
            iid = str(img.get("Id", ""))
            tags = [t for t in (*(img.get("RepoTags") or ()), *(img.get("RepoDigests") or ()))
                    if t not in ("<none>:<none>", "<none>@<none>")]
            if iid and iid not in final and not tags:
                left.append(iid)
        # leaves first; steps of one second share a timestamp, so pass again while a pass
        # removes something (a parent goes once its child has)
        while left:
            kept = []
            for iid in left:
                try:
                    api.remove_image(iid, force=False, noprune=True)
                except docker.errors.NotFound:
                    pass
                except (docker.errors.APIError, requests.exceptions.RequestException):
                    kept.append(iid)
            if len(kept) == len(left):
                return
            left = kept
