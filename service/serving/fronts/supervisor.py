"""The engine's side of `slmrank serve --fronts N` (state.py says what fronts are for).

FrontPublisher writes admission's state into the shared file after every change of the queues
(at most once per event-loop iteration) and keeps the service time of the request shapes seen
lately. FrontSupervisor starts the N front processes (`python -m service.serving.fronts.front`), waits
until each is listening, restarts one that exits (with a growing pause), reads their counters,
and stops them when the engine stops.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from ...sched.shapes import request_dims, shape_key
from ...siblings import module_name
from .state import (MAX_FRONTS, NUM_CLIENTS, NUM_POINTS, NUM_SHAPES, SLOT_FIELDS, STATE_DRAINING, STATE_LOADING,
                    STATE_SERVING, LaneView, SharedState, Snapshot, client_key, ingress_delay_s)

# the serving limits a front checks a message against (message_dims)
LIMITS = ("max_samples", "max_score_tokens", "max_beam_width", "max_new_tokens", "max_prompt_tokens")

log = logging.getLogger("slmrank.fronts")


class FrontPublisher:
    """Engine side: admission's state -> the shared file (state.Snapshot)."""

    def __init__(self, shared: SharedState, clock: Callable[[], float] = time.monotonic) -> None:
        self.shared, self.clock = shared, clock
        self.state = STATE_LOADING
        self.admission: Any = None  # the AdmissionController, once the model is loaded
        self.limits: dict[str, int] = {}  # the serving limits, Snapshot's max_* fields
        self.max_token_bytes = 1
        self.shapes: OrderedDict[int, tuple[float, float, float]] = OrderedDict()
        self.ingress_s, self.ingress_at = 0.0, 0.0  # the latest forwarded request's wait to the engine's handler
        self.max_backlog_s = math.inf  # admission's, once attached
        self.deadline_margin = 0.0  # ... likewise
        self.closed = False
        self._pending = False
        self.publish()

    def attach(self, admission: Any, limits: Any, max_token_bytes: int) -> None:
        """The model is loaded: its admission controller, serving limits and tokenizer's longest token."""
        self.admission = admission
        self.limits = {name: getattr(limits, name) for name in LIMITS}
        self.max_token_bytes = max_token_bytes
        self.max_backlog_s = admission.config.front_max_backlog_s
        self.deadline_margin = admission.config.front_deadline_margin
        admission.on_change = self.changed

    def note_ingress(self, sent_s: float) -> float:
        """A forwarded request reached its handler: it left its front at sent_s (time.monotonic(),
        one clock for all processes of the host). Published when it moved by more than 0.5 ms.
        Returns this request's delay."""
        now = self.clock()
        delay = max(now - sent_s, 0.0)
        moved = abs(delay - self.ingress_delay_s()) > 5e-4
        self.ingress_s, self.ingress_at = delay, now
        if moved:
            self.changed()
        return delay

    def ingress_delay_s(self) -> float:
        """The ingress delay as the fronts read it now (state.ingress_delay_s)."""
        return ingress_delay_s(self.ingress_s, self.ingress_at, self.clock())

    def set_state(self, state: int) -> None:
        self.state = state
        self.publish()

    def note_shape(self, request: Any, own_s: float, share_s: float, idle_s: float | None = None) -> None:
        """Admission priced a request of this shape (the gate's placeholder request): its own time,
        its share and its bucket's own idle time (None: none). Published when new or changed by more than 1%."""
        if own_s <= 0:
            return
        key = shape_key(request_dims(request))
        old = self.shapes.get(key)
        self.shapes[key] = (own_s, share_s, idle_s or 0.0)
        self.shapes.move_to_end(key)
        while len(self.shapes) > NUM_SHAPES:
            self.shapes.popitem(last=False)
        if (old is None or abs(old[0] - own_s) > 0.01 * own_s or abs(old[1] - share_s) > 0.01 * max(share_s, 1e-9)
                or abs(old[2] - (idle_s or 0.0)) > 0.01 * own_s):
            self.changed()

    def changed(self) -> None:
        """Admission changed: publish once the current event-loop iteration is done (or now,
        without a running loop)."""
        if self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.publish()
            return
        self._pending = True
        loop.call_soon(self.publish)

    def publish(self) -> None:
        self._pending = False
        if self.closed:
            return
        now = self.clock()
        snap = Snapshot(published_s=now, state=self.state, **self.limits, max_token_bytes=self.max_token_bytes,
                        shapes=dict(self.shapes), ingress_s=self.ingress_s, ingress_at=self.ingress_at,
                        max_backlog_s=self.max_backlog_s, deadline_margin=self.deadline_margin)
        adm = self.admission
        if adm is not None:
            model, cfg = adm.model, adm.config
            if adm.is_draining:
                snap.state = STATE_DRAINING
            snap.measured = model.num_batches > 0
            snap.inflight_s, snap.inflight_batches = model.inflight_remaining_s(now), model.num_inflight
            snap.parallelism, snap.calibration = model.parallelism(now), model.calibration_at(now)
            snap.safety_margin, snap.response_margin_s = cfg.safety_margin, cfg.response_margin_s
            snap.response_s = adm.response_margin_s()
            snap.min_retry_s, snap.max_retry_s = cfg.min_retry_after_s, cfg.max_retry_after_s
            snap.unavailable_retry_s, snap.max_lane_work_s = cfg.unavailable_retry_s, cfg.max_lane_work_s
            snap.lanes = tuple(LaneView(work_s=v["work_s"], length=v["length"], max_queue=v["max_queue"],
                                        stretch=v["stretch"], higher_work_s=v["higher_work_s"], vtime=v["vtime"],
                                        points=tuple(v["points"]),
                                        clients={client_key(c): f for c, f in v["finish"].items()})
                               for v in adm.lane_views(now, NUM_POINTS, NUM_CLIENTS))
        self.shared.write(snap)


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A socket bound (not listening) to host:port with SO_REUSEPORT, held while the fronts bind
    the same port beside it: port 0 becomes one free port that all of them share."""
    from ...runtime.requests import BindError
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    if port:  # SO_REUSEPORT would let this join another server's listeners on the port: refuse a taken one
        probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host.strip("[]"))
        try:
            socket.create_connection((probe_host, port), timeout=0.5).close()
            taken = True
        except OSError:
            taken = False
        if taken:
            raise BindError(f"cannot listen on {host}:{port}: the port is in use")
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock, sock.getsockname()[1]


@dataclass
class FrontOptions:
    """What each front is started with (the server's public listener and admission's client key)."""

    host: str
    port: int
    client_id_metadata: str = "x-client-id"
    max_receive_message_bytes: int = 1 << 20
    max_send_message_bytes: int = 4 << 20
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    max_inflight: int = 1024  # Score/BeamSearch RPCs each front handles at once (admission.max_inflight_rpcs)
    # the bounds on what one client holds (ServerConfig's; stalls.py, status.connection_options)
    receive_timeout_s: float = 5.0
    send_timeout_s: float = 5.0
    handshake_timeout_s: float = 10.0
    max_streams_per_connection: int = 2048
    max_connections: int = 1024  # each front's: N fronts take N times as many


class FrontSupervisor:
    """Starts, watches and stops the front processes (engine side)."""

    START_TIMEOUT_S = 30.0
    MAX_BACKOFF_S = 10.0

    def __init__(self, num_fronts: int, options: FrontOptions) -> None:
        if not 1 <= num_fronts <= MAX_FRONTS:
            raise ValueError(f"fronts: must be in [1, {MAX_FRONTS}], got {num_fronts}")
        self.num_fronts, self.options = num_fronts, options
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.run_dir = tempfile.mkdtemp(prefix="slmrank-fronts-", dir=base)
        self.engine_socket = os.path.join(self.run_dir, "engine.sock")
        self.shared = SharedState(os.path.join(self.run_dir, "state"), create=True)
        self.publisher = FrontPublisher(self.shared)
        self.port = options.port
        self.restarts = 0
        self._procs: list[asyncio.subprocess.Process | None] = [None] * num_fronts
        self._started = [0.0] * num_fronts  # time.monotonic() of each front's latest start
        self._watchers: list[asyncio.Task] = []
        self._stopping = False
        self._reserved: socket.socket | None = None
        self._final: tuple[dict[str, int], float] | None = None  # counts and last arrival, once stopped

    @property
    def engine_target(self) -> str:
        return f"unix:{self.engine_socket}"

    def _command(self, index: int) -> list[str]:
        o = self.options
        cmd = [sys.executable, "-m", module_name("service.serving.fronts.front"), "--engine", self.engine_target,
               "--state", self.shared.path, "--slot", str(index), "--fronts", str(self.num_fronts),
               "--host", o.host, "--port", str(self.port), "--client-id-metadata", o.client_id_metadata,
               "--max-receive-message-bytes", str(o.max_receive_message_bytes),
               "--max-send-message-bytes", str(o.max_send_message_bytes), "--max-inflight", str(o.max_inflight),
               "--receive-timeout-s", str(o.receive_timeout_s), "--send-timeout-s", str(o.send_timeout_s),
               "--handshake-timeout-s", str(o.handshake_timeout_s),
               "--max-streams-per-connection", str(o.max_streams_per_connection),
               "--max-connections", str(o.max_connections)]
        from ...observe.logs import current_settings
        level, fmt = current_settings()
        cmd += ["--log-level", level, "--log-format", fmt]
        for flag, value in (("--tls-cert", o.tls_cert), ("--tls-key", o.tls_key), ("--tls-client-ca", o.tls_client_ca)):
            if value:
                cmd += [flag, value]
        return cmd

    async def start(self) -> int:
        """Starts every front and returns once all listen on the port (returned). Raises BindError
        when they cannot bind it, RuntimeError when one exits or does not get ready in time."""
        self._reserved, self.port = reserve_port(self.options.host, self.options.port)
        try:
            for i in range(self.num_fronts):
                await self._spawn(i)
            deadline = time.monotonic() + self.START_TIMEOUT_S
            while not all(self.shared.slot(i)["ready"] for i in range(self.num_fronts)):
                for i, proc in enumerate(self._procs):
                    if proc is not None and proc.returncode is not None:
                        raise RuntimeError(f"front {i} exited with code {proc.returncode} while starting "
                                           "(its log is above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fronts did not listen on {self.options.host}:{self.port} within "
                                       f"{self.START_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.02)
        except BaseException:
            await self.stop(0.5)
            raise
        finally:
            self._reserved.close()
            self._reserved = None
        self._watchers = [asyncio.create_task(self._watch(i), name=f"slmrank-front-{i}") for i in range(self.num_fronts)]
        return self.port

    async def _spawn(self, index: int) -> None:
        self.shared.clear_slot(index)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._started[index] = time.monotonic()
        # close_fds=False: every descriptor this process opens is close-on-exec anyway (PEP 446), so
        # there is nothing to close in the child
        self._procs[index] = await asyncio.create_subprocess_exec(*self._command(index), env=env, close_fds=False)

    async def _watch(self, index: int) -> None:
        backoff_s = 0.25
        while True:
            proc = self._procs[index]
            assert proc is not None
            code = await proc.wait()
            if self._stopping:
                return
            ran_s = time.monotonic() - self._started[index]
            log.error("front %d (pid %d) exited with code %s: restarting in %.2f s", index, proc.pid, code, backoff_s)
            await asyncio.sleep(backoff_s)
            if self._stopping:
                return
            self.restarts += 1
            await self._spawn(index)
            backoff_s = 0.25 if ran_s > 30 else min(2 * backoff_s, self.MAX_BACKOFF_S)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None and p.returncode is None]

    def counts(self) -> dict[str, int]:
        """The fronts' counters, summed: forwarded, refused_<reason> (after stop(): their last values)."""
        if self._final is not None:
            return dict(self._final[0])
        total = {f: 0 for f in SLOT_FIELDS[2:]}
        for i in range(self.num_fronts):
            slot = self.shared.slot(i)
            for f in total:
                total[f] += int(slot[f])
        return total

    def last_arrival_s(self) -> float:
        """time.monotonic() of the latest Ranker RPC at any front."""
        if self._final is not None:
            return self._final[1]
        return max(self.shared.slot(i)["last_arrival_s"] for i in range(self.num_fronts))

    async def stop(self, timeout_s: float = 2.0) -> None:
        """SIGTERM to every front (each closes its listener and finishes what it forwards), a kill
        after timeout_s; then the run directory goes."""
        if self._final is not None:
            return
        self._stopping = True
        self.publisher.closed = True
        live = [p for p in self._procs if p is not None and p.returncode is None]
        for p in live:
            try:
                p.terminate()
            except ProcessLookupError:
                pass
        if live:
            done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=timeout_s)
            for p in live:
                if p.returncode is None:
                    log.warning("front pid %d did not stop within %.1f s: killing it", p.pid, timeout_s)
                    p.kill()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for w in self._watchers:
            w.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._final = (self.counts(), self.last_arrival_s())
        self.shared.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


__all__ = ["FrontOptions", "FrontPublisher", "FrontSupervisor", "STATE_DRAINING", "STATE_LOADING", "STATE_SERVING",
           "reserve_port"]
