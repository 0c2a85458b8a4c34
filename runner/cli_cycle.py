"""CLI commands of the cycle: freeze, cycle run, apply, compare, receipt, review."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from runner import interrupts
from runner.cli import JsonOpt, _fail, app, err, out, report_error
from runner.errors import EXIT_INTERRUPTED, CycleboxError

cycle_app = typer.Typer(no_args_is_help=True, help="Run improvement cycles.")
receipt_app = typer.Typer(no_args_is_help=True, help="Verify and compare receipts.")
review_app = typer.Typer(no_args_is_help=True, help="Human review packets and calibration.")
app.add_typer(cycle_app, name="cycle")
app.add_typer(receipt_app, name="receipt")
app.add_typer(review_app, name="review")

OutOpt = Annotated[Path, typer.Option("--out", help="Fresh output directory (must not exist).")]


def _images() -> dict[str, str]:
    from runner.cycle.plan import CYCLE_ROLES
    from runner.images import resolve_image

    return {r: resolve_image(r) for r in CYCLE_ROLES}


def _replay_override(cycle_path: Path, replay: Path | None) -> dict[str, Any] | None:
    if replay is None:
        return None
    from runner.cycle.config import load_cycle, resolve
    from runner.gateway.config import UpstreamPolicy
    from runner.policy import load_policies

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
        plan, h = do_freeze(cycle, out_dir, images=_images(),
                            upstream_override=_replay_override(cycle, replay))
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        out.print_json(json.dumps({"plan": str(out_dir / "plan.json"), "plan_hash": h}))
    else:
        out.print(f"frozen {plan.name}: {out_dir / 'plan.json'} plan_hash {h}", highlight=False)


@cycle_app.command("run")
def cycle_run(
    cycle: Annotated[Path | None, typer.Argument(help="cycle.yaml (omit with --plan)")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Fresh output directory.")] = None,
    plan: Annotated[Path | None, typer.Option(help="Execute a prepared plan.json.")] = None,
    prepare_only: Annotated[bool, typer.Option(help="Stop after freezing.")] = False,
    replay: Annotated[Path | None, typer.Option(
        help="Answer every model call from this recorded run (byte-exact).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Freeze then run a cycle, or run a prepared plan.

    Exit 0 accept_for_review, 1 reject, 2 invalid_comparison, 3+ usage errors."""
    from runner.cycle.compare import EXIT_CODES
    from runner.cycle.plan import freeze as do_freeze
    from runner.cycle.receipt import build
    from runner.cycle.run import CycleRunner

    try:
        if plan is None:
            if cycle is None or out_dir is None:
                err.print("error: give CYCLE and --out, or --plan DIR/plan.json")
                raise typer.Exit(3)
            do_freeze(cycle, out_dir, images=_images(),
                      upstream_override=_replay_override(cycle, replay))
            plan = out_dir / "plan.json"
            if prepare_only:
                out.print(f"prepared {plan}")
                return
        with Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, disable=json_out) as bar:
            tasks: dict[str, Any] = {}

            def progress(stage: str, done: int, total: int) -> None:
                # total 0 marks a single-step stage: shown as 1/1 once it starts
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total or 1)
                bar.update(tasks[stage], completed=done if total else 1, total=total or 1)

            runner = CycleRunner(plan, progress=progress)
            outcome = runner.run()
        failure = outcome.failure
        if failure is not None and failure.reason == "environment_failure":
            # Disk full: no receipt, so that nothing claims a complete run (verify fails).
            report_error(f"{outcome.result.reasons[0]} (no receipt written; partial run "
                         f"in {outcome.run_dir})")
            raise typer.Exit(failure.exit_code)
        with interrupts.shielded():
            receipt = build(outcome)
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
        out.print_json(json.dumps({"run_dir": str(outcome.run_dir), "verdict": result.verdict,
                                   "reasons": list(result.reasons),
                                   "receipt": str(outcome.run_dir / "receipt.json"),
                                   "outcome": receipt["outcome"], "timing": outcome.timings}))
    else:
        _summary(outcome, receipt)
    raise typer.Exit(EXIT_CODES[result.verdict])


def _summary(outcome: Any, receipt: dict[str, Any]) -> None:
    r = outcome.result
    colour = {"accept_for_review": "green", "reject": "red"}.get(r.verdict, "yellow")
    t = Table(title=f"cycle {outcome.run_dir.name}", show_header=False)
    t.add_column("k")
    t.add_column("v", overflow="fold")
    t.add_row("verdict", f"[bold {colour}]{r.verdict}[/]")
    for reason in r.reasons:
        t.add_row("reason", escape(reason))
    for c in r.improvements:
        t.add_row("improved", f"{c.case_id} t{c.trial} {c.criterion}")
    for c in r.regressions:
        t.add_row("regressed", f"{c.case_id} t{c.trial} {c.criterion}")
    total = receipt["usage"]["total"]
    t.add_row("model calls", f"{total['calls']} ({total['ok']} ok), cost "
              f"{total['cost_usd']} USD, complete={total['complete']}"
              + (" [fixture]" if receipt["fixture"] else ""))
    t.add_row("time per stage", ", ".join(f"{k} {v:.1f}s" for k, v in outcome.timings.items()))
    t.add_row("receipt", str(outcome.run_dir / "receipt.json"))
    out.print(t)


@app.command("apply")
def apply_cmd(proposal: Annotated[Path, typer.Option(help="proposal.json")],
              repo: Annotated[Path, typer.Option(help="Git repository (read only).")],
              ref: Annotated[str, typer.Option(help="Base ref.")], out_dir: OutOpt,
              subdir: Annotated[str | None, typer.Option(help="Source subdirectory.")] = None,
              json_out: JsonOpt = False) -> None:
    """Apply a proposal on a throwaway repo in the apply container.

    Exit 2 with the named reason on any refusal. The proposal carries its path set,
    allowlist and base hashes (as the worker writes them)."""
    from runner.cycle.apply import apply_proposal
    from runner.docker_backend import DockerSandbox
    from runner.gitops import resolve_tree
    from runner.images import resolve_image
    from runner.paths import default_policies
    from runner.policy import load_policies
    from runner.roles import role_spec
    from runner.sandbox import Mount

    try:
        from runner.collect import loads_strict

        prop = loads_strict(proposal.read_bytes(), source=str(proposal))
        if not isinstance(prop, dict):
            raise CycleboxError(f"{proposal}: expected a JSON object")
        tree = resolve_tree(repo.resolve(), ref, subdir)
        if out_dir.exists():
            raise CycleboxError(f"{out_dir} exists; evidence is never overwritten")
        (out_dir / "in").mkdir(parents=True)
        raw_files = prop.get("files")
        files: list[Any] = raw_files if isinstance(raw_files, list) else []
        inv = {"paths": prop.get("paths", [f.get("path") for f in files if isinstance(f, dict)]),
               "allowlist": prop.get("allowlist", ["*"]), "base": prop.get("base", {}),
               "max_file_bytes": 256 * 1024}
        (out_dir / "in" / "proposal.json").write_bytes(proposal.read_bytes())
        (out_dir / "in" / "invocation.json").write_text(json.dumps(inv))
        policy = load_policies(default_policies()).roles["apply"]
        backend = DockerSandbox()

        def run(work: Path) -> Any:
            spec = role_spec(policy, role="apply", run_id="apply", image=resolve_image("apply"),
                             command=["python", "-m", "sandbox.apply_main"], output_dir=work,
                             mounts=[Mount(source=(out_dir / "in").resolve(), target="/in")])
            return backend.run(spec.model_copy(update={"output_target": "/work"}))

        uid = int(policy.user.split(":")[0])
        result = apply_proposal(out_dir.resolve(), repo.resolve(), tree, run=run, uid=uid)
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        out.print_json(json.dumps(result))
    elif result.get("status") == "applied":
        out.print(f"applied: commit {result['commit']} tree {result['tree']}; patch "
                  f"{out_dir / 'candidate.patch'}", highlight=False)
    else:
        err.print(f"refused: {result.get('reason')}: {result.get('message')}", highlight=False,
                  markup=False)
    raise typer.Exit(0 if result.get("status") == "applied" else 2)


@app.command("compare")
def compare_cmd(baseline: Annotated[Path, typer.Option(help="Baseline records (JSONL).")],
                candidate: Annotated[Path, typer.Option(help="Candidate records (JSONL).")],
                policy: Annotated[Path, typer.Option(help="Comparison policy (YAML/JSON).")],
                out_dir: OutOpt, json_out: JsonOpt = False) -> None:
    """Compare two record sets under a frozen policy.

    Exit 0 accept_for_review, 1 reject, 2 invalid_comparison, 3+ usage errors."""
    from runner.cycle.compare import EXIT_CODES, compare, load_policy, load_records

    try:
        if out_dir.exists():
            raise CycleboxError(f"{out_dir} exists; evidence is never overwritten")
        result = compare(load_records(baseline), load_records(candidate), load_policy(policy))
    except CycleboxError as exc:
        _fail(exc)
    out_dir.mkdir(parents=True)
    (out_dir / "verdict.json").write_text(result.model_dump_json(indent=1))
    if json_out:
        out.print_json(result.model_dump_json())
    else:
        out.print(f"{result.verdict}", highlight=False)
        for reason in result.reasons:
            out.print(f"  - {reason}", highlight=False, markup=False)
    raise typer.Exit(EXIT_CODES[result.verdict])


@receipt_app.command("keygen")
def receipt_keygen(out_key: Annotated[Path, typer.Option("--out", help="Private key file.")]
                   ) -> None:
    """Create an Ed25519 signing key (0600) and KEY.pub."""
    from runner.signing import keygen

    try:
        pub = keygen(out_key)
    except CycleboxError as exc:
        _fail(exc)
    out.print(f"private key {out_key} (keep it off shared machines); public key {pub}",
              highlight=False)


@receipt_app.command("sign")
def receipt_sign(run_dir: Annotated[Path, typer.Argument(help="A cycle run directory.")],
                 key: Annotated[Path, typer.Option(help="Ed25519 private key (PEM).")]) -> None:
    """Sign receipt.json into a DSSE envelope (receipt.dsse.json)."""
    from runner.signing import sign

    try:
        env = sign(run_dir, key)
    except CycleboxError as exc:
        _fail(exc)
    out.print(f"signed: {env}", highlight=False)


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
            from runner.signing import load_public, verify_signature

            try:
                verify_signature(run_dir, load_public(pubkey))
            except CycleboxError as exc:
                problems.append(str(exc))
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        out.print_json(json.dumps({"ok": not problems, "problems": problems}))
    else:
        for p in problems:
            err.print(f"[red]mismatch:[/] {escape(p)}", highlight=False)
        n = len(json.loads((run_dir / "receipt.json").read_text())["files"])
        out.print("receipt verified: every named file matches" if not problems
                  else f"receipt verification FAILED ({len(problems)} of {n} files)")
    raise typer.Exit(0 if not problems else 8)


@receipt_app.command("compare")
def receipt_compare(recorded: Annotated[Path, typer.Argument(help="Recorded run dir.")],
                    replayed: Annotated[Path, typer.Argument(help="Replayed run dir.")]) -> None:
    """Show that two runs' receipts have equal input and outcome hashes (timings aside)."""
    a = json.loads((recorded / "receipt.json").read_text())
    b = json.loads((replayed / "receipt.json").read_text())
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
        t.add_row(k, short(value(a, k)), short(value(b, k)),
                  "[green]yes[/]" if same else "[red]NO[/]")
    out.print(t)
    raise typer.Exit(0 if all(s for _, s in rows) else 8)


@review_app.command("packet")
def review_packet(records: Annotated[Path, typer.Option(help="Records (JSONL).")],
                  out_dir: OutOpt, reviewer: str = "",
                  manifest: Annotated[Path | None, typer.Option(
                      help="Scenario manifest: shows each task to the reviewer.")] = None,
                  intent_key: str = "question") -> None:
    """Write a review packet for human labelling.

    review.md, packet.json, an empty human-labels.json and judge-ratings.json kept apart."""
    from runner.cycle.compare import load_records
    from runner.cycle.review import make_packet

    try:
        questions = None
        if manifest is not None:
            from runner.collect import loads_strict

            doc = loads_strict(manifest.read_bytes(), source=str(manifest))
            questions = {str(sc["id"]): str(sc["input"].get(intent_key, json.dumps(sc["input"])))
                         for sc in doc["scenarios"]}
        path = make_packet(load_records(records), out_dir, reviewer=reviewer,
                           questions=questions)
    except CycleboxError as exc:
        _fail(exc)
    out.print(f"packet written to {path}; fill human-labels.json, then run "
              "`cyclebox review calibrate`", highlight=False)


@review_app.command("calibrate")
def review_calibrate(packet: Annotated[Path, typer.Option(help="Packet directory.")],
                     labels: Annotated[Path, typer.Option(help="Filled human-labels.json.")],
                     judges: Annotated[Path, typer.Option(help="judge-ratings.json.")],
                     out_file: Annotated[Path, typer.Option("--out", help="Result file.")],
                     json_out: JsonOpt = False) -> None:
    """Agreement between human labels and model ratings.

    Coverage, exact agreement, mean absolute difference and Cohen's kappa. Non-zero
    exit when packet identity or coverage fails."""
    from runner.cycle.review import calibrate, write_calibration

    try:
        result = calibrate(packet, labels, judges)
        write_calibration(result, out_file)
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        out.print_json(result.model_dump_json())
    else:
        for k in ("coverage", "exact_agreement", "mean_abs_diff", "cohen_kappa"):
            out.print(f"{k}: {getattr(result, k)}", highlight=False)
    raise typer.Exit(0 if result.complete else 4)


dream_app = typer.Typer(no_args_is_help=True, help="Dream variants (training-set augmentation).")
app.add_typer(dream_app, name="dream")


@dream_app.command("compare")
def dream_compare(cycle: Annotated[Path, typer.Argument(help="cycle.yaml with dream on")],
                  out_dir: OutOpt, json_out: JsonOpt = False) -> None:
    """Run a cycle with dream off and on and write one paired receipt.

    Same tasks, models and seeds; the receipt holds held-out scores, verdicts,
    acceptance/fallback rates, the held-out delta and the incremental cost."""
    from runner.cycle.dream_compare import paired

    try:
        receipt = paired(cycle, out_dir, images=_images())
    except CycleboxError as exc:
        _fail(exc)
    if json_out:
        out.print_json(json.dumps(receipt))
        return
    t = Table(title="dream off vs on", show_header=True)
    for c in ("", "off", "on"):
        t.add_column(c)
    arms = receipt["arms"]
    for label, key in (("verdict", "verdict"), ("model calls", "model_calls"),
                       ("cost USD", "cost_usd")):
        t.add_row(label, str(arms["off"][key]), str(arms["on"][key]))
    for side in ("baseline", "candidate"):
        t.add_row(f"held-out {side}",
                  *[f"{(arms[a]['heldout'][side] or {}).get('passed')}/"
                    f"{(arms[a]['heldout'][side] or {}).get('total')}" for a in ("off", "on")])
    d = arms["on"]["dream"] or {}
    t.add_row("dream", "-", f"{d.get('accepted')}/{d.get('requested')} accepted; reasons "
              f"{ {k: v for k, v in (d.get('reasons') or {}).items() if v} }")
    out.print(t)
    out.print(f"held-out delta {receipt['heldout_delta']}, incremental cost "
              f"{receipt['incremental_cost_usd']} USD; {receipt['claim']}", highlight=False)
    out.print(f"receipt: {out_dir / 'dream-receipt.json'}", highlight=False)


@cycle_app.command("schema")
def cycle_schema() -> None:
    """Print the JSON schema of cycle.yaml."""
    from runner.cycle.config import CycleFile

    out.print_json(json.dumps(CycleFile.model_json_schema(by_alias=True)))
