"""``cyclebox sandbox exec``: one command in one role container, under that role's policy."""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from runner.cli.options import JsonOpt, PoliciesOpt
from runner.cli.output import err
from runner.errors import EXIT_ENGINE, EXIT_OUTPUT_REFUSED, ConfigError
from runner.isolation.sandbox import RunRecord, StopReason
from runner.paths import default_policies, default_upstreams, state_dir
from runner.termsafe import StreamSanitizer, emit_json_text, safe

app = typer.Typer(no_args_is_help=True, help="Run commands in role containers.")

STOP_CODES = {StopReason.TIMEOUT: 124, StopReason.OUTPUT_LIMIT: 125, StopReason.OOM: 137,
              StopReason.CLEANUP_UNCONFIRMED: 126, StopReason.INVALID_OUTPUT: EXIT_OUTPUT_REFUSED}
"""Exit codes of ``sandbox exec`` beyond the command's own (as ``timeout(1)`` and shells)."""


def exec_exit_code(record: RunRecord) -> int:
    """The command's own exit code, or the stop reason's; 6 when the engine gave none."""
    if record.stop_reason in STOP_CODES:
        return STOP_CODES[record.stop_reason]
    return record.exit_code if record.exit_code is not None else EXIT_ENGINE


@app.command("exec", context_settings={"allow_extra_args": True,
                                       "ignore_unknown_options": True})
def sandbox_exec(
    ctx: typer.Context,
    role: Annotated[str, typer.Option("--role", help="Role whose policy and image to use.")],
    mount: Annotated[list[str] | None, typer.Option(
        "--mount", help="SRC:DST[:ro|rw]; ro by default; rw only onto an empty directory.")] = None,
    out_dir: Annotated[Path | None, typer.Option(
        "--out", help="Fresh host directory mounted at /out "
                      "(default: build/runs/<id>/out).")] = None,
    policies: PoliciesOpt = default_policies(),
    upstreams: Annotated[Path, typer.Option(
        "--upstreams", help="Upstreams file (schema: 1, upstreams: {...}) for a role that "
                            "reaches a model.")] = default_upstreams(),
    json_out: JsonOpt = False,
) -> None:
    """Run CMD in a ROLE container under that role's policy; exit with its exit code.

    When the role's policy names a model upstream, the gateway is attached: its socket
    and token are mounted read-only at /run/cyclebox/gateway and every call is recorded
    under build/runs/<id>/gateway/.

    Usage: cyclebox sandbox exec --role analyst -- python -c 'print(1)'.
    Exit codes beyond the command's own: 124 timeout, 125 output limit,
    137 OOM, 126 cleanup unconfirmed, 7 output refused, 6 no exit code from the engine.
    """
    from runner.cli.engine import role_image, sandbox
    from runner.gateway.calllog import CallLog
    from runner.gateway.config import load_upstreams
    from runner.gateway.server import Gateway
    from runner.isolation.launcher import launch, output_dir
    from runner.isolation.policy import load_policies
    from runner.isolation.roles import check_mount_flags, parse_mount_flag
    from runner.outdir import refuse_inside_run

    command = list(ctx.args)
    if not command:
        raise ConfigError("no command given", field="CMD",
                          fix="cyclebox sandbox exec --role ROLE -- CMD...")
    pols = load_policies(policies)
    if role not in pols.roles:
        raise ConfigError(f"no role {role!r} in the policy file", path=str(policies),
                          field="--role", fix=f"one of {sorted(pols.roles)}")
    policy = pols.roles[role]
    mounts = [parse_mount_flag(m) for m in (mount or [])]
    check_mount_flags(policy, mounts, output_target="/out")
    run_id = f"exec-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    run_dir = state_dir() / "runs" / run_id
    odir = out_dir or run_dir / "out"
    refuse_inside_run(odir)
    image = role_image(role)
    # the upstreams are read before --out is made: a refusal leaves nothing behind
    loaded = load_upstreams(upstreams) if policy.upstream else None
    # made as given (a link at --out, dangling or not, is refused, never followed)
    output_dir(policy, odir.resolve() if odir.name in ("", ".", "..")
               else odir.parent.resolve() / odir.name)

    # The command's output is relayed live, but escaped: it is a container's bytes.
    decoders = {"stdout": StreamSanitizer(), "stderr": StreamSanitizer()}

    def stream(name: str, chunk: bytes) -> None:
        if json_out:
            return
        target = sys.stdout if name == "stdout" else sys.stderr
        target.write(decoders[name].feed(chunk))
        target.flush()

    with contextlib.ExitStack() as stack:
        gateway = stack.enter_context(Gateway(
            run_dir, run_id, loaded, {role: policy.upstream})
        ) if policy.upstream and loaded is not None else None
        record = launch(sandbox(), policy, role=role, run_id=run_id, image=image,
                        command=command, mounts=mounts, output_dir=odir.resolve(),
                        gateway=gateway, stage="exec", on_output=stream)
    if policy.upstream and not json_out:
        n = len(CallLog.reader(run_dir / "gateway").records())
        err.print(f"[dim]gateway ({safe(policy.upstream)}): {n} call(s) recorded in "
                  f"{safe(run_dir / 'gateway')}[/]", highlight=False)
    if json_out:
        emit_json_text(record.model_dump_json())
    elif record.stop_reason is not StopReason.OK:
        err.print(f"[yellow]cyclebox:[/] {safe(record.stop_reason.value)}: "
                  f"{safe(record.detail)} (output dir {safe(odir)})", highlight=False)
    raise typer.Exit(exec_exit_code(record))
