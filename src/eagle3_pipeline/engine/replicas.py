"""Replicas of the reference engine over a host's devices, behind one endpoint (``serve-reference --dp-size N``).

SGLang's ``--dp-size N`` runs N copies of a small model, one per GPU, behind one address; this is the
reference engine's. The command starts N replica processes of itself, replica ``i`` seeing only the ``i``-th
GPU (``CUDA_VISIBLE_DEVICES``: the ``i``-th of the parent's list when it has one, else ``i``), each listening
on a free loopback port with the same model, capture directory, aux layers and options. Once every replica has
said it is ready, the front binds the address the role asked for and hands each ``/generate`` to the replica
with the fewest requests in flight, so one extraction or regeneration client (its journal, resume and progress
unchanged) keeps every GPU of the host busy. Processes, not threads: each replica's Python runs its own GPU's
kernel launches and capture writes, without one interpreter lock between eight GPUs. ``--replicas-per-device K``
puts K replicas on each GPU (replica ``i`` on device ``i // K``, each with 1/K of the default slot cache): the
CPU work of a small model's server spread over K processes (the extraction of SmolLM2 on an H100: 1.26x with
two; its regeneration: no faster, docs/benchmarks.md).

What the front answers itself: ``/health`` and ``/ready`` (503 while stopping), ``/health_generate`` (every
replica must pass its own), the API key (the replicas require the same key; the front sends it on), and a
request id already in flight on any replica (refused as SGLang refuses one). ``/server_info`` is the first
replica's with this address, ``dp_size`` N and a ``replicas`` list (each replica's pid, GPU, port and the
requests it has answered, asked live). A malformed request goes to a replica unparsed, so its error is the
engine's own.

A replica that exits stops the whole server (exit 1, naming the replica, its GPU and its exit status): a server
with a GPU missing would go on at a fraction of its speed without anyone noticing. SIGTERM stops the front
first (no new requests), then the replicas, which finish the requests in flight within their grace.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.engine.batcher import LOG, ServiceUnavailable
from eagle3_pipeline.engine.reference_server import EndpointState, make_server

# The front's options that a replica gets in another form (its own loopback port, its readiness) or not at all.
FRONT_ONLY = ("host", "port", "dp_size", "replica", "ready_file")
REPLICA_TIMEOUT_S = 24 * 3600.0  # a replica's answer to one request (a long decode is not an error)


@dataclass
class Replica:
    """One replica process and what the front knows of it."""

    index: int
    visible_device: str | None  # its CUDA_VISIBLE_DEVICES, None on the CPU
    proc: subprocess.Popen
    ready_file: Path
    port: int = 0
    inflight: int = 0
    dispatched: int = 0
    exit_reported: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        where = f"GPU {self.visible_device}" if self.visible_device is not None else "the CPU"
        return f"replica {self.index} (pid {self.proc.pid}, {where})"

    def request(self, method: str, path: str, body: bytes | None, headers: dict,
                timeout: float = REPLICA_TIMEOUT_S) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


def visible_devices(device: str, count: int, environ: dict, per_device: int = 1) -> list[str | None]:
    """Each replica's ``CUDA_VISIBLE_DEVICES`` (None: leave it as it is, a CPU replica).

    ``cuda``/``auto``: replica ``i`` gets device ``i // per_device`` of the parent's ``CUDA_VISIBLE_DEVICES``
    when it lists devices, else that number; fewer listed than the replicas need is refused here, naming both
    numbers."""
    if device == "cpu":
        return [None] * count
    needed = -(-count // per_device)
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None or not listed.strip():
        ids = [str(i) for i in range(needed)]
    else:
        ids = [part.strip() for part in listed.split(",") if part.strip()]
    if len(ids) < needed:
        shared = f" ({per_device} a device)" if per_device > 1 else ""
        raise ValueError(f"--dp-size {count}{shared}: CUDA_VISIBLE_DEVICES lists {len(ids)} device(s) ({listed}); "
                         f"lower --dp-size (sglang_server_dp_size) to {len(ids) * per_device} or list {needed} "
                         "devices")
    return [ids[i // per_device] for i in range(count)]


def replica_argv(options: list[str], index: int, count: int, ready_file: Path) -> list[str]:
    """The command line of replica ``index``: the front's ``options`` (``FRONT_ONLY`` left out), a free loopback
    port and its readiness file."""
    return [sys.executable, "-m", "eagle3_pipeline.engine.reference_server", *options, "--host", "127.0.0.1",
            "--port", "0", "--replica", f"{index}/{count}", "--ready-file", str(ready_file)]


class ReplicaFront(EndpointState):
    """The front: the endpoints the HTTP handler calls, as ``ReferenceEngine`` has them, over the replicas."""

    def __init__(self, replicas: list[Replica], host: str, port: int, api_key: str | None, per_device: int = 1):
        super().__init__(api_key)
        self.per_device = per_device
        self.replicas = replicas
        self.host, self.port = host, port
        self._turn = 0

    def _headers(self, content: bool = False) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**headers, "Content-Type": "application/json"} if content else headers

    def _pick(self) -> Replica:
        """The replica with the fewest requests in flight (in turn among equals)."""
        with self._lock:
            count = len(self.replicas)
            order = [self.replicas[(self._turn + k) % count] for k in range(count)]
            self._turn = (self._turn + 1) % count
            chosen = min(order, key=lambda replica: replica.inflight)
            chosen.inflight += 1
            chosen.dispatched += 1
            return chosen

    def generate(self, raw: bytes) -> tuple[int, dict]:
        """Hand one /generate body to a replica; (its status, its JSON body)."""
        try:
            body = json.loads(raw.decode("utf-8")) if raw.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = None  # the replica refuses it with the engine's own message
        rid = body.get("rid") if isinstance(body, dict) and isinstance(body.get("rid"), str) else None
        if rid is not None:
            self.claim(rid)  # in flight on any replica
        replica = self._pick()
        try:
            status, payload = replica.request("POST", "/generate", raw, self._headers(content=True))
        except OSError as exc:
            raise ServiceUnavailable(f"{replica.name} did not answer ({exc}); the server is stopping") from None
        finally:
            with self._lock:
                replica.inflight -= 1
            if rid is not None:
                self.release(rid)
        return status, (json.loads(payload) if payload else {})

    def _each(self, path: str) -> list[tuple[Replica, int, dict | None]]:
        """GET ``path`` on every replica at once: (replica, status or 0, JSON body or None)."""
        results: list = [None] * len(self.replicas)

        def ask(k: int, replica: Replica) -> None:
            try:
                status, payload = replica.request("GET", path, None, self._headers(), timeout=60.0)
                results[k] = (replica, status, json.loads(payload) if payload else None)
            except (OSError, ValueError) as exc:
                LOG.error("%s: GET %s failed: %s", replica.name, path, exc)
                results[k] = (replica, 0, None)

        threads = [threading.Thread(target=ask, args=(k, r), daemon=True) for k, r in enumerate(self.replicas)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    def health_generate(self) -> int:
        if self.draining.is_set():
            return 503
        failing = [replica.name for replica, status, _ in self._each("/health_generate") if status != 200]
        if failing:
            LOG.error("health check failed on %s", ", ".join(failing))
            return 503
        return 200

    def model_info(self) -> dict:
        status, payload = self.replicas[0].request("GET", "/model_info", None, self._headers(), timeout=60.0)
        if status != 200:
            raise ServiceUnavailable(f"{self.replicas[0].name} answered /model_info with {status}")
        return json.loads(payload)

    def server_info(self) -> dict:
        answers = self._each("/server_info")
        first = answers[0][2]
        if first is None:
            raise ServiceUnavailable(f"{self.replicas[0].name} did not answer /server_info")
        # Counts summed over the replicas; each replica's own account in its entry.
        answered = sum((info or {}).get("requests_answered") or 0 for _r, _s, info in answers)
        first = {key: value for key, value in first.items() if key != "worker"}
        return {**first, "requests_answered": answered, "host": self.host, "port": self.port,
                "dp_size": len(self.replicas),
                "replicas_per_device": self.per_device,
                "replicas": [{"index": r.index, "pid": r.proc.pid, "visible_device": r.visible_device,
                              "port": r.port, "device": (info or {}).get("device"),
                              "requests_answered": (info or {}).get("requests_answered"),
                              "requests_dispatched": r.dispatched, "inflight": r.inflight,
                              "worker": (info or {}).get("worker")}
                             for r, _status, info in answers]}


def _stop_replicas(replicas: list[Replica], grace_s: float) -> None:
    for replica in replicas:
        if replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 10.0
    for replica in replicas:
        try:
            replica.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            LOG.error("%s did not stop within %.0f s of SIGTERM; killing it", replica.name, grace_s + 10.0)
            replica.proc.kill()
            replica.proc.wait()


def _exited(replicas: list[Replica]) -> Replica | None:
    return next((r for r in replicas if r.proc.poll() is not None), None)


def run(args: argparse.Namespace, options: list[str], api_key: str | None) -> int:
    """Start ``args.dp_size`` replicas (each with ``options``: this command's, ``FRONT_ONLY`` left out), then
    serve the front until SIGTERM/SIGINT or a replica's exit."""
    try:
        devices = visible_devices(args.device, args.dp_size, dict(os.environ), args.replicas_per_device)
    except ValueError as exc:
        LOG.error("cannot start: %s", exc)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    ready_dir = Path(tempfile.mkdtemp(prefix="eagle3-replicas-"))
    replicas: list[Replica] = []
    try:
        for index, visible in enumerate(devices):
            ready_file = ready_dir / f"replica-{index}.json"
            env = dict(os.environ)
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            # Same process group: the supervisor's stop (the whole group) reaches every replica.
            proc = subprocess.Popen(replica_argv(options, index, args.dp_size, ready_file), env=env)  # noqa: S603
            replicas.append(Replica(index, visible, proc, ready_file))
        LOG.info("starting %d replicas of %s: %s", len(replicas), args.model_path,
                 ", ".join(replica.name for replica in replicas))
        waiting = list(replicas)
        while waiting:
            if stop.is_set():
                LOG.info("stopped before every replica was ready")
                _stop_replicas(replicas, args.shutdown_grace_s)
                return 0
            gone = _exited(replicas)
            if gone is not None:
                LOG.error("cannot start: %s exited with status %s before it was ready (its log is above); "
                          "the other replicas are stopped", gone.name, gone.proc.returncode)
                _stop_replicas(replicas, args.shutdown_grace_s)
                return 2
            for replica in list(waiting):
                if replica.ready_file.is_file():
                    replica.port = int(json.loads(replica.ready_file.read_text())["port"])
                    waiting.remove(replica)
            time.sleep(0.1)
        front = ReplicaFront(replicas, args.host, args.port, api_key, args.replicas_per_device)
        try:
            server = make_server(front, args.host, args.port)
        except OSError as exc:
            LOG.error("cannot listen on %s:%s: %s", args.host, args.port, exc)
            _stop_replicas(replicas, args.shutdown_grace_s)
            return 2
        serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http",
                                   daemon=True)
        serving.start()
        LOG.info("reference engine serving http://%s:%d model=%s dp_size=%d replicas: %s api_key=%s", args.host,
                 front.port, args.model_path, len(replicas),
                 ", ".join(f"{r.name} on port {r.port}" for r in replicas), "required" if api_key else "none")
        status = 0
        while not stop.wait(0.5):
            gone = _exited(replicas)
            if gone is not None:
                LOG.error("%s exited with status %s: the server stops (a server short of a GPU would go on at a "
                          "fraction of its speed); its log is above", gone.name, gone.proc.returncode)
                status = 1
                break
        LOG.info("stopping: no new requests; the replicas finish theirs (up to %.0f s)", args.shutdown_grace_s)
        front.draining.set()
        server.shutdown()
        _stop_replicas(replicas, args.shutdown_grace_s)
        front.wait_idle(5.0)
        server.server_close()
        LOG.info("stopped: %s", ", ".join(f"{r.name} answered {r.dispatched} request(s), exit {r.proc.returncode}"
                                          for r in replicas))
        return status
    finally:
        for replica in replicas:
            if replica.proc.poll() is None:
                replica.proc.kill()
                replica.proc.wait()
        shutil.rmtree(ready_dir, ignore_errors=True)
