"""The ``cyclebox`` command line (typer). Exit codes: see ``cyclebox --help``."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from runner import __version__, interrupts
from runner.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OUTPUT_REFUSED,
    EXIT_TABLE,
    EXIT_UNEXPECTED,
    CycleboxError,
)
from runner.failures import classify
from runner.paths import default_policies, state_dir
from runner.termsafe import StreamSanitizer, emit_json, emit_json_text, safe

app = typer.Typer(
    name="cyclebox", no_args_is_help=True, add_completion=False,
    help="Run LLM-agent improvement cycles in hardened containers.\n\n"
         "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_TABLE) + ".",
)
images_app = typer.Typer(no_args_is_help=True, help="Build and list the role images.")
sandbox_app = typer.Typer(no_args_is_help=True, help="Run commands in role containers.")
app.add_typer(images_app, name="images")
app.add_typer(sandbox_app, name="sandbox")

out = Console()
err = Console(stderr=True)

PoliciesOpt = Annotated[Path, typer.Option("--policies", help="Role policy file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def report_error(message: str) -> None:
    """Print one error line on stderr; the only place the CLI prints an error."""
    err.print(f"[bold red]error:[/] {safe(message, 8000)}", highlight=False, soft_wrap=True)


def _error_log(exc: BaseException) -> Path | None:
    """Write the traceback to ``<state dir>/logs/error-<ts>-<pid>.log``; None if it cannot."""
    ts = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    path = state_dir() / "logs" / f"error-{ts}-{os.getpid()}.log"
    text = "".join(traceback.format_exception(exc))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8", "backslashreplace"))
    except OSError:
        return None
    return path


def exit_for(exc: BaseException) -> int:
    """The one mapping from an exception to an exit code; prints one line on stderr.

    Deliberate errors print their message; an unexpected error prints one line naming
    the log file that holds the traceback (never the traceback itself).
    """
    failure = classify(exc)
    if failure.reason == "interrupted":
        report_error("interrupted; containers started by this process were removed")
    elif failure.reason == "cyclebox_error":
        report_error(str(exc))
    else:
        log = _error_log(exc)
        where = f"traceback in {log}" if log else "the traceback could not be written"
        report_error(f"{failure.reason}: {failure.message} ({where})")
    return failure.exit_code


def _fail(exc: CycleboxError) -> NoReturn:
    raise typer.Exit(exit_for(exc))


def _run_id(prefix: str) -> str:
    return f"{prefix}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


@app.command()
def version() -> None:
    """Print the cyclebox version."""
    out.print(__version__)


@app.command()
def doctor(policies: PoliciesOpt = default_policies(), json_out: JsonOpt = False,
           probe: Annotated[bool, typer.Option(help="Run a probe container to check that "
                                                    "limits are enforced.")] = True) -> None:
    """Check the engine, its limits, the role images and free disk; exit non-zero with the fix."""
    from runner.isolation.docker.doctor import run_checks
    from runner.isolation.registry import get_sandbox

    checks = run_checks(policies, sandbox=lambda: get_sandbox(timeout=10), probe=probe)
    if json_out:
        emit_json([c.as_dict() for c in checks])
    else:
        table = Table(title="cyclebox doctor", show_lines=False)
        for col in ("check", "status", "detail"):
            table.add_column(col, overflow="fold")
        for c in checks:
            status = "[green]ok[/]" if c.ok else "[red]FAIL[/]"
            detail = safe(c.detail) + (f"\n[yellow]fix:[/] {safe(c.fix)}"
                                       if (not c.ok and c.fix) else "")
            table.add_row(safe(c.name), status, detail)
        out.print(table)
    if not all(c.ok for c in checks):
        raise typer.Exit(5)


@images_app.command("build")
def images_build(role: Annotated[list[str] | None, typer.Option(
        "--role", help="Role to build (repeatable); all roles when omitted.")] = None,
        json_out: JsonOpt = False) -> None:
    """Build role images offline (--network none), reusing any whose inputs are unchanged."""
    from runner.isolation.docker.images import build_roles
    from runner.isolation.policy import ROLES

    roles = list(role) if role else list(ROLES)
    verbose = os.environ.get("CYCLEBOX_VERBOSE") == "1"
    try:
        with err.status("building images") as status:
            def log(line: str) -> None:
                if line.startswith(("building", "downloading", "bootstrapping")) or verbose:
                    err.print(safe(line), highlight=False)
                status.update(safe(line, 100, newlines=False))
            built = build_roles(roles, log)
    except CycleboxError as exc:
        _fail(exc)
    _print_images(built, json_out)


@images_app.command("list")
def images_list(json_out: JsonOpt = False) -> None:
    """List the role images recorded in the image lock, with ids and sizes."""
    from runner.isolation.docker.images import read_lock

    _print_images(list(read_lock().values()), json_out, build_columns=False)


def _print_images(rows: list[Any], json_out: bool, *, build_columns: bool = True) -> None:
    from dataclasses import asdict

    if json_out:
        emit_json([asdict(r) for r in rows])
        return
    table = Table(title="role images")
    # Whether and how long an image was built only means something right after a build.
    cols = ("role", "tag", "id", "size") + (("built now", "seconds") if build_columns else ())
    for col in cols:
        table.add_column(col)
    for r in rows:
        row = [safe(r.role), safe(r.tag), safe(r.id[:19]), f"{r.size_bytes / 1e6:.0f} MB"]
        if build_columns:
            row += ["yes" if r.built else "no (unchanged)", f"{r.seconds:.1f}"]
        table.add_row(*row)
    out.print(table)


@sandbox_app.command(
    "exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sandbox_exec(
    ctx: typer.Context,
    role: Annotated[str, typer.Option("--role", help="Role whose policy and image to use.")],
    mount: Annotated[list[str] | None, typer.Option(
        "--mount", help="SRC:DST[:ro|rw]; ro by default; rw only onto an empty directory.")] = None,
    out_dir: Annotated[Path | None, typer.Option(
        "--out", help="Fresh host directory mounted at /out "
                      "(default: build/runs/<id>/out).")] = None,
    policies: PoliciesOpt = default_policies(),
    json_out: JsonOpt = False,
) -> None:
    """Run CMD in a ROLE container under that role's policy; exit with its exit code.

    When the role's policy names a model upstream, the gateway is attached: its socket
    and token are mounted read-only at /run/cyclebox/gateway and every call is recorded
    under build/runs/<id>/gateway/.

    Usage: cyclebox sandbox exec --role analyst -- python -c 'print(1)'.
    Exit codes beyond the command's own: 124 timeout, 125 output limit,
    137 OOM, 126 cleanup unconfirmed, 7 output refused.
    """
    from runner.gateway.calllog import CallLog
    from runner.gateway.server import Gateway
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.launcher import launch, output_dir
    from runner.isolation.policy import load_policies
    from runner.isolation.registry import get_sandbox
    from runner.isolation.roles import parse_mount_flag
    from runner.isolation.sandbox import StopReason

    command = list(ctx.args)
    if not command:
        err.print("error: no command given. Usage: cyclebox sandbox exec --role ROLE -- CMD...")
        raise typer.Exit(3)
    try:
        pols = load_policies(policies)
        if role not in pols.roles:
            from runner.errors import ConfigError

            raise ConfigError(f"no role {role!r} in the policy file", path=str(policies),
                              field="--role", fix=f"one of {sorted(pols.roles)}")
        policy = pols.roles[role]
        mounts = [parse_mount_flag(m) for m in (mount or [])]
        run_id = _run_id("exec")
        run_dir = state_dir() / "runs" / run_id
        odir = out_dir or run_dir / "out"
        image = resolve_image(role)
        output_dir(policy, odir.resolve())

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
                run_dir, run_id, pols.upstreams, {role: policy.upstream})
            ) if policy.upstream else None
            record = launch(get_sandbox(), policy, role=role, run_id=run_id, image=image,
                            command=command, mounts=mounts, output_dir=odir.resolve(),
                            gateway=gateway, stage="exec", on_output=stream)
        if policy.upstream and not json_out:
            n = len(CallLog(run_dir / "gateway").records())
            err.print(f"[dim]gateway ({safe(policy.upstream)}): {n} call(s) recorded in "
                      f"{safe(run_dir / 'gateway')}[/]", highlight=False)
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json_text(record.model_dump_json())
    elif record.stop_reason is not StopReason.OK:
        err.print(f"[yellow]cyclebox:[/] {safe(record.stop_reason.value)}: "
                  f"{safe(record.detail)} (output dir {safe(odir)})", highlight=False)
    codes = {StopReason.TIMEOUT: 124, StopReason.OUTPUT_LIMIT: 125, StopReason.OOM: 137,
             StopReason.CLEANUP_UNCONFIRMED: 126, StopReason.INVALID_OUTPUT: EXIT_OUTPUT_REFUSED}
    code = codes.get(record.stop_reason, record.exit_code if record.exit_code is not None else 1)
    raise typer.Exit(code)


@app.command()
def gc(all_: Annotated[bool, typer.Option("--all", help="Remove every cyclebox container, "
                                          "even those whose owner still runs.")] = False,
       dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be removed; "
                                             "remove nothing.")] = False,
       json_out: JsonOpt = False) -> None:
    """Remove cyclebox-labelled containers whose owner process is gone, and stale gateway
    socket and input staging directories; print what it removed (or, with --dry-run,
    would remove)."""
    from dataclasses import asdict

    from runner.isolation.gc import collect_garbage
    from runner.isolation.registry import get_sandbox

    try:
        results = collect_garbage(get_sandbox(), only_orphans=not all_, dry_run=dry_run)
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json([asdict(r) for r in results])
        return
    for r in results:
        verb = ("would remove" if dry_run and r.would_remove else
                "removed" if r.removed else "kept")
        what = {"socket_dir": "socket dir", "staging_dir": "staging dir"}.get(r.kind,
                                                                            "container")
        out.print(f"{verb} {safe(r.name)} ({what}, run {safe(r.run_id)}, "
                  f"role {safe(r.role)}): {safe(r.reason)}", highlight=False)
    verb = "would be removed" if dry_run else "removed"
    done = [r for r in results if (r.would_remove if dry_run else r.removed)]
    n_cont = sum(r.kind == "container" for r in done)
    kept = sum(r.kind == "container" for r in results) - n_cont
    n_sock = sum(r.kind == "socket_dir" for r in done)
    out.print(f"{n_cont} container(s) {verb}, {kept} kept; "
              f"{n_sock} gateway socket dir(s) {verb}; "
              f"{len(done) - n_cont - n_sock} input staging dir(s) {verb}"
              + (" (dry run: nothing removed)" if dry_run else ""), highlight=False)


gateway_app = typer.Typer(no_args_is_help=True, help="Inspect the model gateway's call log.")
app.add_typer(gateway_app, name="gateway")


@gateway_app.command("calls")
def gateway_calls(run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
                  json_out: JsonOpt = False) -> None:
    """List every recorded model call of a run, with per-role totals and completeness."""
    from runner.gateway.calllog import CallLog
    from runner.gateway.report import summarize

    log_dir = run_dir / "gateway"
    if not (log_dir / "calls.jsonl").is_file():
        err.print(f"error: {safe(log_dir)}/calls.jsonl not found; pass a run directory "
                  "(e.g. build/runs/<id>)", soft_wrap=True, highlight=False)
        raise typer.Exit(3)
    try:
        records = CallLog(log_dir).records()
    except CycleboxError as exc:
        _fail(exc)
    totals = summarize(records)
    if json_out:
        emit_json({"calls": [r.model_dump(mode="json") for r in records], "totals": totals})
        return
    table = Table(title=f"model calls: {safe(log_dir)}")
    for col in ("seq", "role", "stage", "case", "trial", "turn", "model", "status", "tokens",
                "cost", "ms"):
        table.add_column(col)
    for r in records:
        tokens = str(r.usage.total_tokens) if r.usage else "?"
        cost = "unknown" if r.cost_usd is None else f"{r.cost_usd:.6f}"
        status = r.status + (f" ({r.error})" if r.error else "") + (" [fixture]" if r.fixture
                                                                       else "")
        cells = (str(r.seq), r.role, r.stage, r.case or "-",
                 "-" if r.trial is None else str(r.trial), str(r.turn), r.model or "-",
                 status, tokens, cost, f"{r.latency_s * 1000:.1f}")
        table.add_row(*(safe(c, 500) for c in cells))
    out.print(table)
    for role, row in totals["per_role"].items():
        out.print(safe(f"{role}: {row['calls']} calls, {row['tokens']} tokens, "
                       f"{row['cost_usd']} USD, complete={row['complete']}"), highlight=False)


def main() -> None:
    """Console-script entry point and the CLI's one error boundary.

    SIGTERM and SIGINT unwind (a second one exits at once, see ``runner.interrupts``);
    every exception that escapes a command is mapped here by :func:`exit_for`: no
    traceback ever reaches the terminal.
    """
    interrupts.install()
    try:
        import runner.cli.cycle
        import runner.cli.report
        import runner.cli.train  # noqa: F401 - registers model/train/export/report on `app`

        # Not standalone: typer returns a command's typer.Exit code instead of exiting,
        # and raises click's usage errors here instead of exiting 2 (2 is a verdict).
        rc = app(standalone_mode=False)
    except SystemExit:
        raise
    except typer.Abort:  # EOF at a prompt
        report_error("aborted")
        sys.exit(EXIT_INTERRUPTED)
    except typer.TyperException as exc:  # click's usage errors: bad input
        if type(exc).__name__ == "NoArgsIsHelpError":  # typer printed the help already
            sys.exit(0)
        from typer.rich_utils import rich_format_error

        rich_format_error(exc)  # type: ignore[arg-type]
        sys.exit(EXIT_BAD_INPUT)
    except BaseException as exc:  # the boundary: every error maps to a code
        try:
            code = exit_for(exc)
        except BaseException:  # even printing failed (closed stderr)
            code = EXIT_UNEXPECTED
        sys.exit(code)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()


