"""The role command started by the holder (PID 1) itself, no ``docker exec``: what it can
and cannot do to the channel that carries its output and exit status to the host, and
the one-case life of a prepared container.

- the exit status is the holder's ``waitpid``, sent in its own frame: a role that writes
  the holder's readiness marker and well-formed exit, tar and start frames to its stdout
  (or stderr) only ever shows them as its own output, byte for byte;
- bytes the role writes into the holder's own stdout are refused: under runc it cannot
  open ``/proc/1/fd/1`` (PID 1 is non-dumpable); under gVisor it can, and the frames'
  per-case tags refuse what it wrote (the run fails closed, named);
- the command runs under the container's seccomp profile, by behaviour (a syscall the
  profile denies fails) under runc and under runsc (which filters the first process
  only: the holder, whose child the command is);
- a prepared container serves exactly one case: removed after its run, after a
  discard, never run twice; labelled for ``cyclebox gc`` while it waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from runner.errors import SandboxError
from runner.isolation.docker.images import resolve_image
from runner.isolation.policy import RolePolicies
from runner.isolation.roles import role_spec
from runner.isolation.sandbox import LABEL_PREFIX, RunRecord, RunSpec, StopReason
from sandbox.holder import F_EXIT, F_STARTED, F_TAR, READY, frame
from tests.conftest import RunFn

pytestmark = pytest.mark.docker

FAKE = (READY + frame(F_STARTED, b'{"pid": 2}') + frame(F_EXIT, b'{"code": 0}')
        + frame(F_TAR, bytes(1024)))
"""What a role would write to pass for the holder: marker, start, exit 0, an empty tar."""

FORGER = f"""
import os, sys
fake = {FAKE!r}
os.write(1, fake); os.write(2, fake)
sys.exit(3)
"""

INJECTOR = f"""
import os, sys
fake = {FAKE!r}
try:
    fd = os.open("/proc/1/fd/1", os.O_WRONLY)
except OSError as e:
    print("holder fd:", e.strerror)
else:
    for _ in range(3):
        os.write(fd, fake[len(b"cyclebox-holder-ready\\n"):])
    print("wrote into the holder's stdout")
sys.exit(3)
"""


def injection_refused(rec: RunRecord, runtime: str | None) -> None:
    """What a role that wrote into ``/proc/1/fd/1`` (``INJECTOR``) must come to: under
    runc it could not open it; under gVisor it could, and the frames' tags refused it."""
    assert rec.stop_reason is not StopReason.OK and rec.exit_code != 0, rec
    if "holder fd: " in rec.stdout_tail:
        assert runtime is None, "gVisor refused /proc/1/fd/1: drop the runsc case's note"
        assert rec.exit_code == 3 and rec.detail == "exit code 3"
    else:
        assert runtime == "runsc", "/proc/1/fd/1 of a non-dumpable PID 1 was opened"
        assert "failed authentication" in rec.detail, rec.detail


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_a_role_cannot_forge_its_exit_status(run_role: RunFn, runtime: str | None) -> None:
    rec = run_role(["python", "-c", FORGER], runtime=runtime)
    assert rec.exit_code == 3, rec
    assert rec.stop_reason is StopReason.PROCESS_FAILED and rec.detail == "exit code 3"
    # the forged frames arrive as the role's own output, byte for byte, counted
    shown = FAKE.decode("utf-8", "replace")
    assert rec.stdout_tail == shown and rec.stderr_tail == shown
    assert rec.stdout_bytes == rec.stderr_bytes == len(FAKE)
    out = rec.__dict__["output_dir"]
    assert out is not None and list(Path(out).iterdir()) == []


FILLS_THE_SIGNAL_QUEUE = r"""
import ctypes, os, resource, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
print("limit", resource.getrlimit(resource.RLIMIT_SIGPENDING), flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})
n = 0  # this uid's count of queued signals, filled with real-time signals to itself
while n < 1 << 20 and libc.sigqueue(os.getpid(), signal.SIGRTMIN, None) == 0:
    n += 1
print("queued", n, flush=True)
libc.sigqueue(1, signal.SIGUSR1, None)  # with no room to queue its details...
time.sleep(3)
print("the case went on", flush=True)
sys.exit(5)
"""


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_a_role_cannot_pass_its_sigusr1_for_the_hosts(run_role: RunFn,
                                                     runtime: str | None) -> None:
    """helper-36: a role that filled its uid's count of queued signals had the kernel
    deliver its ``sigqueue(1, SIGUSR1)`` with blank details, read as the host's kill
    (pid 0, SI_USER), and ended its own case (137, ``process_failed``). Every role
    process now has a small ``RLIMIT_SIGPENDING`` it cannot raise: the count stays
    under the holder's, and the signal names its sender."""
    rec = run_role(["python", "-c", FILLS_THE_SIGNAL_QUEUE], runtime=runtime)
    assert rec.exit_code == 5 and "the case went on" in rec.stdout_tail, rec
    if runtime is None:  # gVisor keeps its own count; the limit is set there too
        assert "limit (1024, 1024)" in rec.stdout_tail, rec.stdout_tail


FILLS_PAST_THE_ROLE_LIMIT = r"""
import ctypes, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
def fill():  # ordinary signals to itself: queued past any limit (the kernel's override)
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals()
                           - {signal.SIGKILL, signal.SIGSTOP})
    pid, tid = os.getpid(), libc.syscall(186)
    info = ctypes.create_string_buffer(128)
    for s in [s for s in range(1, 32) if s not in (9, 19)]:
        os.kill(pid, s)
        ctypes.memset(info, 0, 128)
        ctypes.c_int.from_buffer(info, 0).value = s
        ctypes.c_int.from_buffer(info, 16).value = pid
        libc.syscall(297, pid, tid, s, info)  # rt_tgsigqueueinfo to its own thread
r, w = os.pipe()
kids = 0
for _ in range(110):
    if os.fork() == 0:
        fill()
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    kids += 1
os.close(w)
got = 0
while got < kids:
    got += len(os.read(r, 4096))
fill()
queued = [l.split()[1] for l in open("/proc/self/status") if l.startswith("SigQ")]
print("queued", queued, flush=True)
libc.sigqueue(1, signal.SIGUSR1, None)
time.sleep(3)
print("the case went on", flush=True)
sys.exit(5)
"""


def test_a_role_cannot_end_its_case_past_the_holders_signal_limit(
        run_role: RunFn, monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-38: ordinary signals a process queues to itself pass any
    RLIMIT_SIGPENDING (the kernel's override) and still count, so 110 role processes
    took the uid's count past a holder limit of 6000 (a ~1.5 GiB host's default) and
    their sigqueue(1, SIGUSR1) came with blank details again: 137. The holder now ends a
    case only on the host's stop frame on its stdin (which no role can write under runc)
    together with the signal."""
    from runner.isolation.docker import hardening, prepared

    made = hardening.create_kwargs

    def small_host(*args: Any, **kwargs: Any) -> dict[str, Any]:
        kw = made(*args, **kwargs)
        kw["ulimits"] = [*kw["ulimits"], {"Name": "sigpending", "Soft": 6000, "Hard": 6000}]
        return kw

    monkeypatch.setattr(hardening, "create_kwargs", small_host)
    monkeypatch.setattr(prepared, "create_kwargs", small_host)
    rec = run_role(["python", "-c", FILLS_PAST_THE_ROLE_LIMIT], pids=256)
    assert rec.exit_code == 5 and "the case went on" in rec.stdout_tail, rec


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_bytes_written_into_the_holders_stdout_are_refused(run_role: RunFn,
                                                           runtime: str | None) -> None:
    """runc: PID 1 is non-dumpable, /proc/1/fd/1 is not the role's to open. gVisor lets
    a same-uid process open it anyway: there the frames' tags (keyed per case, the key
    out of the role's reach) refuse what the role wrote, and the run fails closed."""
    rec = run_role(["python", "-c", INJECTOR], runtime=runtime)
    injection_refused(rec, runtime)
    out = rec.__dict__["output_dir"]
    assert out is not None and list(Path(out).iterdir()) == []


def test_exit_and_signal_codes_are_the_holders_waitpid(run_role: RunFn) -> None:
    assert run_role(["sh", "-c", "exit 7"]).exit_code == 7
    killed = run_role(["sh", "-c", "kill -TERM $$"])
    assert killed.exit_code == 128 + 15 and killed.stop_reason is StopReason.PROCESS_FAILED
    missing = run_role(["/nonexistent-binary"])
    assert missing.exit_code == 127 and missing.stop_reason is StopReason.PROCESS_FAILED
    assert "cannot run '/nonexistent-binary'" in missing.stderr_tail


SECCOMP_DENIED = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return "ok" if r >= 0 else os.strerror(ctypes.get_errno())
print(json.dumps({"io_uring_setup": call(425, 1, ctypes.create_string_buffer(120)),
                  "keyctl": call(250, 0, 0, 0, 0, 0),
                  "unshare_newuser": call(272, 0x10000000)}))
"""


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_the_role_command_runs_under_the_seccomp_profile(run_role: RunFn,
                                                         runtime: str | None) -> None:
    """By behaviour (x86_64 numbers): each call is one the shipped profile denies."""
    rec = run_role(["python", "-c", SECCOMP_DENIED], runtime=runtime)
    assert rec.stop_reason is StopReason.OK, rec
    got = json.loads(rec.stdout_tail)
    assert got["io_uring_setup"] in ("Operation not permitted", "Function not implemented")
    assert got["keyctl"] == "Operation not permitted", got
    assert got["unshare_newuser"] == "Operation not permitted", got


def _spec(policies: RolePolicies, command: list[str], tmp_path: Path, name: str) -> RunSpec:
    out = tmp_path / name
    out.mkdir()
    return role_spec(policies.roles["analyst"], role="analyst", run_id="test-prepared",
                     image=resolve_image("analyst"), command=command, output_dir=out)


def _known(backend: Any, name: str) -> bool:
    return name in [n for _, n, _ in backend.managed_containers()]


def test_a_prepared_container_serves_one_case_then_is_removed(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    prepared = backend.prepare(_spec(policies, ["sh", "-c", "echo once >> /out/runs"],
                                     tmp_path, "a"))
    name = str(prepared.kwargs["name"])
    labels = next(lb for _, n, lb in backend.managed_containers() if n == name)
    assert labels[f"{LABEL_PREFIX}.run_id"] == "test-prepared"  # gc can find it
    rec = prepared.run()
    assert rec.stop_reason is StopReason.OK and rec.cleanup_confirmed, rec
    assert not _known(backend, name)
    assert prepared.run() is rec  # the second run is the first one's record, not a rerun
    assert (tmp_path / "a" / "runs").read_text() == "once\n"
    prepared.discard()  # after the run: a no-op
    assert not _known(backend, name)


def test_a_discarded_prepared_container_is_removed_unrun(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    prepared = backend.prepare(_spec(policies, ["sh", "-c", "echo ran > /out/ran"],
                                     tmp_path, "b"))
    name = str(prepared.kwargs["name"])
    assert _known(backend, name)
    prepared.discard()
    assert not _known(backend, name)
    prepared.discard()  # twice: a no-op
    with pytest.raises(SandboxError, match="discarded before it ran"):
        prepared.run()
    assert list((tmp_path / "b").iterdir()) == []


def test_a_prepared_container_waits_for_its_case(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    """Nothing of the role runs before the hand-over: the holder is alone in it."""
    prepared = backend.prepare(_spec(policies, ["sh", "-c", "echo started"], tmp_path, "c"))
    try:
        top = backend.client.api.top(prepared.cid)
        assert len(top["Processes"]) == 1, top  # PID 1, the holder, waiting
        time.sleep(0.5)
    finally:
        rec = prepared.run()
    assert rec.stdout_tail == "started\n"


def test_the_holder_kills_nothing_outside_its_own_namespace(tmp_path: Path,
                                                            holder_dir: Path) -> None:
    """``finish`` as anything but PID 1 (a test, a mistake) must not ``kill(-1)``: for an
    unprivileged uid that would be every process of that uid on the host."""
    from runner.isolation.docker.hardening import holder_argv

    if os.getuid() != 0:
        pytest.fail("needs root, to run as a uid no one else uses")
    uid = 54321
    sleeper = subprocess.Popen(["sleep", "30"], user=uid, group=uid)
    try:
        res = subprocess.run(holder_argv("finish", "-", where=str(holder_dir)), user=uid, group=uid,
                             capture_output=True, timeout=30, check=False)
        assert b'"phase": "pre"' in res.stderr
        assert sleeper.poll() is None, "the holder killed a process outside its container"
    finally:
        sleeper.kill()
        sleeper.wait(10)


FDS = """
import json, os
fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
print(json.dumps({"fds": fds, "stdin": os.readlink("/proc/self/fd/0")}))
"""


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_the_role_holds_none_of_the_holders_descriptors(run_role: RunFn,
                                                        runtime: str | None) -> None:
    """Only its own stdio: /dev/null as stdin, the holder's pipes as stdout/stderr (and
    the descriptor its own listing opened); never the channel, never a relay socket."""
    rec = run_role(["python", "-c", FDS], runtime=runtime)
    assert rec.stop_reason is StopReason.OK, rec
    got = json.loads(rec.stdout_tail)
    assert got["fds"][:3] == [0, 1, 2] and len(got["fds"]) <= 4, got
    assert got["stdin"] == "/dev/null"


def _staged_spec(policies: RolePolicies, tmp_path: Path, command: list[str]) -> RunSpec:
    from runner.isolation.sandbox import Mount

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "input.txt").write_text("in\n")
    return role_spec(policies.roles["analyst"], role="analyst", run_id="test-prepared-stop",
                     image=resolve_image("analyst"), command=command,
                     mounts=[Mount(source=data, target="/in")])


def _left(backend: Any) -> list[str]:
    return [n for _, n, lb in backend.managed_containers()
            if lb.get(f"{LABEL_PREFIX}.run_id") == "test-prepared-stop"]


@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.3])
def test_a_stopping_caller_gets_nothing_prepared_and_nothing_left(
        backend: Any, policies: RolePolicies, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, after_s: float) -> None:
    """``cancel`` set before or while a container is prepared (create, start, waiting for
    READY): SandboxError, the container removed and its staging copy gone, without
    waiting for the holder (a stopping controller exits within its grace period)."""
    import threading

    staging = tmp_path / "staging"
    monkeypatch.setenv("CYCLEBOX_STAGING_DIR", str(staging))
    cancel = threading.Event()
    timer = threading.Timer(after_s, cancel.set)
    if after_s:
        timer.start()
    else:
        cancel.set()
    try:
        prepared = backend.prepare(_staged_spec(policies, tmp_path, ["true"]), cancel=cancel)
    except SandboxError as exc:
        assert "stopping" in str(exc)
    else:  # prepared before the timer fired: the hand-over refuses it instead
        try:
            assert after_s, "cancel was set before prepare: nothing may be created"
            cancel.wait(10)
            with pytest.raises(SandboxError, match="stopping"):
                prepared.run(cancel=cancel)
        finally:
            prepared.discard()
    finally:
        timer.cancel()
    assert _left(backend) == []
    assert not staging.exists() or list(staging.iterdir()) == []


def test_a_stopping_caller_ends_a_running_case(
        backend: Any, policies: RolePolicies, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    staging = tmp_path / "staging"
    monkeypatch.setenv("CYCLEBOX_STAGING_DIR", str(staging))
    spec = _staged_spec(policies, tmp_path, ["sleep", "120"]).model_copy(
        update={"timeout_s": 20})
    prepared = backend.prepare(spec)
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    rec = prepared.run(cancel=cancel)
    assert rec.stop_reason is StopReason.PROCESS_FAILED, rec  # killed, never a timeout
    assert rec.cleanup_confirmed and _left(backend) == []
    assert not staging.exists() or list(staging.iterdir()) == []


# -- a warm start: the interpreter imports ahead of the case ------------------------------

WARM_AGENT = """
import json, os, sys, time
from openai import OpenAI
main_at = time.time()
reply = OpenAI().chat.completions.create(
    model="fixture-target", messages=[{"role": "user", "content": "ping"}])
print(json.dumps({"main_at": main_at, "imported_at": float(open("/tmp/imported").read()),
                  "early": open("/tmp/early").read(),
                  "reply": reply.choices[0].message.content, "argv": sys.argv,
                  "path0": sys.path[0], "name": __name__}))
"""
EARLY_CALL = """
import time
open("/tmp/imported", "w").write(repr(time.time()))
import openai
try:  # a model call before the hand-over: refused by the gateway, and recorded
    openai.OpenAI(max_retries=0).chat.completions.create(
        model="fixture-target", messages=[{"role": "user", "content": "early"}])
    said = "answered"
except openai.APIStatusError as exc:
    said = f"{exc.status_code} {exc.body.get('code') if isinstance(exc.body, dict) else exc.body}"
open("/tmp/early", "w").write(said)
"""


def _warm(backend: Any, policies: RolePolicies, tmp_path: Path, files: dict[str, str],
          warm: list[str], *, gateway: Any = None, runtime: str | None = None,
          **overrides: Any) -> Any:
    from runner.isolation.launcher import output_dir, prepare
    from runner.isolation.policy import RolePolicy
    from runner.isolation.sandbox import Mount

    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for name, text in files.items():
        (src / name).write_text(text)
    policy = RolePolicy.model_validate({**policies.roles["analyst"].model_dump(),
                                        "runtime": runtime, **overrides})
    out = output_dir(policy, tmp_path / f"out-{len(list(tmp_path.iterdir()))}")
    return prepare(backend, policy, role="analyst", run_id="test-warm",
                   image=resolve_image("analyst"), command=["python", "/src/agent.py", "x"],
                   mounts=[Mount(source=src, target="/src")], output_dir=out,
                   gateway=gateway, stage="s", case="c1", trial=0, warm=warm)


def test_a_warm_start_imports_ahead_runs_nothing_of_the_case_before_it_and_refuses_calls(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    """The declared modules are imported while the container waits (a model call made
    then is refused, 409 ``not_handed_over``, and recorded); the script runs only after
    the hand-over, as ``python SCRIPT ARGS`` would (argv, ``sys.path[0]``, ``__main__``),
    and its own call is answered."""
    from runner.gateway.calllog import CallLog
    from runner.gateway.config import load_upstreams
    from runner.gateway.server import Gateway
    from runner.paths import default_upstreams

    with Gateway(tmp_path / "gw", "warm", load_upstreams(default_upstreams()),
                 {"analyst": "target"}) as gw:
        run = _warm(backend, policies, tmp_path, {"agent.py": WARM_AGENT,
                                                   "early.py": EARLY_CALL},
                    ["openai", "early"], gateway=gw)
        deadline = time.monotonic() + 30
        while not any(r.case == "c1" for r in CallLog(tmp_path / "gw" / "gateway").records()):
            assert time.monotonic() < deadline, "the import-time call never reached the gateway"
            time.sleep(0.1)
        handed_at = time.time()
        rec = run.run()
    assert rec.stop_reason is StopReason.OK, rec
    got = json.loads(rec.stdout_tail)
    assert got["imported_at"] < handed_at <= got["main_at"], got
    assert got["early"] == "409 not_handed_over", got
    assert got["reply"] == "pong"
    assert (got["argv"], got["path0"], got["name"]) == (["/src/agent.py", "x"], "/src",
                                                         "__main__")
    calls = CallLog(tmp_path / "gw" / "gateway").records()
    assert [(c.status, c.error) for c in calls] == [("refused", "not_handed_over"),
                                                    ("ok", None)], calls


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_a_warm_import_cannot_write_frames_into_the_holders_stdout(
        backend: Any, policies: RolePolicies, tmp_path: Path, runtime: str | None) -> None:
    """The seal starts with the warm frame, before any role process exists: bytes an
    import writes into ``/proc/1/fd/1`` (which gVisor lets it open) fail closed, named."""
    inject = INJECTOR.replace("sys.exit(3)", "")
    run = _warm(backend, policies, tmp_path, {"agent.py": "import sys\nsys.exit(3)\n",
                                              "inject.py": inject}, ["inject"],
                runtime=runtime)
    time.sleep(1.0)  # the import ran meanwhile
    rec = run.run()
    injection_refused(rec, runtime)


def test_a_warm_import_that_fails_fails_the_case_after_the_hand_over(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    run = _warm(backend, policies, tmp_path, {"agent.py": "print('never')\n"},
                ["no_such_module_here"])
    time.sleep(0.5)
    rec = run.run()
    assert rec.exit_code == 1 and rec.stop_reason is StopReason.PROCESS_FAILED, rec
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in rec.stderr_tail
    assert "never" not in rec.stdout_tail


def test_what_a_warm_import_writes_counts_against_the_output_cap(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    """2 MiB written at import, before any sink exists: the holder reads at most 256 KiB
    of it before the hand-over (the import then blocks on its full pipe), and the cap
    applies at the hand-over."""
    loud = "import sys\nsys.stdout.write('x' * (2 << 20))\nsys.stdout.flush()\n"
    run = _warm(backend, policies, tmp_path, {"agent.py": "print('main')\n",
                                              "loud.py": loud}, ["loud"],
                stdout_cap=1 << 20)
    time.sleep(1.0)
    rec = run.run()
    assert rec.stop_reason is StopReason.OUTPUT_LIMIT, rec
    assert rec.stdout_bytes > 1 << 20, rec.stdout_bytes


def test_a_discarded_warm_container_is_removed_and_its_script_never_ran(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    run = _warm(backend, policies, tmp_path,
                {"agent.py": "open('/out/ran', 'w').write('ran')\n"}, ["json"])
    time.sleep(0.5)
    run.discard()
    with pytest.raises(SandboxError, match="discarded before it ran"):
        run.run()
    assert [p.name for p in tmp_path.glob("out-*/*")] == []


def test_an_entry_that_cannot_be_warmed_is_refused_by_name(
        policies: RolePolicies, tmp_path: Path) -> None:
    from runner.errors import ConfigError
    from runner.isolation.sandbox import warm_refusal

    assert warm_refusal(["python", "/src/a.py"], ["openai"]) is None
    assert warm_refusal(["python3", "-m", "agent.main"], ["openai", "json"]) is None
    assert "interpreter option" in str(warm_refusal(["python", "-u", "/src/a.py"], ["x"]))
    assert "run by python" in str(warm_refusal(["node", "/src/a.js"], ["x"]))
    assert "module name" in str(warm_refusal(["python", "a.py"], ["os; rm -rf"]))
    assert "the entry itself" in str(warm_refusal(["python", "/src/agent.py"], ["agent"]))
    assert "the entry itself" in str(warm_refusal(["python", "-m", "pkg.main"],
                                                  ["pkg.main"]))
    with pytest.raises(ConfigError, match=r"project\.warm"):
        _warm(None, policies, tmp_path, {}, ["bad name"])  # refused before any container


TICKER = """
import threading, time
first = threading.Event()
def tick():
    with open("/tmp/ticks", "a") as f:
        while True:
            f.write(repr(time.time()) + "\\n"); f.flush(); first.set(); time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
first.wait(10)  # ticking before the import returns (a loaded machine may not run it)
"""
TICKS = """
import json, time
# the hand-over's own time closes the last gap: the ticker, continued with this thread,
# need not tick again before this reads
ticks = [float(x) for x in open("/tmp/ticks").read().split()] + [time.time()]
gaps = [b - a for a, b in zip(ticks, ticks[1:])]
print(json.dumps({"longest_gap": max(gaps), "ticks": len(ticks)}))
"""


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_a_warm_starts_role_processes_are_stopped_once_imported_until_the_hand_over(
        backend: Any, policies: RolePolicies, tmp_path: Path, runtime: str | None) -> None:
    """What an import leaves running (a thread here) gets no CPU between the end of the
    imports and the hand-over: the holder stops every role process (SIGSTOP) and
    continues them when the case comes. Under runsc too, where the holder's check that
    each stays stopped reads gVisor's /proc: an honest warm start is not taken for one
    that continued itself."""
    run = _warm(backend, policies, tmp_path, {"agent.py": TICKS, "ticker.py": TICKER},
                ["ticker"], runtime=runtime)
    time.sleep(2.0)
    rec = run.run()
    assert rec.stop_reason is StopReason.OK, rec
    got = json.loads(rec.stdout_tail)
    assert got["longest_gap"] > 1.5, got  # ticking stopped while the container waited


STEALER = """
import os, signal, struct
def steal():
    try:
        fd = os.open("/proc/1/fd/0", os.O_RDONLY)
    except OSError as e:
        open("/tmp/stolen", "w").write("no: " + e.strerror)
        return
    def late(*_):
        raise TimeoutError
    signal.signal(signal.SIGALRM, late)
    signal.alarm(5)  # the hand-over comes at about 1 s
    try:
        data = os.read(fd, 4096)
    except TimeoutError:
        data = b""
    signal.alarm(0)
    open("/tmp/stolen", "w").write(f"{len(data)} bytes")
    key = data[5:37] if len(data) >= 37 else os.urandom(32)
    import hashlib, hmac
    out = os.open("/proc/1/fd/1", os.O_WRONLY)
    for seq, (kind, body) in enumerate([(b"s", b'{"pid": 2}'), (b"x", b'{"code": 0}')]):
        head = kind + struct.pack(">I", len(body))
        tag = hmac.new(key, seq.to_bytes(8, "big") + head + body, hashlib.sha256).digest()[:16]
        os.write(out, head + body + tag)
steal()  # in the import itself: the imports are not done, so nothing is stopped yet
"""


def test_a_warm_import_that_reads_the_holders_stdin_gets_no_seal_key(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    """gVisor lets a same-uid process open ``/proc/1/fd/0``: a thread started at import
    may read the hand-over frame in the holder's place. That frame carries a go token,
    never the seal key (the key came before any role process existed), so frames it
    seals with what it read are refused, the run fails closed and names why."""
    run = _warm(backend, policies, tmp_path, {"agent.py": "import sys\nsys.exit(3)\n",
                                              "stealer.py": STEALER}, ["stealer"],
                runtime="runsc", timeout_s=20)
    time.sleep(1.0)
    rec = run.run()
    assert not (rec.stop_reason is StopReason.OK and rec.exit_code == 0), rec
    if rec.exit_code == 3:
        return  # the holder read the hand-over first: the case ran as it should
    assert "failed authentication" in rec.detail, rec


ENDS_EARLY = """
import os, signal, time
for _ in range(5):  # in the import, before it is done: PID 1, end the case now
    os.kill(1, signal.SIGUSR1)
    time.sleep(0.1)
"""


def test_a_warm_imports_sigusr1_to_the_holder_ends_nothing(
        backend: Any, policies: RolePolicies, tmp_path: Path) -> None:
    """Only a signal from outside the container's PID namespace (the host's) ends a case:
    an import that signalled PID 1 once had its case end before the hand-over, the
    entry never run (a record built from what the import left)."""
    run = _warm(backend, policies, tmp_path,
                {"agent.py": "print('entry ran')\nraise SystemExit(3)\n",
                 "ender.py": ENDS_EARLY}, ["ender"])
    time.sleep(1.5)
    rec = run.run()
    assert rec.exit_code == 3 and "entry ran" in rec.stdout_tail, rec


CONTINUES = r"""
import ctypes, os, signal, struct, time
if os.fork() == 0:  # the import's child: POSIX timers that send it SIGCONT
    signal.signal(signal.SIGCONT, lambda *_: None)  # handled, so the timer is not parked
    libc = ctypes.CDLL(None, use_errno=True)
    sev = bytearray(64)
    struct.pack_into("=QiI", sev, 0, 0, signal.SIGCONT, 0)  # SIGEV_SIGNAL
    for ns in (50_000_000, 77_000_000, 131_000_000, 173_000_000):
        tid = ctypes.c_void_p()
        assert libc.timer_create(1, (ctypes.c_char * 64).from_buffer(sev),
                                 ctypes.byref(tid)) == 0
        assert libc.timer_settime(tid, 0, ctypes.c_char_p(struct.pack("=qqqq", 0, ns, 0, ns)),
                                  None) == 0
    def ticking():
        while True:
            with open("/tmp/ticks", "a") as f:
                f.write("t\n")
            time.sleep(0.2)
    if LEADER_EXITS:  # its leader thread shows Z while this one runs
        import threading
        threading.Thread(target=ticking).start()
        libc.pthread_exit(None)
    ticking()
time.sleep(1)  # the import returns once the child runs: the holder then stops them all
"""


BURSTS = r"""
import ctypes, os, signal, struct, time
if os.fork() == 0:  # woken by its own timer, one tick, stopped again by itself at once
    signal.signal(signal.SIGCONT, lambda *_: None)
    libc = ctypes.CDLL(None, use_errno=True)
    sev = bytearray(64)
    struct.pack_into("=QiI", sev, 0, 0, signal.SIGCONT, 0)
    tid = ctypes.c_void_p()
    assert libc.timer_create(1, (ctypes.c_char * 64).from_buffer(sev), ctypes.byref(tid)) == 0
    ns = 97_000_000
    assert libc.timer_settime(tid, 0, ctypes.c_char_p(struct.pack("=qqqq", 0, ns, 0, ns)),
                              None) == 0
    fd = os.open("/tmp/ticks", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while True:
        os.write(fd, b"t\n")
        os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(1)
"""


@pytest.mark.parametrize(("runtime", "how"), [
    (None, "process"), (None, "leader-exited"), (None, "bursts"),
    # runsc shows no context switches: CPU clock ticks stand in, so bursts are seen once
    # they add up to one tick (10 ms) per process; not a certainty within this test's wait
    ("runsc", "process"), ("runsc", "leader-exited"),
])
def test_a_warm_import_that_continues_itself_is_killed_and_fails_its_case(
        backend: Any, policies: RolePolicies, tmp_path: Path, runtime: str | None,
        how: str) -> None:
    """A process that continues itself after the holder stopped every role process (its
    own SIGCONT timers) once ran with the case's inputs for as long as the case waited:
    now every role process is killed and the case fails, named. The holder looks at
    every thread's state (a process whose leader thread exited reads Z while another
    runs; under gVisor its running thread is not even listed) and at CPU time (bursts
    that stop themselves again between two checks)."""
    code = BURSTS if how == "bursts" else (
        f"LEADER_EXITS = {how == 'leader-exited'}\n" + CONTINUES)
    run = _warm(backend, policies, tmp_path,
                {"agent.py": "print(len(open('/tmp/ticks').read().split()), 'ticks')\n",
                 "cont.py": code}, ["cont"], runtime=runtime)
    time.sleep(5.0)
    rec = run.run()
    assert rec.stop_reason is not StopReason.OK, rec
    assert "ran while its warm start was stopped" in rec.stderr_tail, rec
    assert "ticks" not in rec.stdout_tail, rec


@pytest.mark.parametrize(("pid", "code", "outside"), [
    (0, 0, True),        # kill() from the host's namespace (runc and runsc alike)
    (0, 0x80, False),    # SI_KERNEL: nothing the host sends
    (7, 0, False),       # kill() by a role process
    (7, -6, False),      # tgkill()
    (0, -1, False),      # rt_sigqueueinfo() claiming pid 0 (SI_QUEUE)
    (0, 1, False),       # an F_SETSIG I/O signal (POLL_IN)
])
def test_only_a_signal_from_outside_ends_a_case(pid: int, code: int, outside: bool) -> None:
    from sandbox.holder import from_outside

    assert from_outside(pid, code) is outside
