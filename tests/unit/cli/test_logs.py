"""DYN_LOG filters (RUST_LOG-like) and the -v / -vv levels."""

from __future__ import annotations

import logging

import pytest

from dynamo.cli.logs import TRACE, parse_filter, setup_logging


@pytest.mark.parametrize(
    "spec,default,targets",
    [
        ("", None, {}),
        ("debug", logging.DEBUG, {}),
        ("WARN", logging.WARNING, {}),
        ("info,dynamo.frontend.http=debug", logging.INFO, {"dynamo.frontend.http": logging.DEBUG}),
        ("error, dynamo.cli = trace", logging.ERROR, {"dynamo.cli": TRACE}),
        # Rust-style targets of the original map onto our modules
        ("dynamo_llm::http::service=debug", None, {"dynamo.frontend.http.service": logging.DEBUG}),
        ("dynamo_runtime=warn", None, {"dynamo.runtime": logging.WARNING}),
        # a bare target enables everything for it
        ("dynamo.llm", None, {"dynamo.llm": TRACE}),
        ("info,dynamo.llm=off", logging.INFO, {"dynamo.llm": logging.CRITICAL + 10}),
        # junk levels are ignored rather than fatal
        ("loud,dynamo.x=shouty", None, {"loud": TRACE}),
    ],
)
def test_parse_filter(spec, default, targets):
    assert parse_filter(spec) == (default, targets)


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    names = ["dynamo", "dynamo.llm", "dynamo.frontend.http", "dynamo.cli"]
    saved_levels = {n: logging.getLogger(n).level for n in names}
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[1]:
        root.addHandler(h)
    root.setLevel(saved[0])
    for n, lvl in saved_levels.items():
        logging.getLogger(n).setLevel(lvl)


def test_default_is_info(monkeypatch, restore_logging):
    monkeypatch.delenv("DYN_LOG", raising=False)
    setup_logging(0)
    log = logging.getLogger("dynamo.frontend.http")
    assert log.isEnabledFor(logging.INFO)
    assert not log.isEnabledFor(logging.DEBUG)


def test_v_is_debug_and_vv_is_trace(monkeypatch, restore_logging):
    monkeypatch.delenv("DYN_LOG", raising=False)
    setup_logging(1)
    assert logging.getLogger("dynamo.cli").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("dynamo.cli").isEnabledFor(TRACE)
    setup_logging(2)
    assert logging.getLogger("dynamo.cli").isEnabledFor(TRACE)


def test_dyn_log_filters_per_module(monkeypatch, restore_logging):
    monkeypatch.setenv("DYN_LOG", "warn,dynamo.frontend.http=debug")
    setup_logging(0)
    assert logging.getLogger("dynamo.frontend.http.service").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("dynamo.cli").isEnabledFor(logging.INFO)
    assert logging.getLogger("dynamo.cli").isEnabledFor(logging.WARNING)


def test_logs_go_to_stderr(monkeypatch, restore_logging, capsys):
    monkeypatch.delenv("DYN_LOG", raising=False)
    setup_logging(0)
    logging.getLogger("dynamo.cli").info("hello from the test")
    captured = capsys.readouterr()
    assert "hello from the test" in captured.err
    assert "hello from the test" not in captured.out


def _emit(monkeypatch, capsys, env: dict[str, str]) -> str:
    import logging as _logging

    from dynamo.cli.logs import setup_logging

    for k in ("DYN_LOGGING_JSONL", "DYN_LOG_USE_LOCAL_TZ", "DYN_LOG"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    setup_logging(0)
    try:
        _logging.getLogger("dynamo.test").warning("hello %s", "there")
    finally:
        for h in list(_logging.getLogger().handlers):
            _logging.getLogger().removeHandler(h)
    return capsys.readouterr().err.strip()


def test_text_logs_have_iso8601_utc_microsecond_timestamps(monkeypatch, capsys):
    import re

    line = _emit(monkeypatch, capsys, {})
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z WARNING dynamo\.test: hello there$", line), line


def test_jsonl_logs_carry_time_level_target_message_file_line(monkeypatch, capsys):
    import json
    import re

    rec = json.loads(_emit(monkeypatch, capsys, {"DYN_LOGGING_JSONL": "1"}))
    assert rec["level"] == "WARNING" and rec["target"] == "dynamo.test" and rec["message"] == "hello there"
    assert rec["file"].endswith("test_logs.py") and isinstance(rec["line"], int)
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$", rec["time"])


def test_local_timezone_timestamps_carry_an_offset(monkeypatch, capsys):
    import json
    import re

    rec = json.loads(_emit(monkeypatch, capsys, {"DYN_LOGGING_JSONL": "1", "DYN_LOG_USE_LOCAL_TZ": "1"}))
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}[+-]\d\d:\d\d$", rec["time"]), rec["time"]
