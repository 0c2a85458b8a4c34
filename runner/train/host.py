"""Host side of training: run the trainer image with no network and read-only inputs,
show its JSON progress events, check its receipt against the files, keep the ledger.

The trainer never sees a credential or the network; the base model, the persona or
corpus and the ledger are mounted read-only; it writes only its fresh output dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from runner import fswalk
from runner.errors import (
    ConfigError,
    CycleboxError,
    EnvironmentFailure,
    IntegrityError,
    Interrupted,
    OutputRejected,
    SandboxError,
)
from runner.failures import is_environment_error
from runner.isolation.collect import Collected, Limits, collect, loads_strict
from runner.isolation.launcher import launch, output_dir
from runner.isolation.policy import RolePolicy
from runner.isolation.sandbox import Mount, RunRecord, Sandbox
from runner.loading import MAX_BYTES, load_model, parse_model, show
from runner.outdir import refuse_inside_run, write_once
from runner.train.flags import check_seed, check_train_flags
from runner.train.results import (
    PERSONA_FIX,
    LedgerRow,
    Persona,
    ProofReceipt,
    ProofReport,
    ProofSummary,
    SftReceipt,
    TinyModel,
)

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", ProofReceipt, SftReceipt)

Events = Callable[[dict[str, Any]], None]


class _Lines:
    """Splits streamed stdout into JSON events."""

    def __init__(self, on_event: Events) -> None:
        self.buf = b""
        self.on_event = on_event

    def __call__(self, stream: str, chunk: bytes) -> None:
        if stream != "stdout":
            return
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            try:  # progress only: a line that is not an event is passed over, never fatal
                ev = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested past the stack;
                continue  # it ended the whole stream of events (the sink drops a raiser)
            if isinstance(ev, dict) and "event" in ev:
                self.on_event(ev)


@dataclass(frozen=True)
class Trainer:
    """Where the trainer role runs: the sandbox, the trainer policy and its image."""

    sandbox: Sandbox
    policy: RolePolicy
    image: str

    def fresh_output(self, path: Path) -> Path:
        """A fresh output directory for the trainer's user (never inside a run directory,
        whose receipt binds every file in it)."""
        refuse_inside_run(path)
        return output_dir(self.policy, path)


def run_trainer(trainer: Trainer, module: str, *, out: Path, mounts: list[Mount], run_id: str,
                on_event: Events, args: tuple[str, ...] = ()) -> RunRecord:
    """Run ``python -m module`` in the trainer image under the trainer policy."""
    return launch(trainer.sandbox, trainer.policy, role="trainer", run_id=run_id,
                  image=trainer.image, command=["python", "-m", module, *args], mounts=mounts,
                  output_dir=out, on_output=_Lines(on_event))


def make_tiny(trainer: Trainer, out: Path, on_event: Events, *, seed: int = 0) -> TinyModel:
    """Create the tiny model and tokenizer in the trainer container, into ``out``."""
    check_seed(seed)  # before --out is made
    trainer.fresh_output(out.resolve())
    rec = run_trainer(trainer, "sandbox.train.tiny", out=out.resolve(), mounts=[],
                      run_id="model-tiny",
                      on_event=on_event, args=("--out", "/out", "--seed", str(seed)))
    if rec.stop_reason.value != "ok":
        raise SandboxError(f"tiny model creation failed: {rec.stop_reason.value} "
                           f"{rec.stderr_tail[-500:]}")
    files = collect(out.resolve(), TRAINER_OUTPUT)
    hand_over(out.resolve())
    return _collected(files, "cyclebox-tiny.json", TinyModel)


def load_persona(path: Path) -> Persona:
    return load_model(path, Persona, fmt="yaml", what="persona", fix=PERSONA_FIX)


TRAINER_OUTPUT = Limits(max_file_bytes=1 << 30, max_total_bytes=2 << 30)
"""What the host reads of a trainer's ``--out`` (:func:`runner.isolation.collect.collect`:
regular files and directories only, no symlink followed or kept, bounded)."""


TRAINER_JSON_MAX_BYTES = MAX_BYTES
"""Largest JSON file of the trainer's the host parses (``report.json``,
``train-receipt.json``, ...): what :func:`runner.loading.load_model` reads of any JSON
file. :data:`TRAINER_OUTPUT` lets a file be 1 GiB (adapter weights); parsed, 128 MiB of
``[[],[],...]`` took 3.4 GB of the host's memory and 33 s."""


TRAINER_FILE_FIX = ("the trainer image writes this file; rebuild it "
                    "(cyclebox images build --role trainer)")


def _within_json_cap(name: str, raw: bytes) -> None:
    """OutputRejected, unparsed, for a trainer JSON file past :data:`TRAINER_JSON_MAX_BYTES`."""
    if len(raw) > TRAINER_JSON_MAX_BYTES:
        raise OutputRejected(f"trainer output refused: {name} is {len(raw)} bytes; the "
                             f"host parses at most {TRAINER_JSON_MAX_BYTES} bytes of it. "
                             f"Fix: {TRAINER_FILE_FIX}")


def _collected(files: Collected, name: str, model: type[M]) -> M:
    """A file the trainer wrote, typed; OutputRejected naming the field otherwise."""
    raw = files.files.get(name, b"")
    _within_json_cap(name, raw)
    try:
        return parse_model(raw, model, path=name, fix=TRAINER_FILE_FIX)
    except ConfigError as exc:
        raise OutputRejected(f"trainer output refused: {exc}") from None


def _check_model_dir(base: Path) -> None:
    if not (base / "config.json").is_file():
        raise ConfigError(f"{base} is not a model directory (no config.json)",
                          field="--base-model", fix="cyclebox model tiny --out DIR, or a local "
                          "transformers model directory")


def verify_receipt(out: Path, files: Collected, kind: type[R], *,
                   given: dict[str, Any] | None = None, corpus: Path | None = None) -> R:
    """The training receipt, typed; its adapter hashes must match the files written, and
    what it says of the inputs must be what the host gave: ``dataset_sha256`` the
    ``dataset.jsonl`` written, ``config_sha256`` its ``config``, each of ``given`` (the
    config the host wrote) in that config, and an sft receipt's ``corpus_sha256`` the
    ``corpus``'s trajectories.jsonl. Only the adapter was checked: a receipt naming
    another corpus, learning rate or dataset was kept as the run's record.

    ``files``: ``out`` as :func:`collect` read it (a symlink, hard link or special file
    anywhere in it already refused by name), so the hashes are of the bytes read, never
    of what a link points to."""
    from runner.hashing import sha256_bytes, sha256_file
    from sandbox.train.receipt import canonical

    receipt = _collected(files, "train-receipt.json", kind)
    where = f"{out}/train-receipt.json"
    actual = {rel.removeprefix("adapter/"): sha for rel, sha in files.sha256().items()
              if rel.startswith("adapter/")}
    if actual != receipt.adapter_files:
        raise IntegrityError(f"{where}: adapter hashes differ from the files")
    dataset = files.files.get("dataset.jsonl")
    if dataset is None or sha256_bytes(dataset) != receipt.dataset_sha256:
        raise IntegrityError(f"{where}: dataset_sha256 is not the sha256 of the "
                             "dataset.jsonl written")
    if sha256_bytes(canonical(receipt.config)) != receipt.config_sha256:
        raise IntegrityError(f"{where}: config_sha256 is not the sha256 of its config")
    for key, value in (given or {}).items():
        if key not in receipt.config or canonical(receipt.config[key]) != canonical(value):
            raise IntegrityError(f"{where}: config.{key} is not what the host gave the "
                                 f"trainer ({value!r})")
    if isinstance(receipt, SftReceipt) and corpus is not None and \
            sha256_file(corpus / "trajectories.jsonl") != receipt.corpus_sha256:
        raise IntegrityError(f"{where}: corpus_sha256 is not the sha256 of "
                             f"{corpus}/trajectories.jsonl")
    return receipt


def proof(trainer: Trainer, persona_path: Path, base: Path, out: Path, *, ledger: Path,
          lr: float, seed: int, on_event: Events) -> ProofSummary:
    """Run the proof loop; verify the adapter in a fresh container; append the ledger row."""
    check_train_flags(seed=seed, lr=lr)
    persona = load_persona(persona_path)
    _check_model_dir(base)
    check_ledger(ledger)  # the row can be appended once the training is done
    text = _ledger_text(ledger)  # every input is checked before --out is made
    history = _ledger_rows(ledger, text)
    out = out.resolve()
    summary_path = _summary_path(out)  # refused now if taken, not after the training
    _no_stale_verify(out)  # likewise: it was made only after the training
    trainer.fresh_output(out)
    given = {"persona.json": json.dumps(persona.model_dump(mode="json", exclude_unset=True),
                                        sort_keys=True),
             "config.json": json.dumps({"lr": lr, "seed": seed})}
    if text is not None:  # the rows as checked: the trainer splits lines after reading
        # them with universal newlines, so a '\r' inside a line the host read as one
        # object was two broken lines there (a traceback, exit 6, after the container ran)
        given["ledger.jsonl"] = "".join(json.dumps(r, sort_keys=True) + "\n" for r in history)
    try:
        inputs = _fresh_inputs(out, given)
    except BaseException:  # nothing ran: --out must not block the rerun
        shutil.rmtree(out, ignore_errors=True)
        raise
    try:
        rec = run_trainer(trainer, "sandbox.train.proof", out=out, run_id="train-proof",
                          on_event=on_event,
                          mounts=[Mount(source=inputs, target="/in"),
                                  Mount(source=base.resolve(), target="/model")])
        if rec.stop_reason.value not in ("ok", "process_failed") or rec.exit_code not in (0, 4):
            raise SandboxError(f"proof loop failed: {rec.stop_reason.value} {rec.detail} "
                               f"{rec.stderr_tail[-800:]}")
        files = collect(out, TRAINER_OUTPUT)
        report = _collected(files, "report.json", ProofReport)
        receipt = verify_receipt(out, files, ProofReceipt, given={"lr": lr, "seed": seed})
        row = settle(persona, history, report, receipt,
                     _collected(files, "ledger-row.json", LedgerRow), rec.exit_code)
        check = out.parent / f".{out.name}.verify"
        trainer.fresh_output(check)
        shutil.copyfile(out / "report.json", inputs / "report.json")
        (inputs / "report.json").chmod(0o644)
        verified: dict[str, Any] = {}
        vrec = run_trainer(trainer, "sandbox.train.verify_adapter", out=check,
                           run_id="train-verify", on_event=verified.update,
                           mounts=[Mount(source=inputs, target="/in"),
                                   Mount(source=base.resolve(), target="/model"),
                                   Mount(source=out / "adapter", target="/adapter")])
        reproduced = verified.get("reproduced") is True and vrec.exit_code == 0
        try:
            append_ledger_row(ledger, row, out, note=f"classroom "
                              f"{'passed' if row.passed else 'failed'}, reproduced in a "
                              f"fresh process: {'yes' if reproduced else 'no'}")
        except CycleboxError:
            hand_over(out)  # what was trained stays, the operator's to read
            raise
        summary = ProofSummary(
            exit_code=rec.exit_code, report=report, receipt=receipt,
            reproduced_in_fresh_process=reproduced,
            ledger=str(ledger), ledger_row=row,
            trainer_run=rec.model_dump(mode="json", exclude={"stdout_tail"}))
        hand_over(out)
        write_once(summary_path, json.dumps(summary.model_dump(
            mode="json", by_alias=True), indent=1, sort_keys=True).encode(),
            what="the proof summary", field="--out",
            fix=f"the adapter, receipt and ledger row are in {out}; choose a new --out")
        return summary
    finally:
        shutil.rmtree(inputs, ignore_errors=True)
        shutil.rmtree(out.parent / f".{out.name}.verify", ignore_errors=True)


def check_adapter_base(out: Path, files: Collected, base: str) -> None:
    """The adapter's ``adapter_config.json`` (the trainer's file) names ``base``, the
    host's --base-model, as its base model: ``AutoPeftModelForCausalLM.from_pretrained``
    on the host loads whatever it names (another local directory, or a hub id it would
    download), and nothing checked it. IntegrityError otherwise; a file past
    :data:`TRAINER_JSON_MAX_BYTES` is refused unparsed (TRAINER_OUTPUT lets it be 1 GiB,
    and 64 MiB of ``[[],[],...]`` took 1.7 GB of the host's memory and 15 s to parse)."""
    name = "adapter/adapter_config.json"
    raw = files.files.get(name)
    if raw is None:
        raise IntegrityError(f"{out}/{name} is missing: nothing says which base model the "
                             f"adapter loads. Fix: {TRAINER_FILE_FIX}")
    _within_json_cap(name, raw)
    try:
        doc = loads_strict(raw, source=name)
    except OutputRejected as exc:
        raise IntegrityError(f"{out}/{show(str(exc), 300)}. Fix: {TRAINER_FILE_FIX}") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{out}/{name} is not a JSON object. Fix: {TRAINER_FILE_FIX}")
    named = doc.get("base_model_name_or_path")
    if named != base:
        raise IntegrityError(f"{out}/{name}: the adapter's base model is "
                             f"{show(repr(named), 200)}, not --base-model {base}; the "
                             "adapter would load another model on this host")


def _no_stale_verify(out: Path) -> None:
    """``.OUT.verify`` (the fresh-process check's output, made after the training) must
    not exist: a proof killed during that check leaves it, and the next run with that
    --out trained in full, then ended in 'already exists' for a directory the operator
    never named, --out left behind and no ledger row appended."""
    check = out.parent / f".{out.name}.verify"
    if check.exists() or check.is_symlink():
        raise ConfigError(f"{check} exists: the fresh-process check directory of a proof "
                          "with this --out that was killed before it could remove it",
                          field="--out", fix=f"remove {check}, or choose another --out")


def _summary_path(out: Path) -> Path:
    """``OUT.summary.json``, which must not exist yet (nor be a link, even a dangling one):
    written beside ``out`` after the training, it was written through a symlink and over
    an earlier run's summary, and a directory there ended the run in exit 10 after the
    ledger row was appended."""
    path = out.parent / f"{out.name}.summary.json"
    if path.exists() or path.is_symlink():
        raise ConfigError(f"{path} already exists; prior evidence is never overwritten",
                          field="--out", fix="choose a new output directory (the summary "
                          "is written beside it as OUT.summary.json)")
    return path


MAX_LEDGER_BYTES = 64 * 1024 * 1024
"""Largest feedback ledger read (one short JSON line per proof run)."""
LEDGER_FIX = ("give --ledger a regular file, or a new file's name, in a directory you can "
              "write (the default is <state dir>/train/ledger.jsonl)")


def check_ledger(ledger: Path) -> None:
    """Refuse, before any training, a ledger the proof could not append its row to: one
    that is a directory, a device, FIFO or socket (or a symlink to one, or dangling), a
    file that cannot be written (read-only file system, not permitted), or a new ledger
    whose nearest existing directory cannot be written (the missing ones are made when
    the row is appended). The append itself is :func:`append_ledger_row`."""
    def refuse(msg: str, fix: str = LEDGER_FIX) -> ConfigError:
        return ConfigError(msg, path=str(ledger), field="--ledger", fix=fix)

    refuse_inside_run(ledger, field="--ledger")  # a row appended there broke its receipt

    try:
        st: os.stat_result | None = os.stat(ledger)  # a symlink is judged by its target
    except FileNotFoundError:
        if ledger.is_symlink():
            raise refuse("is a symlink to a missing file", fix="point the link at a "
                         "regular file, remove it, or " + LEDGER_FIX) from None
        st = None
    except NotADirectoryError:
        raise refuse("a parent of the ledger is not a directory") from None
    except OSError as exc:
        raise refuse(f"cannot be inspected: {exc.strerror}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise refuse("is a directory; the proof appends one JSON line to a file",
                          fix="give a file name, e.g. DIR/ledger.jsonl")
        if not stat.S_ISREG(st.st_mode):
            raise refuse("is not a regular file (a device, FIFO or socket); the proof "
                         "appends one JSON line to it")
        if not os.access(ledger, os.W_OK):  # also False on a read-only mount, for root
            raise refuse("cannot be appended to (read-only file system or not permitted); "
                         "the row would be lost after the training")
        return
    parent = Path(os.path.abspath(ledger)).parent
    while not os.path.exists(parent) and parent != parent.parent:
        parent = parent.parent  # missing directories are made at the append
    if not parent.is_dir():
        raise refuse(f"{parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise refuse(f"cannot create the ledger: {parent} is read-only or not writable; "
                     "the row would be lost after the training")


def append_ledger_row(ledger: Path, row: LedgerRow, out: Path, *, note: str = "") -> None:
    """Append ``row`` to the ledger as one JSON line (missing directories made).

    A ledger that refuses it after the training (made read-only, replaced by a directory
    or FIFO, the disk full) is a ConfigError naming ``--ledger`` (an EnvironmentFailure
    when the machine failed: disk full, quota), never an unexpected error; the message
    says where the adapter, the receipt and the row itself are kept (``out``, whose
    ``ledger-row.json`` holds the same row). A partly written line is taken back, so the
    ledger stays one JSON object per line and no row already in it is touched."""
    line = (json.dumps(row.model_dump(mode="json"), sort_keys=True) + "\n").encode()
    kept = (f"the adapter and receipt are kept in {out}, the row in {out}/ledger-row.json"
            + (f"; {note}" if note else ""))

    def failed(what: str, exc: OSError | None = None) -> CycleboxError:
        why = f"{what}: {exc.strerror or exc}" if exc is not None else what
        text = f"the ledger row could not be appended ({why}); {kept}"
        fix = (f"make {ledger} appendable (or free space), then append the line in "
               f"{out}/ledger-row.json to it")
        if exc is not None and is_environment_error(exc):
            return EnvironmentFailure(f"{ledger}: --ledger: {text}. Fix: {fix}")
        return ConfigError(text, path=str(ledger), field="--ledger", fix=fix)

    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
             | getattr(os, "O_CLOEXEC", 0))
    try:
        ledger.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(ledger, flags, 0o666)  # a FIFO without a reader: ENXIO, no hang
    except OSError as exc:
        raise failed("cannot open it", exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise failed("it is not a regular file")
        written = 0
        try:
            while written < len(line):
                written += os.write(fd, line[written:])
        except OSError as exc:
            # take back a partial line, unless someone else appended meanwhile
            with contextlib.suppress(OSError):
                if written and os.fstat(fd).st_size == st.st_size + written:
                    os.ftruncate(fd, st.st_size)
            raise failed("cannot write it", exc) from None
    finally:
        os.close(fd)


def _ledger_text(ledger: Path) -> str | None:
    """The ledger's text; None when there is none yet (the first run makes it)."""
    from runner.loading import decode_utf8, read_capped

    if not ledger.exists() and not ledger.is_symlink():
        return None
    fix = "the ledger the proof loop appends to (one JSON object per line)"
    data = read_capped(ledger, max_bytes=MAX_LEDGER_BYTES, what="ledger", fix=fix,
                       ref=(str(ledger), "--ledger"))
    return decode_utf8(data, path=str(ledger))


class _LedgerLine(BaseModel):
    """What ``sandbox.train.plan.nudge`` reads of a ledger line with ``float()``; other
    keys (and rows of an older shape) pass as they are."""

    model_config = ConfigDict(extra="allow")

    imprint_delta: float = 1.0


def _ledger_rows(ledger: Path, text: str | None) -> list[dict[str, Any]]:
    """The ledger's rows, as the trainer reads them to set the schedule: each line strict
    JSON (no NaN, duplicate key or nesting past 64) whose fields the schedule reads have
    a type it can read (:class:`_LedgerLine`). A row with ``imprint_delta: "tiny"`` ended
    the proof in the trainer's traceback (exit 6, --out left behind), and a deeply nested
    line in exit 10 (RecursionError); now ConfigError naming the line and the field."""
    from runner.loading import show, validate
    from sandbox.proposal import strict_json

    if text is None:
        return []
    fix = ("one JSON object per line, as the proof loop appends them (see LedgerRow in "
           "runner/train/results.py); remove or repair the line")
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = strict_json(line)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"line {n} is not JSON ({show(str(exc), 200)})",
                              path=str(ledger), field="--ledger", fix=fix) from None
        if not isinstance(row, dict):
            raise ConfigError(f"line {n} is not a JSON object", path=str(ledger),
                              field="--ledger", fix="one JSON object per line")
        validate(_LedgerLine, row, path=f"--ledger {show(str(ledger))}:{n}", fix=fix)
        rows.append(row)
    return rows


def settle(persona: Persona, ledger: list[dict[str, Any]], report: ProofReport,
           receipt: ProofReceipt, written: LedgerRow, exit_code: int | None) -> LedgerRow:
    """The host's own decision from the trainer's answers, and the ledger row built from
    it: the trainer reports what the model answered before and after training, but its
    scores, classroom, board, schedule, receipt, ledger row and exit code are checked
    against the same pure functions (``sandbox.train.plan``) run here. A trainer that
    claims an imprint its answers do not show, or probes other questions, is an
    IntegrityError naming the field; nothing is appended to the ledger."""
    from sandbox.train import plan

    def refuse(what: str) -> IntegrityError:
        return IntegrityError(f"the trainer's report.json disagrees with {what}; the run is "
                              "not counted and the ledger is unchanged")

    data = persona.model_dump(mode="json", exclude_unset=True)
    probes = tuple(str(e["user"]) for e in data.get("exchanges", []))
    refs = tuple(str(e["assistant"]) for e in data.get("exchanges", []))
    if report.persona != persona.name:
        raise refuse(f"the persona's name (persona: {report.persona[:80]!r})")
    if report.probes != probes or report.references != refs:
        raise refuse("the persona's exchanges (probes or references)")
    if not len(report.before) == len(report.after) == len(probes):
        raise refuse(f"the number of probes ({len(probes)}): {len(report.before)} answers "
                     f"before, {len(report.after)} after")
    rows = plan.rows_from_persona(data)
    sched = plan.nudge(plan.base_schedule(len(rows)), plan.last_row(ledger, persona.name))
    if (report.schedule.epochs, report.schedule.grad_accum, report.schedule.reason) != (
            sched.epochs, sched.grad_accum, sched.reason):
        raise refuse("the schedule its rows and the ledger set")
    before, after = list(report.before), list(report.after)
    scores = plan.imprint(before, after, list(refs))
    recall_before, recall_after = plan.recall(before, list(refs)), plan.recall(after, list(refs))
    passed = plan.classroom(scores)
    board = plan.board(scores, recall_after, after)
    if (report.scores.model_dump(), report.recall_before, report.recall_after,
            report.classroom_passed, report.board.model_dump()) != (
            scores, recall_before, recall_after, passed, board):
        raise refuse("the scores, recall, classroom or board its own answers give")
    if (receipt.scores.model_dump(), receipt.recall_before, receipt.recall_after,
            receipt.classroom_passed, receipt.board) != (
            scores, recall_before, recall_after, passed, board["decision"]):
        raise refuse("its training receipt (scores, recall, classroom or board)")
    if exit_code != (0 if passed else 4):
        raise refuse(f"its exit code ({exit_code}; the classroom "
                     f"{'passed' if passed else 'failed'})")
    row = LedgerRow(persona=persona.name, passed=passed, rows=len(rows), epochs=sched.epochs,
                    grad_accum=sched.grad_accum, imprint_delta=scores["imprint_delta"],
                    recall_before=recall_before, recall_after=recall_after,
                    board=board["decision"])
    if written != row:
        raise refuse("the ledger row its answers give (ledger-row.json)")
    return row


def _fresh_inputs(out: Path, files: dict[str, str]) -> Path:
    """A private, world-readable (for the role uid) sibling directory of input files."""
    inputs = out.parent / f".{out.name}.in"
    try:
        inputs.mkdir(mode=0o755)
    except FileExistsError:  # was exit 10 (FileExistsError), --out left behind
        raise ConfigError(f"{inputs} exists: the inputs directory of a training run with "
                          "this --out that was killed before it could remove it",
                          field="--out", fix=f"remove {inputs}, or choose another --out"
                          ) from None
    try:
        for name, text in files.items():
            (inputs / name).write_text(text)
            (inputs / name).chmod(0o644)
    except BaseException:  # a full disk: left behind, the rerun was told it was killed
        shutil.rmtree(inputs, ignore_errors=True)
        raise
    return inputs


def invoking_user() -> tuple[int, int]:
    """(uid, gid) of the operator: SUDO_UID/SUDO_GID when root runs on their behalf."""
    if os.getuid() == 0 and os.environ.get("SUDO_UID", "").isdigit():
        uid = int(os.environ["SUDO_UID"])
        gid = int(os.environ["SUDO_GID"]) if os.environ.get("SUDO_GID", "").isdigit() else uid
        return uid, gid
    return os.getuid(), os.getgid()


def hand_over(out: Path) -> None:
    """Give the trainer's outputs to the operator: owned by the invoking user (when we are
    root), directories 0755 and files 0644, so a non-root operator can read and load them.

    Never follows a symlink (lchown; symlinks are left alone, never chmod-ed through) and
    never sets setuid/setgid/sticky bits: the modes are absolute."""
    uid, gid = invoking_user()
    root = os.getuid() == 0

    def give(name: str, dir_fd: int | None, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):
            return
        if root:
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            os.chmod(name, 0o755, dir_fd=dir_fd)  # noqa: S103 - the operator reads it
        elif stat.S_ISREG(st.st_mode):
            os.chmod(name, 0o644, dir_fd=dir_fd)

    # By directory descriptor (runner.fswalk): a path past PATH_MAX is handed over like
    # any other, and a directory that cannot be read is a named error, never skipped (a
    # directory is made readable before the walk enters it).
    try:
        give(str(out), None, out.lstat())
        for e in fswalk.walk(out, max_depth=4096):
            try:
                give(e.name, e.parent_fd, e.st)
            except OSError as exc:
                raise fswalk.WalkError(e.rel, f"cannot hand it over: {exc.strerror}"
                                       ) from None
    except fswalk.WalkError as exc:
        raise EnvironmentFailure(f"{out}/{exc}: the trainer's outputs could not all be "
                                 "handed to the operator") from None


def sft(trainer: Trainer, corpus: Path, base: Path, out: Path, *, lr: float, seed: int,
        epochs: int | None, on_event: Events, include_failed: bool = False) -> SftReceipt:
    """LoRA SFT on the corpus's trajectories that passed (all with ``include_failed``).

    The adapter names ``base`` (resolved on the host) as its base model; the receipt keeps
    the container path too. Outputs are handed to the invoking user (:func:`hand_over`)."""
    check_train_flags(seed=seed, lr=lr, epochs=epochs)  # before --out is made
    if not (corpus / "trajectories.jsonl").is_file():
        raise ConfigError(f"{corpus}/trajectories.jsonl not found", field="--corpus",
                          fix="cyclebox export --run RUN --format verl --out CORPUS")
    _check_model_dir(base)
    out = out.resolve()
    trainer.fresh_output(out)
    try:
        inputs = _fresh_inputs(out, {"config.json": json.dumps({
            "lr": lr, "seed": seed, "epochs": epochs, "include_failed": include_failed,
            "base_model_host": str(base.resolve())})})
    except BaseException:  # nothing ran: --out must not block the rerun
        shutil.rmtree(out, ignore_errors=True)
        raise
    interrupted = False
    try:
        rec = run_trainer(trainer, "sandbox.train.sft", out=out, run_id="train-sft",
                          on_event=on_event,
                          mounts=[Mount(source=inputs, target="/in"),
                                  Mount(source=corpus.resolve(), target="/corpus"),
                                  Mount(source=base.resolve(), target="/model")])
        if rec.exit_code == 3 and rec.stop_reason.value == "process_failed":
            raise ConfigError("nothing to train on: no trajectory with a reply passed the "
                              "selection (r_outcome == 1)", path=str(corpus), field="--corpus",
                              fix="export a run where some cases passed, or pass "
                              "--include-failed to learn from every trajectory")
        if rec.stop_reason.value != "ok":
            raise SandboxError(f"sft failed: {rec.stop_reason.value} {rec.detail} "
                               f"{rec.stderr_tail[-800:]}")
        files = collect(out, TRAINER_OUTPUT)
        check_adapter_base(out, files, str(base.resolve()))
        return verify_receipt(out, files, SftReceipt, given={
            "lr": lr, "seed": seed, "include_failed": include_failed,
            "base_model_host": str(base.resolve())}, corpus=corpus)
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
        raise
    finally:
        shutil.rmtree(inputs, ignore_errors=True)
        if interrupted:
            # stopped by a signal: no receipt claims anything, and an --out left behind
            # would only make the same command refuse to run again ("exists")
            shutil.rmtree(out, ignore_errors=True)
        else:
            hand_over(out)  # the evidence of a failed run too
