"""The router's decision log (``DYN_ROUTER_LOG``): what it records per decision, event and milestone."""

import logging

import orjson

from dynamo.kv.decision_log import DecisionLog
from dynamo.kv.events import kv_event, stored_data
from dynamo.kv.hashing import compute_hashes
from dynamo.kv.router import KvRouter

BS = 4


def lines(path):
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def test_a_decision_an_event_and_the_milestones_are_logged_in_order(tmp_path):
    now = [100.0]
    log = DecisionLog(tmp_path / "d.jsonl", clock=lambda: now[0])
    r = KvRouter(block_size=BS, overlap_score_weight=2.0, seed=0, decision_log=log)
    prompt = list(range(1, 19))  # 4 complete blocks and a partial one
    local, seq = compute_hashes(prompt, BS)
    r.apply_event(kv_event(7, 1, stored_data(None, list(zip(seq[:2], local[:2], strict=True)))))
    now[0] = 100.5
    r.select(prompt, [7, 8], request_id="a")  # 7 holds 2 blocks
    now[0] = 100.75
    b = r.select(prompt, [7, 8], request_id="b")  # a is in flight on 7: 4 blocks shared there
    r.on_first_token("a")
    r.on_finished("a")
    r.on_finished("b")
    log.close()
    got = lines(tmp_path / "d.jsonl")
    assert [x["ev"] for x in got] == ["stored", "route", "route", "first", "done", "done"]
    assert got[0] == {"ev": "stored", "worker": "7", "tier": "device", "blocks": seq[:2], "t": 100.0}
    first, second = got[1], got[2]
    assert first["t"] == 100.5 and first["id"] == "a" and first["worker"] == "7" and first["isl"] == 18
    assert first["blocks"] == seq  # the complete blocks only, not the request's private tail
    assert first["candidates"]["7"]["overlap"] == 2 and first["candidates"]["8"]["overlap"] == 0
    assert first["candidates"]["7"]["requests"] == 0
    assert second["worker"] == f"{b.worker_id:x}"
    seven = second["candidates"]["7"]
    assert (seven["overlap"], seven["inflight"], seven["requests"]) == (2, 4, 1)
    assert seven["active_tokens"] == 18 - 2 * BS  # a's pending prefill
    assert {"prefill", "decode", "logit", "active_blocks"} <= set(seven)


def test_off_without_the_variable_and_a_warning_for_a_path_it_cannot_open(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("DYN_ROUTER_LOG", raising=False)
    assert DecisionLog.from_env() is None
    monkeypatch.setenv("DYN_ROUTER_LOG", str(tmp_path / "missing-dir" / "d.jsonl"))
    with caplog.at_level(logging.WARNING):
        assert DecisionLog.from_env() is None
    assert "cannot open the router decision log" in caplog.text
    monkeypatch.setenv("DYN_ROUTER_LOG", str(tmp_path / "d.jsonl"))
    log = DecisionLog.from_env()
    assert log is not None and log.path == tmp_path / "d.jsonl"
    log.close()
