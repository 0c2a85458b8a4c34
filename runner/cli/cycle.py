"""CLI commands of the cycle: freeze, cycle run, apply, compare, receipt, review."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from runner import interrupts
from runner.cli.app import JsonOpt, _fail, app, err, out, report_error
from runner.cli.report import (
    HtmlOpt,
    JunitOpt,
    LineProgress,
    MarkdownOpt,
    check_targets,
    write_outputs,
)
from runner.errors import EXIT_INTERRUPTED, CycleboxError
from runner.paths import PROJECT_ROOT
from runner.termsafe import emit_json, emit_json_text, plain, safe

cycle_app = typer.Typer(no_args_is_help=True, help="Run improvement cycles.")
receipt_app = typer.Typer(no_args_is_help=True, help="Verify and compare receipts.")
review_app = typer.Typer(no_args_is_help=True, help="Human review packets and calibration.")
app.add_typer(cycle_app, name="cycle")
app.add_typer(receipt_app, name="receipt")
app.add_typer(review_app, name="review")

if TYPE_CHECKING:
    from runner.isolation.sandbox import Sandbox

OutOpt = Annotated[Path, typer.Option("--out", help="Fresh output directory (must not exist).")]


def _images(sandbox: Sandbox | None = None) -> dict[str, str]:
    """Role image ids from the lock; with a ``sandbox``, each must exist in it."""
    from runner.cycle.plan import CYCLE_ROLES
    from runner.errors import PrerequisiteError
    from runner.isolation.docker.images import resolve_image

    ids = {r: resolve_image(r) for r in CYCLE_ROLES}
    if sandbox is not None:
        gone = [r for r, i in ids.items() if sandbox.image_id(i) is None]
        if gone:
            raise PrerequisiteError(f"images for {gone} are in the lock file but not in the "
                                    "engine. Fix: cyclebox images build")
    return ids


def _replay_override(cycle_path: Path, replay: Path | None) -> dict[str, Any] | None:
    if replay is None:
        return None
    from runner.cycle.config import load_cycle, resolve
    from runner.gateway.config import UpstreamPolicy
    from runner.isolation.policy import load_policies

    cycle, base = load_cycle(cycle_path)
    ups = {**load_policies(resolve(base, cycle.roles)).upstreams, **cycle.upstreams}
    return {n: UpstreamPolicy.model_validate({**u.model_dump(mode="json"), "provider": "replay",
                                              "replay_from": str(replay.resolve()),
                                              "script": None, "base_url": None,
                                              "credential": None})
            for n, u in ups.items()}


@app.command()
def freeze(cycle: Annotated[Path, typer.Argument(help="cycle.yaml")], out_dir: OutOpt,
           replay: Annotated[Path | None, typer.Option(
               help="Answer every model call from this recorded run (byte-exact).")] = None,
           json_out: JsonOpt = False) -> None:
    """Freeze a cycle into OUT/plan.json (refuses an existing OUT)."""
    from runner.cycle.plan import freeze as do_freeze

    try:
        plan, h = do_freeze(cycle, out_dir, images=_images,
                            upstream_override=_replay_override(cycle, replay))
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json({"plan": str(out_dir / "plan.json"), "plan_hash": h})
    else:
        out.print(f"frozen {safe(plan.name)}: {safe(out_dir / 'plan.json')} plan_hash {safe(h)}",
                  highlight=False)


@cycle_app.command("run")
def cycle_run(
    cycle: Annotated[Path | None, typer.Argument(help="cycle.yaml (omit with --plan)")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Fresh output directory.")] = None,
    plan: Annotated[Path | None, typer.Option(help="Execute a prepared plan.json.")] = None,
    prepare_only: Annotated[bool, typer.Option(help="Stop after freezing.")] = False,
    replay: Annotated[Path | None, typer.Option(
        help="Answer every model call from this recorded run (byte-exact).")] = None,
    json_out: JsonOpt = False,
    junit: JunitOpt = None,
    markdown: MarkdownOpt = None,
    html: HtmlOpt = None,
) -> None:
    """Freeze then run a cycle, or run a prepared plan.

    Exit 0 accept_for_review, 1 reject, 2 invalid_comparison; 3 bad input, 5 missing
    prerequisite, 6 engine lost, 9 disk full, 130 interrupted (each after writing the
    verdict and receipt when it can), 10 unexpected; `cyclebox --help` has the table."""
    from runner.cycle.compare import EXIT_CODES
    from runner.cycle.plan import freeze as do_freeze
    from runner.cycle.receipt import build
    from runner.cycle.run import CycleRunner
    from runner.isolation.registry import get_sandbox

    sandbox = functools.cache(get_sandbox)  # opened once, when first needed
    try:
        check_targets(junit=junit, markdown=markdown, html=html)
        if plan is None:
            if cycle is None or out_dir is None:
                err.print("error: give CYCLE and --out, or --plan DIR/plan.json")
                raise typer.Exit(3)
            # Inputs, credentials, then images: only then is --out created (exclusively).
            do_freeze(cycle, out_dir,
                      images=lambda: _images(None if prepare_only else sandbox()),
                      upstream_override=_replay_override(cycle, replay))
            plan = out_dir / "plan.json"
            if prepare_only:
                out.print(f"prepared {safe(plan)}", highlight=False)
                return
        # Not a terminal (CI) or --json: plain lines on stderr, so the run shows life.
        lines = LineProgress() if json_out or not err.is_terminal else None
        with Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, disable=lines is not None) as bar:
            tasks: dict[str, Any] = {}

            def progress(stage: str, done: int, total: int) -> None:
                # total 0 marks a single-step stage: shown as 1/1 once it starts
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total or 1)
                bar.update(tasks[stage], completed=done if total else 1, total=total or 1)

            runner = CycleRunner(plan, sandbox=sandbox(), progress=lines or progress)
            outcome = runner.run()
        failure = outcome.failure
        if failure is not None and failure.reason == "environment_failure":
            # Disk full: no receipt, so that nothing claims a complete run (verify fails).
            report_error(f"{outcome.result.reasons[0]} (no receipt written; partial run "
                         f"in {outcome.run_dir})")
            raise typer.Exit(failure.exit_code)
        with interrupts.shielded():
            receipt = build(outcome)
        report = write_outputs(outcome.run_dir, junit=junit, markdown=markdown, html=html)
    except CycleboxError as exc:
        _fail(exc)
    result = outcome.result
    if failure is not None:
        # The verdict and receipt are written; the exit code says why the cycle stopped.
        report_error(f"{result.reasons[0] if result.reasons else failure.reason}"
                     f" (verdict and receipt in {outcome.run_dir})")
        raise typer.Exit(failure.exit_code)
    if interrupts.seen():
        raise typer.Exit(EXIT_INTERRUPTED)
    if json_out:
        emit_json({"run_dir": str(outcome.run_dir), "verdict": result.verdict,
                   "reasons": list(result.reasons),
                   "receipt": str(outcome.run_dir / "receipt.json"),
                   "outcome": receipt["outcome"], "timing": outcome.timings,
                   "report": json.loads(report.model_dump_json(by_alias=True))})
    else:
        _summary(outcome, receipt)
    raise typer.Exit(EXIT_CODES[result.verdict])


def _summary(outcome: Any, receipt: dict[str, Any]) -> None:
    r = outcome.result
    colour = {"accept_for_review": "green", "reject": "red"}.get(r.verdict, "yellow")
    t = Table(title=f"cycle {safe(outcome.run_dir.name)}", show_header=False)
    t.add_column("k")
    t.add_column("v", overflow="fold")
    t.add_row("verdict", f"[bold {colour}]{safe(r.verdict)}[/]")
    for reason in r.reasons:
        t.add_row("reason", safe(reason))
    for c in r.improvements:
        t.add_row("improved", safe(f"{c.case_id} t{c.trial} {c.criterion}"))
    for c in r.regressions:
        t.add_row("regressed", safe(f"{c.case_id} t{c.trial} {c.criterion}"))
    total = receipt["usage"]["total"]
    t.add_row("model calls", safe(f"{total['calls']} ({total['ok']} ok), cost "
                                  f"{total['cost_usd']} USD, complete={total['complete']}"
                                  + (" [fixture]" if receipt["fixture"] else "")))
    t.add_row("time per stage", safe(", ".join(f"{k} {v:.1f}s"
                                               for k, v in outcome.timings.items())))
    t.add_row("receipt", safe(outcome.run_dir / "receipt.json"))
    out.print(t)


@app.command("apply")
def apply_cmd(proposal: Annotated[Path, typer.Option(help="proposal.json")], out_dir: OutOpt,
              repo: Annotated[Path | None, typer.Option(
                  help="Git repository (read only); taken from --plan when omitted.")] = None,
              ref: Annotated[str | None, typer.Option(
                  help="Base ref; the plan's frozen base tree when omitted.")] = None,
              paths: Annotated[list[str] | None, typer.Option(
                  "--paths", help="A path the edit may change (repeatable); required "
                                  "without --plan.")] = None,
              allowlist: Annotated[list[str] | None, typer.Option(
                  "--allowlist", help="Glob every changed path must match (repeatable); "
                                      "required without --plan.")] = None,
              plan: Annotated[Path | None, typer.Option(
                  help="A frozen plan.json: its repository, base tree, path set, allowlist "
                       "and size cap.")] = None,
              subdir: Annotated[str | None, typer.Option(help="Source subdirectory.")] = None,
              max_file_bytes: Annotated[int, typer.Option(
                  help="Largest file an edit may write.")] = 256 * 1024,
              json_out: JsonOpt = False) -> None:
    """Apply a proposal on a throwaway repo in the apply container.

    The path set and allowlist are the operator's (--paths/--allowlist, or --plan), never
    the proposal's: a proposal carrying its own is refused (exit 3 naming the field).
    Exit 2 with the named reason on any refusal."""
    from runner.cycle.apply import apply_proposal, invocation_for
    from runner.cycle.plan import make_fresh_dir, refuse_existing, remove_created
    from runner.isolation.docker.images import resolve_image
    from runner.isolation.launcher import launch
    from runner.isolation.policy import load_policies
    from runner.isolation.registry import get_sandbox
    from runner.isolation.sandbox import Mount
    from runner.paths import default_policies

    try:
        refuse_existing(out_dir)
        inv, repo_path, tree, raw = invocation_for(
            proposal, repo=repo, ref=ref, subdir=subdir, paths=paths, allowlist=allowlist,
            plan=plan, max_file_bytes=max_file_bytes)
        policy = load_policies(default_policies()).roles["apply"]
        image = resolve_image("apply")
        created = make_fresh_dir(out_dir)
        try:
            (out_dir / "in").mkdir()
            (out_dir / "in" / "proposal.json").write_bytes(raw)
            (out_dir / "in" / "invocation.json").write_text(json.dumps(inv))
        except BaseException:
            remove_created(created)
            raise
        sandbox = get_sandbox()

        def run(work: Path) -> Any:
            return launch(sandbox, policy, role="apply", run_id="apply", image=image,
                          command=["python", "-m", "sandbox.apply_main"], output_dir=work,
                          output_target="/work",
                          mounts=[Mount(source=(out_dir / "in").resolve(), target="/in")])

        result = apply_proposal(out_dir.resolve(), repo_path, tree, run=run, uid=policy.uid,
                                export_to=out_dir.resolve() / "candidate-src")
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json(result)
    elif result.get("status") == "applied":
        out.print(safe(f"applied: commit {result['commit']} tree {result['tree']}; patch "
                       f"{out_dir / 'candidate.patch'}"), highlight=False, soft_wrap=True)
    else:
        err.print(f"refused: {plain(result.get('reason'), 200)}: "
                  f"{plain(result.get('message'))}", highlight=False, markup=False,
                  soft_wrap=True)
    raise typer.Exit(0 if result.get("status") == "applied" else 2)


@app.command("compare")
def compare_cmd(baseline: Annotated[Path, typer.Option(help="Baseline records (JSONL).")],
                candidate: Annotated[Path, typer.Option(help="Candidate records (JSONL).")],
                policy: Annotated[Path, typer.Option(help="Comparison policy (YAML/JSON).")],
                out_dir: OutOpt, json_out: JsonOpt = False) -> None:
    """Compare two record sets under a frozen policy.

    Exit 0 accept_for_review, 1 reject, 2 invalid_comparison, 3 bad input
    (`cyclebox --help` has the table)."""
    from runner.cycle.compare import EXIT_CODES, compare, load_policy, load_records
    from runner.cycle.plan import make_fresh_dir, refuse_existing, remove_created

    try:
        refuse_existing(out_dir)
        result = compare(load_records(baseline), load_records(candidate), load_policy(policy))
        created = make_fresh_dir(out_dir)
        try:
            (out_dir / "verdict.json").write_text(result.model_dump_json(indent=1))
        except BaseException:
            remove_created(created)
            raise
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json_text(result.model_dump_json())
    else:
        out.print(plain(result.verdict), highlight=False, markup=False)
        for reason in result.reasons:
            out.print(f"  - {plain(reason)}", highlight=False, markup=False)
    raise typer.Exit(EXIT_CODES[result.verdict])


@receipt_app.command("keygen")
def receipt_keygen(out_key: Annotated[Path, typer.Option("--out", help="Private key file.")]
                   ) -> None:
    """Create an Ed25519 signing key (0600) and KEY.pub."""
    from runner.cycle.signing import keygen

    try:
        pub = keygen(out_key)
    except CycleboxError as exc:
        _fail(exc)
    out.print(f"private key {safe(out_key)} (keep it off shared machines); public key "
              f"{safe(pub)}", highlight=False)


@receipt_app.command("sign")
def receipt_sign(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                 key: Annotated[Path, typer.Option(help="Ed25519 private key (PEM).")]) -> None:
    """Sign receipt.json into a DSSE envelope (receipt.dsse.json)."""
    from runner.cycle.signing import sign

    try:
        env = sign(run_dir, key)
    except CycleboxError as exc:
        _fail(exc)
    out.print(f"signed: {safe(env)}", highlight=False)


@receipt_app.command("verify")
def receipt_verify(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                   pubkey: Annotated[Path | None, typer.Option(
                       help="Also require a valid DSSE signature by this Ed25519 key.")] = None,
                   json_out: JsonOpt = False) -> None:
    """Re-hash every file the receipt names (and check its signature with --pubkey);
    exit 8 naming each mismatch."""
    from runner.cycle.receipt import verify

    try:
        problems = verify(run_dir)
        if pubkey is not None:
            from runner.cycle.signing import load_public, verify_signature

            try:
                verify_signature(run_dir, load_public(pubkey))
            except CycleboxError as exc:
                problems.append(str(exc))
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json({"ok": not problems, "problems": problems})
    else:
        for p in problems:
            err.print(f"[red]mismatch:[/] {safe(p)}", highlight=False)
        out.print("receipt verified: every named file matches and no other file is present"
                  if not problems else f"receipt verification FAILED ({len(problems)} "
                                       "problem(s))", highlight=False)
    raise typer.Exit(0 if not problems else 8)


@receipt_app.command("compare")
def receipt_compare(recorded: Annotated[Path, typer.Argument(help="Recorded run dir.")],
                    replayed: Annotated[Path, typer.Argument(help="Replayed run dir.")]) -> None:
    """Show that two runs' receipts have equal input and outcome hashes (timings aside)."""
    from runner.cycle.receipt import load_receipt

    try:
        a, b = load_receipt(recorded), load_receipt(replayed)
    except CycleboxError as exc:
        _fail(exc)
    keys = ["identities", "base_tree", "images"]
    rows = [(k, a[k] == b[k]) for k in keys]
    # Every frozen input section, except how model calls are answered (a replay
    # answers from the recording instead of the original provider).
    skip = {"upstreams", "upstream_ids", "inputs"}
    rows += [(f"inputs.{k}", a["inputs"][k] == b["inputs"].get(k)) for k in sorted(a["inputs"])
             if k not in skip]
    rows += [(f"outcome.{k}", a["outcome"][k] == b["outcome"][k]) for k in a["outcome"]
             if k != "inputs"]
    t = Table(title="recorded vs replayed")
    for c in ("hash", "recorded", "replayed", "equal"):
        t.add_column(c, overflow="fold")
    def value(doc: dict[str, Any], key: str) -> Any:
        head, _, rest = key.partition(".")
        return doc[head].get(rest) if rest else doc[head]

    def short(v: Any) -> str:
        return v[:16] if isinstance(v, str) else json.dumps(v, sort_keys=True)[:24]

    for k, same in rows:
        t.add_row(safe(k, 200), safe(short(value(a, k))), safe(short(value(b, k))),
                  "[green]yes[/]" if same else "[red]NO[/]")
    out.print(t)
    raise typer.Exit(0 if all(s for _, s in rows) else 8)


@review_app.command("packet")
def review_packet(records: Annotated[Path, typer.Option(help="Records (JSONL).")],
                  out_dir: OutOpt, reviewer: str = "",
                  manifest: Annotated[Path | None, typer.Option(
                      help="Scenario manifest: shows each task to the reviewer.")] = None,
                  run: Annotated[Path | None, typer.Option(
                      "--run", help="The run the records belong to (default: the run "
                      "directory holding RECORDS, when it has a receipt). Binds the packet "
                      "and its calibration to that run's receipt.")] = None,
                  intent_key: str = "question") -> None:
    """Write a review packet for human labelling.

    review.md, packet.json, an empty human-labels.json and judge-ratings.json kept apart.
    packet.json records the sha256 of the run's receipt.json and of the records file.
    Exit 0 written; 3 bad input (records not the run's); 8 records changed since the run."""
    from runner.cycle.compare import load_records
    from runner.cycle.review import bind_run, make_packet

    try:
        questions = None
        if manifest is not None:
            from runner.cycle.manifest import MANIFEST_FIX
            from runner.cycle.models import Manifest
            from runner.loading import load_model

            doc = load_model(manifest, Manifest, fmt="json", what="scenario manifest",
                             schema=1, fix=MANIFEST_FIX)
            questions = {sc.id: str(sc.input.get(intent_key, json.dumps(sc.input)))
                         for sc in doc.scenarios}
        if run is None and len(records.resolve().parents) > 2 and (
                records.resolve().parents[2] / "receipt.json").is_file():
            run = records.resolve().parents[2]  # RUN/stages/<side>/records.jsonl
        binding = bind_run(run, records) if run is not None else None
        path = make_packet(load_records(records), out_dir, reviewer=reviewer,
                           questions=questions, run=binding)
    except CycleboxError as exc:
        _fail(exc)
    bound = (f"bound to run {safe(run)}" if binding
             else "NOT bound to a run (export will refuse it)")
    out.print(f"packet written to {safe(path)}, {bound}; fill human-labels.json, then run "
              "`cyclebox review calibrate`", highlight=False)


@review_app.command("calibrate")
def review_calibrate(packet: Annotated[Path, typer.Option(help="Packet directory.")],
                     labels: Annotated[Path, typer.Option(help="Filled human-labels.json.")],
                     judges: Annotated[Path, typer.Option(help="judge-ratings.json.")],
                     out_file: Annotated[Path, typer.Option("--out", help="Result file.")],
                     policy: Annotated[Path, typer.Option(
                         help="Export policy whose min_kappa the calibration must reach.")] =
                     PROJECT_ROOT / "policies" / "export.yaml",
                     json_out: JsonOpt = False) -> None:
    """Agreement between human labels and model ratings.

    Coverage, exact agreement, mean absolute difference and Cohen's kappa. A cell
    labelled "na" (or left null where the scorer graded the criterion not applicable)
    is not missing coverage. The result is written in every case that gets that far.

    Exit codes: 0 complete coverage and overall kappa >= the export policy's min_kappa;
    3 bad input (a file unreadable or malformed, --out exists); 4 check failed
    (coverage incomplete or kappa below min_kappa; the result file is still written);
    8 integrity (the packet, review.md, labels or ratings do not match each other)."""
    from runner.cycle.review import OVERALL, calibrate, write_calibration
    from runner.errors import CheckFailed
    from runner.train.export import load_export_policy

    try:
        min_kappa = load_export_policy(policy).min_kappa
        result = calibrate(packet, labels, judges)
        write_calibration(result, out_file)
        kappa = result.cohen_kappa.get(OVERALL)
        if json_out:
            emit_json_text(result.model_dump_json())
        else:
            for k in ("coverage", "exact_agreement", "mean_abs_diff", "cohen_kappa"):
                out.print(f"{k}: {safe(getattr(result, k))}", highlight=False)
        if not result.complete:
            raise CheckFailed(f"calibration incomplete: coverage {result.coverage[OVERALL]:.3f}"
                              f" of applicable cells; label every cell 0, 1, 2 or \"na\" in "
                              f"{labels}, then calibrate again (result kept in {out_file})")
        if kappa is None or kappa < min_kappa:
            raise CheckFailed(f"calibration kappa {kappa} is below the export policy's "
                              f"min_kappa {min_kappa} ({policy}); result kept in {out_file}")
    except CycleboxError as exc:
        _fail(exc)


dream_app = typer.Typer(no_args_is_help=True, help="Dream variants (training-set augmentation).")
app.add_typer(dream_app, name="dream")


@dream_app.command("compare")
def dream_compare(cycle: Annotated[Path, typer.Argument(help="cycle.yaml with dream on")],
                  out_dir: OutOpt, json_out: JsonOpt = False) -> None:
    """Run a cycle with dream off and on and write one paired receipt.

    Same tasks, models and seeds; the receipt holds held-out scores, verdicts,
    acceptance/fallback rates, the held-out delta and the incremental cost."""
    from runner.cycle.dream_compare import paired
    from runner.isolation.registry import get_sandbox

    try:
        receipt = paired(cycle, out_dir, images=_images(), sandbox=get_sandbox())
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        emit_json(receipt)
        return
    t = Table(title="dream off vs on", show_header=True)
    for c in ("", "off", "on"):
        t.add_column(c)
    arms = receipt["arms"]
    for label, key in (("verdict", "verdict"), ("model calls", "model_calls"),
                       ("cost USD", "cost_usd")):
        t.add_row(label, safe(arms["off"][key], 200), safe(arms["on"][key], 200))
    for side in ("baseline", "candidate"):
        t.add_row(f"held-out {side}",
                  *[safe(f"{(arms[a]['heldout'][side] or {}).get('passed')}/"
                         f"{(arms[a]['heldout'][side] or {}).get('total')}", 200)
                    for a in ("off", "on")])
    d = arms["on"]["dream"] or {}
    t.add_row("dream", "-", safe(f"{d.get('accepted')}/{d.get('requested')} accepted; reasons "
                                 f"{ {k: v for k, v in (d.get('reasons') or {}).items() if v} }"))
    out.print(t)
    out.print(safe(f"held-out delta {receipt['heldout_delta']}, incremental cost "
                   f"{receipt['incremental_cost_usd']} USD; {receipt['claim']}"), highlight=False)
    out.print(f"receipt: {safe(out_dir / 'dream-receipt.json')}", highlight=False)


@cycle_app.command("schema")
def cycle_schema() -> None:
    """Print the JSON schema of cycle.yaml."""
    from runner.cycle.config import CycleFile

    emit_json(CycleFile.model_json_schema(by_alias=True))
