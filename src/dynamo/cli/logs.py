"""Logging set-up: info to stderr by default, ``-v`` debug, ``-vv`` trace, ``DYN_LOG`` like RUST_LOG.

``DYN_LOG`` is a comma list of ``level`` or ``target=level`` items, e.g. ``info,dynamo.frontend.http=debug``.
Rust-style ``dynamo_llm::http`` targets are accepted and mapped to our module names.
``DYN_LOGGING_JSONL=1`` writes one JSON object per line (time, level, target, message, file, line, and
the exception when there is one); with tracing on (``OTEL_EXPORT_ENABLED``), a line logged while a request's
span is current carries its ``trace_id`` and ``span_id`` too, so logs and traces join.  Timestamps are ISO-8601 with microseconds in UTC (``...Z``), as
Dynamo writes them; ``DYN_LOG_USE_LOCAL_TZ=1`` uses local time with its offset instead.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone

from dynamo.runtime import tracing

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR, "off": logging.CRITICAL + 10}


# The original's Rust crate keeps the HTTP service, discovery and the KV router in dynamo_llm; ours has
# them in dynamo.frontend (docs/architecture.md), so its log targets map there.
_FRONTEND_MODULES = ("http", "discovery", "kv_router", "model_manager", "remote")


def _target(name: str) -> str:
    name = name.replace("::", ".")
    if name.startswith("dynamo_"):  # dynamo_llm -> dynamo.llm, dynamo_runtime -> dynamo.runtime
        name = "dynamo." + name[len("dynamo_"):]
    head, _, rest = name.removeprefix("dynamo.llm.").partition(".")
    if name.startswith("dynamo.llm.") and head in _FRONTEND_MODULES:
        name = "dynamo.frontend." + head + ("." + rest if rest else "")
    return name


def parse_filter(spec: str) -> tuple[int | None, dict[str, int]]:
    default: int | None = None
    targets: dict[str, int] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            target, _, level = item.partition("=")
            lvl = _LEVELS.get(level.strip().lower())
            if lvl is not None:
                targets[_target(target.strip())] = lvl
        else:
            lvl = _LEVELS.get(item.lower())
            if lvl is not None:
                default = lvl
            else:  # a bare target means "everything" for it, like RUST_LOG
                targets[_target(item)] = TRACE
    return default, targets


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def format_time(created: float, local: bool = False) -> str:
    """``2026-11-22T15:30:36.123456Z`` (UTC) or ``2026-11-22T16:30:36.123456+01:00`` (local)."""
    if local:
        return datetime.fromtimestamp(created).astimezone().isoformat(timespec="microseconds")
    return datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _TextFormatter(logging.Formatter):
    def __init__(self, local: bool) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(name)s: %(message)s")
        self._local = local

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return format_time(record.created, self._local)


class _JsonFormatter(logging.Formatter):
    def __init__(self, local: bool) -> None:
        super().__init__()
        self._local = local

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": format_time(record.created, self._local), "level": record.levelname,
               "target": record.name, "message": record.getMessage(), "file": record.pathname,
               "line": record.lineno}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if tracing.ENABLED:
            ids = tracing.log_ids()
            if ids is not None:
                out["trace_id"], out["span_id"] = ids
        return json.dumps(out)


def setup_logging(verbosity: int = 0) -> None:
    default, targets = parse_filter(os.environ.get("DYN_LOG", ""))
    if verbosity >= 2:
        default = TRACE
    elif verbosity == 1:
        default = logging.DEBUG
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    local = _truthy("DYN_LOG_USE_LOCAL_TZ")
    if _truthy("DYN_LOGGING_JSONL"):
        handler.setFormatter(_JsonFormatter(local))
    else:
        handler.setFormatter(_TextFormatter(local))
    root.addHandler(handler)
    # our own code follows the chosen level; libraries stay at warning unless debug/trace is asked for
    level = default if default is not None else logging.INFO
    root.setLevel(level if level <= logging.DEBUG else logging.WARNING)
    logging.getLogger("dynamo").setLevel(level)
    for target, lvl in targets.items():
        logging.getLogger(target).setLevel(lvl)
