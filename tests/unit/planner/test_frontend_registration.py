"""A frontend's discovery entry: its format, and the URL it advertises."""

from __future__ import annotations

import pytest

from dynamo.frontend.registration import FRONTENDS_PREFIX, FrontendEntry, advertised_url


def test_entry_round_trip_and_key():
    entry = FrontendEntry(url="http://10.0.0.5:8000", instance_id=0x7587ABC, http_worker=1)
    assert entry.key() == f"{FRONTENDS_PREFIX}7587abc"
    assert entry.metrics_url == "http://10.0.0.5:8000/metrics"
    assert FrontendEntry.from_json(entry.to_json()) == entry


@pytest.mark.parametrize("value", [b'{"url": "ftp://x", "instance_id": 1}', b'{"instance_id": 1}', b"[]", b"nope"])
def test_malformed_entries_are_errors(value):
    with pytest.raises((ValueError, KeyError, TypeError)):
        FrontendEntry.from_json(value)


def test_advertised_url(monkeypatch):
    assert advertised_url("http", "127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert advertised_url("https", "::1", 443) == "https://[::1]:443"
    monkeypatch.setenv("DYN_HTTP_ADVERTISE_HOST", "frontend-0.example")
    assert advertised_url("http", "0.0.0.0", 8080) == "http://frontend-0.example:8080"
    monkeypatch.delenv("DYN_HTTP_ADVERTISE_HOST")
    host = advertised_url("http", "0.0.0.0", 8080).split("//")[1].rsplit(":", 1)[0]
    assert host not in ("0.0.0.0", "")  # a wildcard is never advertised
