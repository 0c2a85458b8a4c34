"""The one way a role container is started: role policy + gateway + spec + run.

Every caller (the cycle's stages, ``cyclebox sandbox exec``, standalone apply, training,
the doctor's probes, the test fixtures) hands the launcher the role's policy, the run id,
the command and its inputs; the launcher binds the role's gateway socket when the policy
names an upstream and a gateway is given, builds the :class:`RunSpec` under the policy
(:func:`runner.isolation.roles.role_spec`) and runs it on the :class:`Sandbox` it was given.
Nothing here knows which backend runs the container.

A bound container also gets the environment unmodified SDKs read (:func:`endpoint_env`):
their base URLs point at the holder's loopback relay (:mod:`sandbox.holder`), their key
is the binding's per-run, per-role token. The environment lives in the :class:`RunSpec`
only, which no plan, record, receipt or report holds (a :class:`RunRecord` has no env).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from runner.errors import ConfigError
from runner.isolation.policy import RolePolicy
from runner.isolation.roles import fresh_output_dir, role_spec
from runner.isolation.sandbox import (
    Mount,
    OutputCallback,
    PreparedRun,
    RunRecord,
    RunSpec,
    Sandbox,
    warm_refusal,
)
from sandbox.holder import EGRESS_PORT, RELAY_HOST, RELAY_PORT

STAGE_LABEL = "io.cyclebox.stage"
CASE_LABEL = "io.cyclebox.case"
TRIAL_LABEL = "io.cyclebox.trial"
RELAY_URL = f"http://{RELAY_HOST}:{RELAY_PORT}"
"""The in-container model endpoint (the holder's loopback relay to the gateway socket)."""
ENDPOINT_ENV_NAMES = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY",
                      "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "CYCLEBOX_GATEWAY_URL")


def endpoint_env(token: str) -> dict[str, str]:
    """What unmodified OpenAI and Anthropic clients read, pointing at the relay; the key
    is the per-run, per-role gateway token, never a provider key."""
    return {
        "OPENAI_BASE_URL": f"{RELAY_URL}/v1",
        "OPENAI_API_BASE": f"{RELAY_URL}/v1",  # older frameworks (openai<1, langchain)
        "OPENAI_API_KEY": token,
        "ANTHROPIC_BASE_URL": RELAY_URL,  # the SDK appends /v1/messages itself
        "ANTHROPIC_API_KEY": token,
        "CYCLEBOX_GATEWAY_URL": RELAY_URL,
        **OFFLINE_ENV,
        **EGRESS_ENV,
        **TRUST_ENV,
    }


OFFLINE_ENV = {
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
"""Frameworks' own switches for remote side channels that cannot work in a container
without a network: the OpenAI Agents SDK's trace export (it posts to api.openai.com,
ignoring OPENAI_BASE_URL, with the key it was given, and retries for ~14 s as the agent
exits) and litellm's model cost map download (three tries, 8-18 s at import, then its
bundled copy). Without them each attempt still fails closed (no network); these only
spare every case the time their retries cost. No agent code, model call or result
changes."""


OFFLINE_ENV.update({
    # Claude Code's own switches (its env-vars page): usage telemetry, the auto-updater,
    # error reports, and everything else "non-essential" (release notes, feedback
    # surveys, metrics). Measured on 2.1.332: without them it opens three connections
    # to api.anthropic.com besides the model calls; with them, none.
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
})
EGRESS_URL = f"http://{RELAY_HOST}:{EGRESS_PORT}"
"""The holder's deny-all proxy (:mod:`sandbox.holder`): refuses with 403, names the host."""
EGRESS_ENV = {
    **{name: EGRESS_URL for name in ("HTTP_PROXY", "HTTPS_PROXY",
                                     "http_proxy", "https_proxy")},
    "NO_PROXY": f"{RELAY_HOST},localhost",
    "no_proxy": f"{RELAY_HOST},localhost",
}
"""Every client that honours the proxy variables (curl, Python's urllib/requests/httpx,
Rust's reqwest in Codex, Claude Code's fetch) sends any request other than to the
gateway's loopback endpoint to the holder's deny-all proxy: it fails at once with a
403, and the run record names the host (``egress_refused``), instead of a DNS error
the record never sees or a client waiting for a network that will not come. A client
that ignores them still has no network: it fails closed, unnamed.

No ``ALL_PROXY``: every client above takes the scheme's own variable for http and https
(the only schemes the proxy speaks), and httpx builds one more transport, with its own
CA bundle load (~26 ms in the analyst image), for each proxy variable it finds: an
``ALL_PROXY`` cost every Python SDK client that much at construction, every case. It
named only a client reading nothing else (curl for a scheme other than http and https);
that one now fails closed, unnamed."""


TRUST_ENV = {"SSL_CERT_DIR": "/etc/ssl/certs"}
"""The image's trust store named as the hashed directory it also is (Debian's
ca-certificates; python:3.11-slim has it too), which OpenSSL reads a certificate at a
time when a handshake asks, instead of the whole bundle, parsed again for every
transport a Python SDK client builds: ``openai.OpenAI()`` and ``anthropic.Anthropic()``
build three (their own and one per proxy variable of :data:`EGRESS_ENV`), measured at
~110 ms of CPU per client in the analyst image without it and ~1 ms with it, every
case. The same certificates either way, and no handshake can happen in a role container
(no network; the deny-all proxy refuses ``CONNECT``): only the start is cheaper. A
policy's own ``SSL_CERT_FILE`` still wins (clients read it first)."""


class GatewayBinding(Protocol):
    """A role's bound gateway socket (:class:`runner.gateway.server.Binding`)."""

    armed: bool
    """False: every call is refused (``not_handed_over``), until the case is handed over."""

    def mount(self) -> Mount: ...

    def env(self) -> dict[str, str]: ...


class GatewayBinder(Protocol):
    """What the launcher needs of :class:`runner.gateway.server.Gateway`."""

    def bound(self, role: str, *, stage: str, uid: int, case: str | None = None,
              trial: int | None = None) -> AbstractContextManager[GatewayBinding]: ...


def output_dir(policy: RolePolicy, path: Path) -> Path:
    """A fresh output directory made for ``policy``'s role user (never an existing one)."""
    return fresh_output_dir(path, uid=policy.uid)


def placement_labels(stage: str | None, case: str | None = None,
                     trial: int | None = None) -> dict[str, str]:
    """Container labels saying where in a run a container belongs (stage, case, trial)."""
    labels: dict[str, str] = {}
    if stage is not None:
        labels[STAGE_LABEL] = stage
    if case is not None:
        labels[CASE_LABEL] = case
        labels[TRIAL_LABEL] = str(trial)
    return labels


def build_spec(policy: RolePolicy, *, role: str, run_id: str, image: str,
               command: Sequence[str], mounts: Sequence[Mount] = (),
               output_dir: Path | None = None, output_target: str = "/out",
               env: Mapping[str, str] | None = None,
               labels: Mapping[str, str] | None = None) -> RunSpec:
    """The run spec for one role command under its policy (no gateway mount)."""
    spec = role_spec(policy, role=role, run_id=run_id, image=image, command=command,
                     mounts=mounts, output_dir=output_dir, env=dict(env or {}),
                     labels=dict(labels or {}))
    if output_target != spec.output_target:
        spec = spec.model_copy(update={"output_target": output_target})
    return spec


def _bound_spec(stack: contextlib.ExitStack, policy: RolePolicy, *, role: str, run_id: str,
                image: str, command: Sequence[str], mounts: Sequence[Mount],
                output_dir: Path | None, output_target: str,
                env: Mapping[str, str] | None, gateway: GatewayBinder | None,
                stage: str | None, case: str | None, trial: int | None,
                armed: bool = True) -> tuple[RunSpec, GatewayBinding | None]:
    """The spec of one role container and its gateway binding (if any, entered on
    ``stack``; with ``armed=False`` it refuses every call until armed)."""
    all_mounts = list(mounts)
    all_env = dict(env or {})
    binding: GatewayBinding | None = None
    if policy.upstream and gateway is not None:
        binding = stack.enter_context(gateway.bound(
            role, stage=stage or role, uid=policy.uid, case=case, trial=trial))
        binding.armed = armed  # before any container exists
        all_mounts.append(binding.mount())
        all_env.update(binding.env())
    spec = build_spec(policy, role=role, run_id=run_id, image=image, command=command,
                      mounts=all_mounts, output_dir=output_dir, output_target=output_target,
                      env=all_env, labels=placement_labels(stage, case, trial))
    return spec, binding


def launch(sandbox: Sandbox, policy: RolePolicy, *, role: str, run_id: str, image: str,
           command: Sequence[str], mounts: Sequence[Mount] = (),
           output_dir: Path | None = None, output_target: str = "/out",
           env: Mapping[str, str] | None = None, gateway: GatewayBinder | None = None,
           stage: str | None = None, case: str | None = None, trial: int | None = None,
           on_output: OutputCallback | None = None,
           cancel: threading.Event | None = None) -> RunRecord:
    """Run ``command`` in a ``role`` container under ``policy`` on ``sandbox``.

    When the policy names an upstream and ``gateway`` is given, a socket for this one
    container is bound (owned by the role's uid) for the duration of the run and mounted
    read-only, and the binding's environment (:func:`endpoint_env`) is set over ``env``
    and the policy's; without a gateway the role has no model access at all. ``stage``,
    ``case`` and ``trial`` become container labels and key the gateway's call records.
    """
    with contextlib.ExitStack() as stack:
        spec, _ = _bound_spec(stack, policy, role=role, run_id=run_id, image=image,
                              command=command, mounts=mounts, output_dir=output_dir,
                              output_target=output_target, env=env, gateway=gateway,
                              stage=stage, case=case, trial=trial)
        return sandbox.run(spec, on_output=on_output, cancel=cancel)


def prepare(sandbox: Sandbox, policy: RolePolicy, *, role: str, run_id: str, image: str,
            command: Sequence[str], mounts: Sequence[Mount] = (),
            output_dir: Path | None = None, output_target: str = "/out",
            env: Mapping[str, str] | None = None, gateway: GatewayBinder | None = None,
            stage: str | None = None, case: str | None = None,
            trial: int | None = None, warm: Sequence[str] = (),
            cancel: threading.Event | None = None) -> PreparedRun:
    """What :func:`launch` does up to the role command: the gateway bound, the spec built
    and ``sandbox.prepare(spec)`` called. The binding lives until the returned run has
    run or is discarded (whichever comes first); a failed prepare releases it at once.
    ``warm``: modules the command's interpreter imports ahead of the case (a warm start,
    :attr:`RunSpec.warm`); the gateway refuses the binding's calls until the hand-over.
    ``cancel``: the run is stopping (see :meth:`Sandbox.prepare`); a prepare waiting on
    the engine or the holder gives up and removes what it created."""
    why = warm_refusal(command, warm)
    if why is not None:
        raise ConfigError(why, field="project.warm",
                          fix="warm only an entry [python, SCRIPT, ...] or "
                          "[python, -m, MODULE, ...], or remove project.warm")
    with contextlib.ExitStack() as stack:
        spec, binding = _bound_spec(stack, policy, role=role, run_id=run_id, image=image,
                                    command=command, mounts=mounts, output_dir=output_dir,
                                    output_target=output_target, env=env, gateway=gateway,
                                    stage=stage, case=case, trial=trial, armed=not warm)
        if warm:
            spec = spec.model_copy(update={"warm": tuple(warm)})
        prepared = sandbox.prepare(spec, cancel=cancel)
        return BoundRun(prepared, stack.pop_all(), binding)


class BoundRun:
    """A :class:`PreparedRun` holding its gateway binding: released when the container
    has run (after its record is back) or is discarded, exactly once."""

    def __init__(self, prepared: PreparedRun, binding: contextlib.ExitStack,
                 gateway: GatewayBinding | None = None) -> None:
        self._prepared = prepared
        self._binding = binding
        self._gateway = gateway
        self._lock = threading.Lock()
        self._released = False

    @property
    def spec(self) -> RunSpec:
        return self._prepared.spec

    def _release(self, exc: BaseException | None = None) -> None:
        """Leave the binding once; an exception is passed in as :func:`launch`'s block
        would pass it (the gateway then cancels in-flight calls without its grace)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        if exc is None:
            self._binding.close()
        else:
            self._binding.__exit__(type(exc), exc, exc.__traceback__)

    def run(self, *, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None,
            ended: Callable[[], None] | None = None,
            handing: Callable[[], None] | None = None) -> RunRecord:
        def arm_then() -> None:
            self._arm()
            if handing is not None:
                handing()

        try:
            rec = self._prepared.run(on_output=on_output, cancel=cancel, ended=ended,
                                     handing=arm_then)
        except BaseException as exc:
            self._release(exc)
            raise
        self._release()
        return rec

    def _arm(self) -> None:
        """Just before the hand-over (never without one): calls may come from now on."""
        if self._gateway is not None:
            self._gateway.armed = True

    def discard(self) -> None:
        try:
            self._prepared.discard()
        finally:
            self._release()
