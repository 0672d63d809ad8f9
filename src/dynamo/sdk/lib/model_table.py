"""The served-model table an LLM graph's frontend prints, as the Dynamo README's ``dynamo serve`` shows it.

    Added new chat model SmolLM2-135M-Instruct.Q4_1
    +------------+----------------------------+-----------+-----------+----------+
    | MODEL TYPE | MODEL NAME                 | NAMESPACE | COMPONENT | ENDPOINT |
    +------------+----------------------------+-----------+-----------+----------+
    | chat       | SmolLM2-135M-Instruct.Q4_1 | dynamo    | backend   | generate |
    +------------+----------------------------+-----------+-----------+----------+

It follows the same discovery prefix the frontend follows (the workers' model entries), in the
service's own process, so the table is what the frontend can serve: a row per model name, type and
endpoint (replicas of one endpoint are one row), printed again whenever a row appears.  A worker
registering a ``Backend`` model serves chat (and completions) through the frontend's pre-processor, so it
is shown as ``chat``, the word the original's table used for it; a prefill worker's row says ``prefill``.
"""

from __future__ import annotations

import logging
from typing import IO, Any

from dynamo.llm.model_entry import ModelEntry
from dynamo.llm.model_type import ModelType
from dynamo.llm.v1_card import entry_from_record
from dynamo.runtime.v1_records import models_prefix

log = logging.getLogger(__name__)

HEADER = ("MODEL TYPE", "MODEL NAME", "NAMESPACE", "COMPONENT", "ENDPOINT")
Row = tuple[str, str, str, str, str]

_SHOWN_AS = {ModelType.Backend: "chat", ModelType.Chat: "chat", ModelType.Completion: "completions",
             ModelType.Embedding: "embedding", ModelType.Prefill: "prefill"}


def row_of(entry: ModelEntry) -> Row:
    return (_SHOWN_AS.get(entry.model_type, entry.model_type.value.lower()), entry.name, entry.namespace,
            entry.component, entry.endpoint)


def render(rows: list[Row]) -> str:
    """An ASCII table of ``rows`` under :data:`HEADER`, columns as wide as their widest cell."""
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells: Row) -> str:
        return "|" + "|".join(f" {c:<{w}} " for c, w in zip(cells, widths, strict=True)) + "|"

    return "\n".join([rule, line(HEADER), rule, *(line(r) for r in rows), rule])


class ModelTable:
    """The rows seen so far; :meth:`add` says what to print when an entry brings a new one."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.names: set[tuple[str, str]] = set()

    def add(self, entry: ModelEntry) -> str | None:
        row = row_of(entry)
        if row in self.rows:
            return None
        self.rows.append(row)
        lines = []
        if (row[0], row[1]) not in self.names:
            self.names.add((row[0], row[1]))
            lines.append(f"Added new {row[0]} model {row[1]}")
        lines.append(render(sorted(self.rows)))
        return "\n".join(lines)


async def print_served_models(runtime: Any, out: IO[str], namespace: str | None = None) -> None:
    """Follow the model entries in discovery (of ``namespace`` only, as a frontend given ``--namespace``)
    and print the table each time a row appears; runs until cancelled.  A malformed entry is skipped (the
    frontend logs it)."""
    table = ModelTable()
    watch = await runtime.discovery().watch_prefix(models_prefix(namespace)).start()
    try:
        async for event in watch:
            if event.kind != "put":
                continue
            try:
                entry = entry_from_record(event.value)
            except Exception:  # noqa: BLE001 - not ours to judge: the frontend warns about it
                continue
            text = table.add(entry)
            if text is not None:
                out.write(text + "\n")
                out.flush()
    finally:
        await watch.close()
