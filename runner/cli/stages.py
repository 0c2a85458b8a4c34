"""``cyclebox apply`` and ``cyclebox compare``: two stages of a cycle, run on their own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runner.cli.options import JsonOpt, OutOpt
from runner.cli.output import err, out
from runner.errors import EXIT_INVALID, EXIT_OK
from runner.termsafe import emit_json, emit_json_text, plain, safe

commands = typer.Typer()


@commands.command("apply")
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
    from runner.cli.engine import role_image, sandbox
    from runner.cycle.apply import apply_standalone

    result = apply_standalone(proposal, out_dir, sandbox=sandbox(),
                              image=lambda: role_image("apply"), repo=repo, ref=ref,
                              subdir=subdir, paths=paths, allowlist=allowlist, plan=plan,
                              max_file_bytes=max_file_bytes)
    if json_out:
        emit_json(result)
    elif result.get("status") == "applied":
        out.print(safe(f"applied: commit {result['commit']} tree {result['tree']}; patch "
                       f"{out_dir / 'candidate.patch'}"), highlight=False, soft_wrap=True)
    else:
        err.print(f"refused: {plain(result.get('reason'), 200)}: "
                  f"{plain(result.get('message'))}", highlight=False, markup=False,
                  soft_wrap=True)
    raise typer.Exit(EXIT_OK if result.get("status") == "applied" else EXIT_INVALID)


@commands.command("compare")
def compare_cmd(baseline: Annotated[Path, typer.Option(help="Baseline records (JSONL).")],
                candidate: Annotated[Path, typer.Option(help="Candidate records (JSONL).")],
                policy: Annotated[Path, typer.Option(help="Comparison policy (YAML/JSON).")],
                out_dir: OutOpt, json_out: JsonOpt = False) -> None:
    """Compare two record sets under a frozen policy.

    Exit 0 accept_for_review, 1 reject, 2 invalid_comparison, 3 bad input
    (`cyclebox --help` has the table)."""
    from runner.cycle.compare import EXIT_CODES, compare_files

    result = compare_files(baseline, candidate, policy, out_dir)
    if json_out:
        emit_json_text(result.model_dump_json())
    else:
        out.print(plain(result.verdict), highlight=False, markup=False)
        for reason in result.reasons:
            out.print(f"  - {plain(reason)}", highlight=False, markup=False)
    raise typer.Exit(EXIT_CODES[result.verdict])
