"""The in-container loopback relay attacked from inside a real hardened analyst container.

The relay (PID 1's thread, :mod:`sandbox.holder`) must not be replaceable, nor starve
anything but its own binding, nor reach anything but its own binding:

- the port cannot be taken, before or beside it, with or without SO_REUSEADDR /
  SO_REUSEPORT, on 127.0.0.1 or the wildcard (fails when the relay sets SO_REUSEPORT);
- a flood of connections reaches the gateway at most 16 at once (no
  ``too_many_connections`` refusal is ever recorded), the holder's copy-out still
  finishes promptly while the flood holds every slot, and a call after the flood works
  (fails when the relay's connection bound is lifted);
- a never-ending body is cut by the gateway's body timeout, recorded;
- another role's token is refused (401) and another role's model (403), recorded in
  this container's binding only: the relay reaches one socket, and the other binding,
  bound at the same time, sees nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from runner.gateway.calllog import CallLog
from runner.gateway.config import parse_upstream
from runner.gateway.server import Gateway
from runner.isolation.docker.images import resolve_image
from runner.isolation.launcher import launch, output_dir
from runner.isolation.policy import RolePolicies
from runner.isolation.sandbox import Mount, RunRecord, StopReason

pytestmark = pytest.mark.docker
SCRIPT = Path(__file__).resolve().parents[2] / "policies" / "scripts" / "default.yaml"


def scripted(**limits: Any) -> Any:
    return parse_upstream({"provider": "scripted", "script": str(SCRIPT),
                           "models": ["fixture-target"], "limits": limits})


def run(gw: Gateway, policies: RolePolicies, backend: Any, code: str, *,
        case: str = "c1", out: Path | None = None, mounts: tuple[Mount, ...] = (),
        args: tuple[str, ...] = ()) -> RunRecord:
    pol = policies.roles["analyst"]
    return launch(backend, pol, role="analyst", run_id="relayatk",
                  image=resolve_image("analyst"), command=["python", "-c", code, *args],
                  gateway=gw, stage="attack", case=case, trial=0, mounts=mounts,
                  output_dir=output_dir(pol, out) if out is not None else None)


STEAL = """
import json, socket
out = {}
# the very first thing the role does: the port is already the holder's
for addr in ("127.0.0.1", "0.0.0.0"):
    for opt in (None, "SO_REUSEADDR", "SO_REUSEPORT", "both"):
        s = socket.socket()
        if opt in ("SO_REUSEADDR", "both"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if opt in ("SO_REUSEPORT", "both"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((addr, 40080)); s.listen(); out[addr + ":" + str(opt)] = "bound"
        except OSError as e:
            out[addr + ":" + str(opt)] = e.errno
        s.close()
# and it is the gateway that answers there
import urllib.request, os
req = urllib.request.Request("http://127.0.0.1:40080/v1/models",
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
listing = json.loads(urllib.request.urlopen(req, timeout=10).read())
out["models"] = [m["id"] for m in listing["data"]]
print(json.dumps(out))
"""


def test_the_port_cannot_be_taken_or_shared(tmp_path: Path, policies: RolePolicies,
                                            backend: Any) -> None:
    import errno

    with Gateway(tmp_path, "relayatk", {"target": scripted()}, {"analyst": "target"}) as gw:
        rec = run(gw, policies, backend, STEAL)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    out = json.loads(rec.stdout_tail)
    assert out.pop("models") == ["fixture-target"]
    assert len(out) == 8 and set(out.values()) == {errno.EADDRINUSE}, out


FLOOD = """
import json, os, socket, subprocess, sys, time
FLOODER = '''
import os, socket, sys, time
socks = []
for i in range(400):
    s = socket.socket(); s.setblocking(False)
    try: s.connect(("127.0.0.1", 40080))
    except BlockingIOError: pass
    except OSError: continue
    socks.append(s)
for s in socks[:40]:          # some half-open: a partial head, then silence
    try: s.send(b"POST /v1/chat/completions HTTP/1.1\\\\r\\\\nHost: x\\\\r\\\\n")
    except OSError: pass
open("/out/flooding", "w").write(str(len(socks)))
if sys.argv[1] == "hold":
    time.sleep(3600)
time.sleep(float(sys.argv[1]))
'''
mode = sys.argv[1]
if mode == "hold":
    # a flooder left running when the command ends: the holder's copy-out must finish
    # promptly with every relay slot taken
    open("/out/payload", "wb").write(os.urandom(1 << 20))
    subprocess.Popen([sys.executable, "-c", FLOODER, "hold"], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists("/out/flooding"): time.sleep(0.05)
    print(json.dumps({"flooding": open("/out/flooding").read()}))
else:
    subprocess.run([sys.executable, "-c", FLOODER, "4"], check=True)   # flood, then end
    import openai
    t0 = time.monotonic()
    text = openai.OpenAI(max_retries=0).chat.completions.create(
        model="fixture-target", messages=[{"role": "user", "content": "ping"}]
    ).choices[0].message.content
    print(json.dumps({"after": text, "s": time.monotonic() - t0,
                      "flooding": open("/out/flooding").read()}))
"""


def test_a_flood_starves_only_itself_and_copy_out_stays_prompt(
        tmp_path: Path, policies: RolePolicies, backend: Any) -> None:
    up = scripted(idle_timeout_s=2, header_timeout_s=2)
    with Gateway(tmp_path / "run", "relayatk", {"target": up}, {"analyst": "target"}) as gw:
        rec = run(gw, policies, backend, FLOOD, out=tmp_path / "o1", args=("after",))
        assert rec.stop_reason is StopReason.OK, rec.stderr_tail
        got = json.loads(rec.stdout_tail)
        assert got["after"] == "pong" and int(got["flooding"]) > 300
        t0 = time.monotonic()
        held = run(gw, policies, backend, FLOOD, case="c2", out=tmp_path / "o2",
                   args=("hold",))
        wall = time.monotonic() - t0
    assert held.stop_reason is StopReason.OK, (held.detail, held.stderr_tail)
    assert int(json.loads(held.stdout_tail)["flooding"]) > 300
    assert (tmp_path / "o2" / "payload").stat().st_size == 1 << 20  # copied out whole
    assert wall < 20, f"copy-out under a flood took {wall:.1f} s"
    recs = CallLog(tmp_path / "run" / "gateway").records()
    # never more than the binding's 16 connections reached the gateway at once
    assert not [r for r in recs if r.error == "too_many_connections"], \
        f"{sum(r.error == 'too_many_connections' for r in recs)} connections past the bound"
    ok = [r for r in recs if r.status == "ok"]
    assert [(r.case, r.stage) for r in ok] == [("c1", "attack")]


SLOW = """
import json, os, socket, time
tok = os.environ["OPENAI_API_KEY"].encode()
s = socket.create_connection(("127.0.0.1", 40080), timeout=30)
s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer " + tok
          + b"\\r\\nContent-Type: application/json\\r\\nContent-Length: 100000\\r\\n\\r\\n{")
s.settimeout(0.2)
t0 = time.monotonic(); resp = b""
while time.monotonic() - t0 < 25:
    try:
        s.sendall(b" ")            # a body that never ends
    except OSError:
        break
    try:
        d = s.recv(65536)
        if not d:
            break
        resp += d
    except socket.timeout:
        pass
print(json.dumps({"s": time.monotonic() - t0, "resp": resp.decode("latin-1")[:400]}))
"""


def test_a_never_ending_body_is_cut_by_the_gateway(tmp_path: Path, policies: RolePolicies,
                                                   backend: Any) -> None:
    with Gateway(tmp_path, "relayatk", {"target": scripted(body_timeout_s=2)},
                 {"analyst": "target"}) as gw:
        rec = run(gw, policies, backend, SLOW)
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    got = json.loads(rec.stdout_tail)
    assert got["resp"].startswith("HTTP/1.1 408"), got
    assert "body_timeout" in got["resp"] and got["s"] < 10, got
    recs = CallLog(tmp_path / "gateway").records()
    assert [(r.status, r.error, r.case) for r in recs] == [("refused", "body_timeout", "c1")]


FOREIGN = """
import json, os, openai
out = {}
alien = openai.OpenAI(api_key=open("/alien/token").read(), max_retries=0)  # env base URL
try:
    alien.chat.completions.create(model="fixture-optimizer",
                                  messages=[{"role": "user", "content": "x"}])
    out["alien"] = "accepted"
except openai.APIStatusError as e:
    out["alien"] = e.status_code
own = openai.OpenAI(max_retries=0)
try:
    own.chat.completions.create(model="fixture-optimizer",
                                messages=[{"role": "user", "content": "x"}])
    out["model"] = "accepted"
except openai.APIStatusError as e:
    out["model"] = e.status_code
print(json.dumps(out))
"""


def test_another_roles_token_or_binding_is_out_of_reach(
        tmp_path: Path, policies: RolePolicies, upstreams: dict[str, Any],
        backend: Any) -> None:
    import os

    alien = tmp_path / "alien"
    alien.mkdir()
    with Gateway(tmp_path / "run", "relayatk", dict(upstreams),
                 {"analyst": "target", "worker": "optimizer"}) as gw, \
            gw.bound("worker", stage="propose", uid=10001) as other:
        (alien / "token").write_text(gw.token_for("worker"))
        os.chmod(alien, 0o755)
        os.chmod(alien / "token", 0o644)
        rec = run(gw, policies, backend, FOREIGN,
                  mounts=(Mount(source=alien, target="/alien"),))
        assert other.turns == 0  # the worker's binding, bound meanwhile, saw nothing
    assert rec.stop_reason is StopReason.OK, rec.stderr_tail
    assert json.loads(rec.stdout_tail) == {"alien": 401, "model": 403}
    recs = CallLog(tmp_path / "run" / "gateway").records()
    assert [(r.role, r.stage, r.case, r.error) for r in recs] == [
        ("analyst", "attack", "c1", "bad_token"),
        ("analyst", "attack", "c1", "model_not_allowed")]
