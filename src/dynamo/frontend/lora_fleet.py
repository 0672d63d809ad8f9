"""Run-time LoRA loading on a frontend of workers (``out=dyn``): ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` sent on to the workers' ``load_lora`` / ``unload_lora`` endpoints
(worker/lora_control.py), which load the adapter and announce it as a model entry; discovery then lists
it and routes its requests only to the workers that announced it.

Which workers: every worker of the base model whose entry says its engine serves adapters
(``runtime_lora_updating`` in its runtime_config; true or false, the worker answers for itself).  The
base is the request's ``base_model_name`` (ours; vLLM's body has no such field because a vLLM server has
one base), else the one base model of this frontend that serves adapters.  Unloading goes to every
worker that announces the adapter.

All or nothing, so that what ``/v1/models`` shows is what the fleet serves: a load that fails on one
worker is unloaded again from the workers where it succeeded, and the error names each worker and
what it said (a worker that cannot be reached, or that answers too late, counts as failed).

All of the fleet that is still there: a worker that could not be reached and whose entries then leave
discovery (killed -9 mid-load: its lease expires) has left the fleet, and the load stands on the workers
that loaded it.  That is the rule for a worker that joins later, too (it does not get run-time adapters),
and it keeps a crash from failing, and undoing, the load on every healthy worker; an operator who
restarts the dead worker gives it the adapter with ``--lora``.  Telling "gone" from "slow" takes up to
the lease TTL after the call fails (this process's ``DYN_LEASE_TTL``, which a fleet shares, plus
``GONE_SLACK_S`` for the watch); a worker still registered then (a network partition) counts as failed,
and the load is undone.  If undoing
fails too, the error says on which workers the adapter is still loaded; they announce it, so it is
listed in ``/v1/models`` and ``/v1/unload_lora_adapter`` removes it.  A successful call returns once
this frontend has seen every loaded worker's entry (or every unloaded one's withdrawal), so the next
request finds the adapter (or a 404).

A worker that joins later does not get adapters loaded at run time: give those with ``--lora`` at start.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from dynamo.errors import RequestError
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.lora import LOAD_LORA_ENDPOINT, RUNTIME_LORA_KEY, UNLOAD_LORA_ENDPOINT
from dynamo.llm.model_entry import ModelEntry
from dynamo.runtime import lease_hex

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 120.0  # one worker loading one adapter file
SEEN_TIMEOUT_S = 10.0  # the workers' entries reaching this frontend's discovery
GONE_SLACK_S = 5.0  # beyond the lease TTL: an unreachable worker's entries leaving this frontend's watch


@dataclass(frozen=True)
class Worker:
    namespace: str
    component: str
    instance_id: int

    def __str__(self) -> str:
        return f"worker {lease_hex(self.instance_id)} (dyn://{self.namespace}.{self.component})"


def _worker(entry: ModelEntry) -> Worker:
    return Worker(entry.namespace, entry.component, entry.instance_id)


def _unreachable(answer: str | None) -> bool:
    return answer is not None and answer.startswith("unreachable")


def _lora_name(entry: ModelEntry) -> str | None:
    lora = (entry.card or {}).get("lora")
    return lora.get("name") if isinstance(lora, dict) else None


class LoraFleet:
    def __init__(self, runtime: Any, manager: ModelManager, entries: Callable[[], list[ModelEntry]]):
        self.runtime = runtime
        self.manager = manager
        self.entries = entries
        self._clients: dict[tuple[str, str, str], Any] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time: each sees the other's result

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    # -- which workers ---------------------------------------------------------------------------
    def _base_workers(self, base: str | None) -> tuple[str, list[Worker]]:
        by_base: dict[str, set[Worker]] = {}
        for e in self.entries():
            if _lora_name(e) is None and RUNTIME_LORA_KEY in (e.runtime_config or {}):
                by_base.setdefault(e.name, set()).add(_worker(e))
        if base is not None:
            if base not in by_base:
                if base not in self.manager.names():
                    raise RequestError(f"The model '{base}' does not exist.", status=404, param="base_model_name",
                                       code="model_not_found")
                raise RequestError(f"no worker of '{base}' serves LoRA adapters (out=llamacpp and out=vllm workers do)",
                                   param="base_model_name")
        elif len(by_base) == 1:
            base = next(iter(by_base))
        elif not by_base:
            raise RequestError("no worker of this frontend serves LoRA adapters (out=llamacpp and out=vllm workers do)")
        else:
            raise RequestError(f"several base models serve LoRA adapters ({', '.join(sorted(by_base))}): name "
                               "one as 'base_model_name'", param="base_model_name")
        return base, sorted(by_base[base], key=lambda w: w.instance_id)

    def _live_base_workers(self, base: str) -> set[Worker]:
        return {_worker(e) for e in self.entries() if e.name == base and _lora_name(e) is None}

    async def _departed(self, base: str, unreachable: list[Worker]) -> list[Worker]:
        """Those of ``unreachable`` that have left discovery (their lease expired: killed, or frozen
        past its TTL) within the lease TTL and ``GONE_SLACK_S``: gone from the fleet, not failed.  A worker that cannot
        be reached but stays registered may still serve: it counts as failed, and the load is undone."""
        if not unreachable:
            return []
        await self.manager.wait_until(lambda: not (set(unreachable) & self._live_base_workers(base)),
                                      self.runtime.settings.lease_ttl + GONE_SLACK_S)
        live = self._live_base_workers(base)
        return [w for w in unreachable if w not in live]

    def _adapter_workers(self, name: str) -> set[Worker]:
        return {_worker(e) for e in self.entries() if _lora_name(e) == name}

    # -- load and unload -------------------------------------------------------------------------
    async def load(self, name: str, path: str, base: str | None) -> str:
        async with self._lock:
            if name in self.manager.names():
                raise RequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            base, workers = self._base_workers(base)
            answers = await self._call_all(LOAD_LORA_ENDPOINT, {"lora_name": name, "lora_path": path}, workers)
            loaded = [w for w in workers if answers[w] is None]
            failed = [w for w in workers if answers[w] is not None]
            gone = await self._departed(base, [w for w in failed if _unreachable(answers[w])]) if loaded else []
            if gone:
                log.warning("LoRA adapter %s: %s left the fleet during the load (%s); the load stands on the %d "
                            "worker(s) that remain", name, ", ".join(map(str, gone)),
                            "; ".join(str(answers[w]) for w in gone), len(loaded))
                failed = [w for w in failed if w not in gone]
            if not failed:
                if not await self.manager.wait_until(
                        lambda: name in self.manager.names() and set(loaded) <= self._adapter_workers(name),
                        SEEN_TIMEOUT_S):
                    log.warning("LoRA adapter %s loaded, but its workers' entries have not reached this frontend "
                                "after %gs: it is listed once they do", name, SEEN_TIMEOUT_S)
                log.info("LoRA adapter %s of %s loaded on %d worker(s)", name, base, len(loaded))
                return f"Success: LoRA adapter '{name}' added successfully."
            why = "; ".join(f"{w}: {answers[w]}" for w in failed)
            message = f"LoRA adapter '{name}' was not loaded: {len(failed)} of {len(workers)} worker(s) of '{base}' failed ({why})."
            if loaded:
                undo = await self._call_all(UNLOAD_LORA_ENDPOINT, {"lora_name": name}, loaded)
                stuck = [w for w in loaded if undo[w] is not None]
                if stuck:
                    message += (f" It stays loaded on {', '.join(map(str, stuck))}, which could not unload it again "
                                f"({'; '.join(str(undo[w]) for w in stuck)}): it is listed in /v1/models; "
                                "unload it with /v1/unload_lora_adapter.")
                else:
                    message += f" It was unloaded again from the {len(loaded)} worker(s) that had loaded it."
                    await self.manager.wait_until(lambda: not self._adapter_workers(name), SEEN_TIMEOUT_S)
            log.warning("%s", message)
            # a worker that answered: the adapter or its file (a 400, as vLLM's); none did: unreachable
            answered = any(not _unreachable(answers[w]) for w in failed)
            raise RequestError(message, status=400 if answered else 503, param="lora_path" if answered else None)

    async def unload(self, name: str) -> str:
        async with self._lock:
            workers = sorted(self._adapter_workers(name), key=lambda w: w.instance_id)
            if not workers:
                if name in self.manager.names():
                    raise RequestError(f"'{name}' is a base model, not a LoRA adapter", param="lora_name")
                raise RequestError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                                   code="model_not_found")
            answers = await self._call_all(UNLOAD_LORA_ENDPOINT, {"lora_name": name}, workers)
            # a worker that said it does not have it, or that died meanwhile, no longer announces it
            await self.manager.wait_until(lambda: not (self._adapter_workers(name) & set(workers)), SEEN_TIMEOUT_S)
            stuck = sorted(self._adapter_workers(name) & set(workers), key=lambda w: w.instance_id)
            if stuck:
                why = "; ".join(f"{w}: {answers[w] or 'still announces it'}" for w in stuck)
                raise RequestError(f"LoRA adapter '{name}' is still loaded on {len(stuck)} of {len(workers)} "
                                   f"worker(s) ({why}); it stays listed in /v1/models", status=500)
            log.info("LoRA adapter %s unloaded from %d worker(s)", name, len(workers))
            return f"Success: LoRA adapter '{name}' removed successfully."

    # -- the calls -------------------------------------------------------------------------------
    async def _call_all(self, endpoint: str, body: dict[str, Any], workers: list[Worker]) -> dict[Worker, str | None]:
        """Each worker's answer: None for success, else what went wrong there."""
        answers = await asyncio.gather(*(self._call(endpoint, body, w) for w in workers))
        return dict(zip(workers, answers, strict=True))

    async def _call(self, endpoint: str, body: dict[str, Any], worker: Worker) -> str | None:
        try:
            async with asyncio.timeout(SEEN_TIMEOUT_S):
                client = await self._client(worker.namespace, worker.component, endpoint)
                while worker.instance_id not in client.instance_ids():  # noqa: ASYNC110 - no per-id event
                    await asyncio.sleep(0.05)
        except TimeoutError:
            return f"unreachable: its {endpoint} endpoint is not (or no longer) registered"
        except Exception as e:  # noqa: BLE001 - etcd or NATS down: that worker cannot be told
            return f"unreachable: {str(e) or type(e).__name__}"
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                async for answer in client.direct(body, worker.instance_id):
                    if isinstance(answer, dict) and answer.get("status") == "success":
                        return None
                    message = answer.get("message") if isinstance(answer, dict) else None
                    return str(message or f"unexpected answer {answer!r}")
                return "unreachable: no answer"
        except TimeoutError:
            return f"unreachable: no answer within {CALL_TIMEOUT_S:g}s"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - gone, NATS down, no such endpoint: that worker failed
            return f"unreachable: {str(e) or type(e).__name__}"

    async def _client(self, namespace: str, component: str, endpoint: str) -> Any:
        key = (namespace, component, endpoint)
        client = self._clients.get(key)
        if client is None:
            ep = self.runtime.namespace(namespace).component(component).endpoint(endpoint)
            client = self._clients[key] = await ep.client()
        return client
