"""``cyclebox init``, ``cyclebox manifest build|check|rehash``, ``cyclebox schema``:
bringing your own agent. They parse, call ``runner.project`` and print."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runner.cli.options import JsonOpt
from runner.cli.output import err, out
from runner.termsafe import emit_json, safe

commands = typer.Typer()
manifest_app = typer.Typer(no_args_is_help=True, help="Build and check scenario manifests "
                           "(every hash computed; no hand editing).")

DataOpt = Annotated[Path | None, typer.Option(
    "--data", help="The data directory the stores are in (default: data/ beside MANIFEST).")]


@commands.command("init")
def init_cmd(dest: Annotated[Path, typer.Argument(metavar="DIR",
                                                  help="New or empty project directory.")],
             name: Annotated[str | None, typer.Option(
                 help="Project name (default: from DIR).")] = None,
             json_out: JsonOpt = False) -> None:
    """Scaffold a working project in DIR (absent or empty).

    An agent calling its model through the gateway, a prompt and a skill
    the worker may edit, data, scenarios with development and acceptance
    splits, their manifest, a comparison policy, scripted models and
    cycle.yaml. Once committed to git, it runs offline as is.

    Exit 0 written; 3 DIR is not empty (nothing is overwritten) or
    unusable."""
    from runner.project.init import scaffold

    made = scaffold(dest, name=name)
    if json_out:
        emit_json({"root": str(made.root), "name": made.name, "files": made.files})
        return
    out.print(f"created project {safe(made.name)} in {safe(made.root)}:", highlight=False)
    for f in made.files:
        out.print(f"  {safe(f)}", highlight=False)
    d = safe(made.root)
    out.print("next:\n"
              f"  cd {d} && git init && git add -A && git commit -m base\n"
              "  cyclebox cycle run cycle.yaml --out runs/first\n"
              "then make it yours: README.md in the project; the contracts: "
              "docs/contracts.md; formats: cyclebox schema --list", highlight=False)


@manifest_app.command("build")
def manifest_build(
        scenarios: Annotated[Path, typer.Option(help="Scenarios file (YAML or JSON; "
                                                     "`cyclebox schema scenarios`).")],
        data: Annotated[Path, typer.Option(help="Directory holding the data stores.")],
        out_file: Annotated[Path, typer.Option("--out", help="Manifest to write "
                                                              "(replaced if it exists).")],
        json_out: JsonOpt = False) -> None:
    """Build a manifest from a scenarios file and data, computing every hash.

    The hashes: each store's sha256 and size, reference_hash, data_hash.

    Exit 0 written; 3 bad input (the message names the file, the field and
    the fix)."""
    import os

    from runner.errors import ConfigError
    from runner.project import manifest_tools as mt
    from runner.report.files import check_output_file

    check_output_file(out_file, field="--out", run_dir=data,
                      why="the --data directory {dir}, whose stores the manifest hashes")
    if os.path.realpath(out_file) == os.path.realpath(scenarios):
        raise ConfigError(f"{out_file} is the --scenarios file; the manifest would replace "
                          "it", field="--out", fix="write the manifest to its own file, e.g. "
                          "manifest.json")
    built = mt.build(scenarios, data)
    mt.write_atomic(built.manifest, out_file)
    for w in built.warnings:
        err.print(f"[yellow]warning:[/] {safe(w)}", highlight=False)
    summary = mt.summary(built.manifest)
    if json_out:
        emit_json({"manifest": str(out_file), **summary, "warnings": built.warnings})
        return
    out.print(f"wrote {safe(out_file)}: {_counts(summary)}; reference_hash "
              f"{safe(built.manifest.reference_hash[:16])}…, data_hash "
              f"{safe(built.manifest.data_hash[:16])}…", highlight=False)


@manifest_app.command("check")
def manifest_check(manifest: Annotated[Path, typer.Argument(help="manifest.json")],
                   data: DataOpt = None, json_out: JsonOpt = False) -> None:
    """Verify every hash of MANIFEST against its scenarios and the data.

    Exit 0 all match; 4 a hash does not match (each named, with the fix
    `cyclebox manifest rehash`); 3 the manifest itself is malformed."""
    from runner.project import manifest_tools as mt

    data_dir = data if data is not None else manifest.parent / "data"
    found = mt.mismatches(manifest, data_dir)
    if json_out:
        emit_json({"manifest": str(manifest), "ok": not found,
                   "mismatches": [{"field": m.field, "message": m.message} for m in found]})
    m = mt.check(manifest, data_dir)  # CheckFailed (exit 4) naming each mismatch
    if not json_out:
        out.print(f"{safe(manifest)}: every hash matches ({_counts(mt.summary(m))})",
                  highlight=False)


@manifest_app.command("rehash")
def manifest_rehash(manifest: Annotated[Path, typer.Argument(help="manifest.json")],
                    data: DataOpt = None, json_out: JsonOpt = False) -> None:
    """Recompute MANIFEST's hashes in place; everything else is kept.

    For an intended change to the data or the references: each store's
    sha256 and size, reference_hash and data_hash are recomputed and the
    file replaced atomically.

    Exit 0 written (or already current); 3 bad input."""
    from runner.outdir import refuse_inside_run
    from runner.project import manifest_tools as mt

    refuse_inside_run(manifest, field="MANIFEST")  # a run's frozen copy is evidence
    data_dir = data if data is not None else manifest.parent / "data"
    changed = mt.rehash(manifest, data_dir)
    if json_out:
        emit_json({"manifest": str(manifest), "changed": changed})
    elif changed:
        out.print(f"rehashed {safe(manifest)}: {safe(', '.join(changed))}", highlight=False)
    else:
        out.print(f"{safe(manifest)}: already current; not rewritten", highlight=False)


@commands.command("schema")
def schema_cmd(name: Annotated[str | None, typer.Argument(
                   help="cycle, scenarios, manifest, policy, roles, script, answer, request, "
                        "reply, proposal, record, verdict")] = None,
               list_: Annotated[bool, typer.Option("--list", help="List the names.")] = False
               ) -> None:
    """Print the JSON schema of a file format; --list names them.

    Every field carries a description.

    Exit 0 printed; 3 unknown NAME (the message lists the known ones)."""
    from runner.project.schemas import names, schema

    if list_ or name is None:
        for n, summary in names():
            out.print(f"{n:<10} {safe(summary)}", highlight=False)
        return
    emit_json(schema(name))


def _counts(summary: dict[str, object]) -> str:
    per = summary["scenarios"]
    assert isinstance(per, dict)  # noqa: S101 - built by manifest_tools.summary
    return ", ".join(f"{v} {k}" for k, v in per.items()) + " scenario(s)"
