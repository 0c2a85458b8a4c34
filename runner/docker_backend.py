"""Docker implementation of :class:`runner.sandbox.Sandbox`; the only module importing docker.

Invariants: a container is created from an image id or local tag and never pulled;
its arguments come only from :func:`runner.hardening.create_kwargs`; output is
streamed from an attach made before start (the engine keeps no log copy) and
counted against the cap; every container is removed in ``finally`` and removal
is confirmed by asking the engine, not assumed.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions

from runner.collect import dir_usage
from runner.errors import PrerequisiteError, SandboxError
from runner.hardening import MANAGED_LABEL, create_kwargs
from runner.owner import Owner, current_owner
from runner.sandbox import OutputCallback, RunFlags, RunRecord, RunSpec, classify_stop

TAIL_BYTES = 64 * 1024
WATCH_INTERVAL_S = 0.2


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


class _Tail:
    """Counts a byte stream and keeps its last TAIL_BYTES."""

    def __init__(self) -> None:
        self.total = 0
        self.buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > TAIL_BYTES:
            del self.buf[: len(self.buf) - TAIL_BYTES]

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


class DockerSandbox:
    """Runs role containers on the local Docker engine under the isolation contract."""

    def __init__(self, client: docker.DockerClient | None = None,
                 owner: Owner | None = None) -> None:
        self.client = client or connect()
        self.owner = owner or current_owner()

    # -- running ---------------------------------------------------------------
    def run(self, spec: RunSpec, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None) -> RunRecord:
        """Run one container to completion or limit; always remove it.

        ``cancel`` set before the container starts: it is removed unstarted and
        SandboxError raised (a caller stopping a run sweeps the containers that exist;
        this closes the gap for one whose creation was in flight during the sweep).
        """
        kwargs = create_kwargs(spec, self.owner, secrets.token_hex(4))
        api = self.client.api
        started = time.monotonic()
        out, err = _Tail(), _Tail()
        stop = threading.Event()
        stream_exceeded = threading.Event()
        dir_exceeded = threading.Event()
        timed_out = False
        exit_code: int | None = None
        oom = False
        image_id = spec.image
        cid: str | None = None
        try:
            try:
                container = self.client.containers.create(**kwargs)
            except docker.errors.ImageNotFound:
                raise SandboxError(f"image {spec.image} for role {spec.role} is not present "
                                   "locally. Fix: cyclebox images build") from None
            except docker.errors.APIError as exc:
                raise SandboxError(f"engine refused to create the {spec.role} container: "
                                   f"{exc.explanation or exc}") from None
            except BaseException:
                # Interrupted (a signal) with the request sent: the engine may still be
                # creating it, and there is no id to remove yet; remove it by name.
                self._remove_late(str(kwargs["name"]))
                raise
            cid = container.id
            if cancel is not None and cancel.is_set():
                raise SandboxError(f"{spec.role} container not started: the run is stopping")
            stream = api.attach(cid, stdout=True, stderr=True, stream=True, logs=False,
                                demux=True)

            def kill(flag: threading.Event) -> None:
                # Never kill from the pump thread itself: the engine's kill waits for
                # the container to stop, which waits for its output to be drained.
                flag.set()

                def _kill() -> None:
                    with contextlib.suppress(docker.errors.APIError,
                                             requests.exceptions.RequestException):
                        api.kill(cid)

                threading.Thread(target=_kill, daemon=True).start()

            def pump() -> None:
                cap = spec.stdout_cap_bytes
                try:
                    for o, e in stream:
                        live = on_output is not None and not stream_exceeded.is_set()
                        if o:
                            out.add(o)
                            if live:
                                on_output("stdout", o)  # type: ignore[misc]
                        if e:
                            err.add(e)
                            if live:
                                on_output("stderr", e)  # type: ignore[misc]
                        if out.total + err.total > cap and not stream_exceeded.is_set():
                            kill(stream_exceeded)
                except (requests.exceptions.RequestException, OSError, ValueError):
                    pass  # stream closed under us (kill/remove); counts stand as read

            def watch(root: Path) -> None:
                while not stop.wait(WATCH_INTERVAL_S):
                    used, _ = dir_usage(root)
                    if used > spec.output_cap_bytes:
                        kill(dir_exceeded)
                        return

            threads = [threading.Thread(target=pump, daemon=True)]
            if spec.output_dir is not None:
                threads.append(threading.Thread(target=watch, args=(spec.output_dir,), daemon=True))
            try:
                api.start(cid)
            except docker.errors.APIError as exc:
                raise SandboxError(f"engine could not start the {spec.role} container: "
                                   f"{exc.explanation or exc}") from None
            for t in threads:
                t.start()
            remaining = max(0.1, spec.timeout_s - (time.monotonic() - started))
            try:
                result = api.wait(cid, timeout=remaining)
                exit_code = int(result.get("StatusCode", -1))
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                timed_out = True
                with contextlib.suppress(docker.errors.APIError):
                    api.kill(cid)
                with contextlib.suppress(Exception):
                    exit_code = int(api.wait(cid, timeout=10).get("StatusCode", -1))
            stop.set()
            threads[0].join(timeout=5)
            state = api.inspect_container(cid)
            oom = bool(state.get("State", {}).get("OOMKilled"))
            image_id = str(state.get("Image", spec.image))
        finally:
            stop.set()
            confirmed = self._remove(cid) if cid else True
        flags = RunFlags(exit_code=exit_code, oom_killed=oom, timed_out=timed_out,
                         stream_exceeded=stream_exceeded.is_set(),
                         output_dir_exceeded=dir_exceeded.is_set(),
                         cleanup_confirmed=confirmed)
        reason, detail = classify_stop(flags)
        return RunRecord(
            run_id=spec.run_id, role=spec.role, image_id=image_id,
            container_name=str(kwargs["name"]), exit_code=exit_code, stop_reason=reason,
            detail=detail, wall_s=round(time.monotonic() - started, 3),
            stdout_bytes=out.total, stderr_bytes=err.total,
            stdout_tail=out.text(), stderr_tail=err.text(), cleanup_confirmed=confirmed,
            labels=dict(kwargs["labels"]),
        )

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

    def sweep(self, *, only_orphans: bool = True) -> list[str]:
        from runner.gc import sweep_containers

        return [r.name for r in sweep_containers(self, only_orphans=only_orphans) if r.removed]

    # -- images ----------------------------------------------------------------
    def image_id(self, ref: str) -> str | None:
        try:
            return str(self.client.api.inspect_image(ref)["Id"])
        except docker.errors.ImageNotFound:
            return None

    def image_size(self, ref: str) -> int:
        return int(self.client.api.inspect_image(ref)["Size"])

    def images_with_label(self, label: str) -> list[dict[str, Any]]:
        return list(self.client.api.images(filters={"label": label}))

    def build(self, context: Path, tag: str, *, buildargs: dict[str, str],
              labels: dict[str, str], nocache: bool = False) -> Iterator[str]:
        """Build ``context/Dockerfile`` with no network; yield log lines; raise on error."""
        try:
            for chunk in self.client.api.build(
                path=str(context), tag=tag, buildargs=buildargs, labels=labels,
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
