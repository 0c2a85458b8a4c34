"""Whether the Ray head this controller joined is still there, known within seconds.

A driver whose head is gone is ended by Ray itself, with exit 1 and nothing said: the
first object-store call after the head's raylet died ("The connection to the plasma
store is failed. Terminate the process"), or the GCS client after
``gcs_rpc_server_reconnect_timeout_s`` (60 s) without the GCS; a GCS call in between
(``ray.nodes()``) blocks until then. Neither can be caught in Python, so the controller
must learn of the loss *before* it touches Ray again, and then leave Ray alone.

:class:`HeadWatch` probes the head's GCS port and this driver's raylet by TCP connect
every ``every`` seconds in a daemon thread (a probe is a connect and a close, nothing
sent). One that fails makes the head *suspect*; a suspect head that has not answered
again within ``grace`` seconds is *lost* for good (a GCS restarted within the grace, as
with GCS fault tolerance, is no loss). :meth:`HeadWatch.ensure`, called before every
Ray call that could end the process, probes at once and holds the call while the head
is suspect, so a Ray call is made only to a head that answered an instant before.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from runner.errors import SandboxError

EVERY_S = 1.0
"""How often the head is probed."""
GRACE_S = 8.0
"""How long a suspect head may go without answering before it is lost (Ray's own wait
before it ends the driver is 60 s)."""
CONNECT_S = 1.0
"""One probe's connect timeout."""

Target = tuple[str, tuple[str, int]]
"""(what, (host, port)): ``("GCS", ("10.0.0.1", 6379))``."""


def probe(where: tuple[str, int], timeout: float = CONNECT_S) -> str | None:
    """None when ``where`` accepts a TCP connection within ``timeout``, else why not."""
    try:
        socket.create_connection(where, timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


class HeadWatch:
    """The head of the cluster at ``address``, probed at ``targets`` (see the module)."""

    def __init__(self, address: str, targets: list[Target], *, every: float = EVERY_S,
                 grace: float = GRACE_S,
                 check: Callable[[tuple[str, int]], str | None] = probe,
                 on_lost: Callable[[], object] | None = None) -> None:
        self.address, self.targets = address, list(targets)
        self.every, self.grace, self._check = every, grace, check
        self._on_lost = on_lost
        self._cond = threading.Condition()
        self._since: float | None = None  # first failed probe of the current outage
        self._why = ""
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cyclebox-ray-head",
                                        daemon=True)
        self._thread.start()

    @property
    def lost(self) -> str | None:
        """The loss, named (the SandboxError's message), once the head is lost."""
        return self._lost

    def _probe_once(self) -> None:
        failed = next(((what, where, why) for what, where in self.targets
                       if (why := self._check(where)) is not None), None)
        now = time.monotonic()
        with self._cond:
            if self._lost is not None:
                return
            was_lost = False
            if failed is None:
                self._since, self._why = None, ""
            else:
                what, (host, port), why = failed
                self._why = f"its {what} at {host}:{port}: {why}"
                if self._since is None:
                    self._since = now
                if now - self._since >= self.grace:
                    self._lost = (
                        f"Ray head lost: the cluster at {self.address} did not answer for "
                        f"{now - self._since:.0f} s ({self._why}); nothing more is sent "
                        "to it. Its nodes' runs end with it: `cyclebox gc` on each node "
                        "removes what they leave. Fix: restart the cluster (`ray start "
                        "--head`, then the nodes) and run again")
                    was_lost = True
            self._cond.notify_all()
        if was_lost and self._on_lost is not None:
            self._on_lost()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._probe_once()
            if self._lost is not None:
                return

    def check(self) -> None:
        """SandboxError naming the lost cluster once the head is lost."""
        if self._lost is not None:
            raise SandboxError(self._lost)

    def ensure(self) -> None:
        """Return only when the head answered just now; SandboxError once it is lost
        (a suspect head holds the caller until it answers again or is lost)."""
        self.check()
        self._probe_once()
        with self._cond:
            while self._since is not None and self._lost is None:
                self._cond.wait(self.every)
        self.check()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=2 * CONNECT_S * max(1, len(self.targets)))
