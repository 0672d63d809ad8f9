"""Dynamo 1.x's discovery records, byte for byte against what 1.6.1 wrote (/tmp/d16/FACTS.md, observed
on disk): keys, file names, the Endpoint and Model values (the EventChannel value: test_v1_event_wire.py), reading them back as our Instances."""

from __future__ import annotations

import orjson
import pytest

from dynamo.runtime.file_v1 import decode_name, encode_name
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId, is_v1_tcp_address, lease_hex
from dynamo.runtime.v1_records import (
    endpoint_key,
    endpoint_record,
    instance_from_record,
    instances_prefix,
    model_key,
    model_record,
    our_instance_key,
    signed_id,
    translate_instance,
    u64_id,
)

ID = 6482263448558532528  # 59f5a0430fd477b0
ENDPOINT_1_6_1 = (b'{"type":"Endpoint","component":"backend","endpoint":"generate","namespace":"d16",'
                  b'"instance_id":6482263448558532528,"transport":{"tcp":"127.0.0.1:43837/59f5a0430fd477b0/d16/backend/'
                  b'generate"},"device_type":"cuda","request_plane_codec":"msgpack"}')


def test_keys_as_1_6_1_writes_them() -> None:
    assert endpoint_key("d16", "backend", "generate", ID) == "v1/instances/d16/backend/generate/59f5a0430fd477b0"
    assert model_key("d16", "backend", "generate", ID) == "v1/mdc/d16/backend/generate/59f5a0430fd477b0"
    assert model_key("d16", "backend", "generate", ID, "lora-a") == "v1/mdc/d16/backend/generate/59f5a0430fd477b0/lora-a"
    assert instances_prefix(EndpointId("d16", "backend", "gen")) == "v1/instances/d16/backend/gen/"


def test_file_names_are_1_6_1s_percent_encoding() -> None:
    assert encode_name("d16/backend/worker_kv_query_source_9dc60b4175ba5/59f5a0430fd477b0") == (
        "d16%2Fbackend%2Fworker%5Fkv%5Fquery%5Fsource%5F9dc60b4175ba5%2F59f5a0430fd477b0")
    observed = ("namespace%2Fd16%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F9dc60b4175ba5")
    assert encode_name("namespace/d16/component/backend/endpoint/generate/topic/kv-events/9dc60b4175ba5") == observed
    assert decode_name(observed).endswith("/topic/kv-events/9dc60b4175ba5")
    assert decode_name(encode_name("é.~ x")) == "é.~ x"


def test_endpoint_record_is_byte_identical_to_1_6_1s() -> None:
    assert endpoint_record("d16", "backend", "generate", ID, "127.0.0.1:43837", device_type="cuda") == ENDPOINT_1_6_1
    ours = orjson.loads(endpoint_record("d16", "backend", "generate", ID, "127.0.0.1:43837"))
    assert ours["device_type"] == "cpu" and ours["request_plane_codec"] == "msgpack"


def test_model_record_wraps_the_card() -> None:
    record = orjson.loads(model_record("d16", "backend", "generate", ID, {"display_name": "m"}))
    assert list(record) == ["type", "namespace", "component", "endpoint", "instance_id", "card_json"]
    assert record["type"] == "Model" and record["instance_id"] == ID


def test_a_1_x_endpoint_record_is_an_instance_with_its_transport_as_subject() -> None:
    inst = instance_from_record(ENDPOINT_1_6_1)
    assert inst == Instance("d16", "backend", "generate", ID, "127.0.0.1:43837/59f5a0430fd477b0/d16/backend/generate",
                            "msgpack")
    assert is_v1_tcp_address(inst.subject)
    assert not is_v1_tcp_address("tcp://127.0.0.1:43837/d16_backend.generate-59f5")
    assert not is_v1_tcp_address("d16_backend.generate-59f5a0430fd477b0")
    again = Instance.from_json(inst.to_json())  # through our JSON (what the merged watch hands a client)
    assert again == inst and orjson.loads(inst.to_json())["transport"] == {"tcp": inst.subject}
    key, value = translate_instance("v1/instances/d16/backend/generate/59f5a0430fd477b0", ENDPOINT_1_6_1)
    assert key == "instances/d16/backend/generate:59f5a0430fd477b0" and Instance.from_json(value) == inst


def test_ids_above_i64_are_kept_negative_as_our_keys_read_them() -> None:
    big = 0xF000_0000_0000_0001
    record = endpoint_record("n", "c", "e", big, "h:1")
    assert orjson.loads(record)["instance_id"] == big  # u64 in 1.x's JSON
    inst = instance_from_record(record)
    assert inst.instance_id == signed_id(big) < 0 and u64_id(inst.instance_id) == big
    assert lease_hex(inst.instance_id) == "f000000000000001"
    assert our_instance_key(endpoint_key("n", "c", "e", big)) == "instances/n/c/e:f000000000000001"


@pytest.mark.parametrize("record, why", [
    (b'{"type":"Model","namespace":"n"}', "not an Endpoint"),
    (b'{"type":"Endpoint","component":"c","endpoint":"e","namespace":"n","instance_id":1,'
     b'"transport":{"nats_tcp":"x"}}', "not TCP"),
])
def test_records_we_cannot_reach_are_refused_with_the_reason(record: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        instance_from_record(record)


def test_keys_that_are_not_instance_keys() -> None:
    assert our_instance_key("v1/instances/a/b/c") is None
    assert our_instance_key("v1/instances/a/b/c/zz") is None
    with pytest.raises(ValueError):
        translate_instance("v1/mdc/a/b/c/1", ENDPOINT_1_6_1)
