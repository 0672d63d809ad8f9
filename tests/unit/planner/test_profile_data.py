"""The worker profile's file format and its interpolation (what the planner sizes a fleet with)."""

import json

import pytest

from dynamo.errors import UserError
from dynamo.planner.profile_data import DecodePoint, PrefillPoint, WorkerProfile, load


def profile() -> WorkerProfile:
    return WorkerProfile(
        prefill=[PrefillPoint(1000, 110.0, 9090.0), PrefillPoint(100, 20.0, 5000.0), PrefillPoint(4000, 410.0, 9756.0)],
        decode=[DecodePoint(1, 10.0, 0.01, 100.0), DecodePoint(8, 12.0, 0.1, 666.0), DecodePoint(32, 30.0, 0.5, 1066.0)],
        load_time_s=4.5, worker_cmd="dynamo-run in=dyn://x.y.z out=mocker", notes={"sweep": "short"})


def test_round_trip_through_a_directory(tmp_path):
    p = profile()
    path = p.save(tmp_path / "prof")
    assert path.name == "profile.json" and json.loads(path.read_text())["version"] == 1
    back = load(tmp_path / "prof")
    assert back == p
    assert [q.isl for q in back.prefill] == [100, 1000, 4000]  # sorted on the way in


def test_ttft_interpolates_and_extrapolates_upwards():
    p = profile()
    assert p.ttft_ms(1000) == pytest.approx(110.0)
    assert p.ttft_ms(550) == pytest.approx(65.0)
    assert p.ttft_ms(7000) == pytest.approx(710.0)  # beyond the sweep: along the last segment, larger
    assert p.ttft_ms(0) == pytest.approx(10.0)
    assert p.max_prefill_tok_s() == pytest.approx(9756.0)
    assert p.max_prefill_tok_s(550) == pytest.approx((5000.0 + 9090.0) / 2)
    assert p.max_prefill_tok_s(50) == pytest.approx(5000.0)  # outside the sweep: the nearest end's rate
    assert p.max_prefill_tok_s(9000) == pytest.approx(9756.0)


def test_itl_and_the_most_streams_under_a_target():
    p = profile()
    assert p.itl_ms(20) == pytest.approx(21.0)
    assert p.max_decode_concurrency(21.0) == pytest.approx(20.0)
    assert p.max_decode_concurrency(12.0) == pytest.approx(8.0)
    assert p.max_decode_concurrency(100.0) == pytest.approx(32.0)  # capped at what was measured
    assert p.max_decode_concurrency(5.0) == 0.0  # even one stream misses it
    assert p.decode_tok_s(20) == pytest.approx(866.0)


def test_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no worker profile at .*dynamo-planner profile"):
        load(tmp_path)
    (tmp_path / "profile.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read the worker profile"):
        load(tmp_path)
    good = profile().to_json()
    good["decode"][0]["itl_ms"] = -1
    (tmp_path / "profile.json").write_text(json.dumps(good))
    with pytest.raises(UserError, match="negative or non-finite"):
        load(tmp_path)
    del good["prefill"]
    (tmp_path / "profile.json").write_text(json.dumps(good))
    with pytest.raises(UserError, match="missing or invalid field"):
        load(tmp_path)
    with pytest.raises(UserError, match="at least one prefill point"):
        WorkerProfile([], [DecodePoint(1, 1.0, 0.0, 1.0)], 1.0)
