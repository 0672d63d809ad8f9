"""Dynamo 1.x's discovery records, byte for byte against what 1.6.1 wrote (/tmp/d16/FACTS.md, observed
on disk): keys, file names, the Endpoint and Model values (the EventChannel value: test_v1_event_wire.py),
an Instance's JSON being 1.x's Endpoint, ours with one extra field."""

from __future__ import annotations

import orjson
import pytest

from dynamo.runtime.file_v1 import decode_name, encode_name
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId, is_v1_tcp_address, lease_hex
from dynamo.runtime.v1_records import (
    endpoint_key,
    instances_prefix,
    model_key,
    model_record,
    signed_id,
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


def _instance(instance_id: int = ID, **kw) -> Instance:
    return Instance("d16", "backend", "generate", instance_id,
                    f"127.0.0.1:43837/{lease_hex(instance_id)}/d16/backend/generate", **kw)


def test_an_instance_is_1_6_1s_endpoint_record_byte_for_byte() -> None:
    assert _instance(device_type="cuda", ours=False).to_json() == ENDPOINT_1_6_1
    ours = orjson.loads(_instance().to_json())
    assert ours["device_type"] == "cpu" and ours["request_plane_codec"] == "msgpack"
    assert list(ours)[-1] == "dynamo_py" and ours["dynamo_py"] is True  # the one field 1.6.1 ignores
    assert EndpointId("d16", "backend", "generate").instance_key(ID) == endpoint_key("d16", "backend", "generate", ID)


def test_model_record_wraps_the_card() -> None:
    record = orjson.loads(model_record("d16", "backend", "generate", ID, {"display_name": "m"}))
    assert list(record) == ["type", "namespace", "component", "endpoint", "instance_id", "card_json"]
    assert record["type"] == "Model" and record["instance_id"] == ID


def test_a_1_x_endpoint_record_is_an_instance_with_its_transport_as_subject() -> None:
    inst = Instance.from_json(ENDPOINT_1_6_1)
    assert inst == _instance(device_type="cuda", ours=False)
    assert is_v1_tcp_address(inst.subject)
    assert not is_v1_tcp_address("d16_backend.generate-59f5a0430fd477b0")
    assert Instance.from_json(_instance().to_json()).ours  # ours say so


def test_an_endpoint_served_over_nats_is_1_x_s_nats_tcp_transport() -> None:
    inst = Instance("n", "c", "e", 1, "n_c.e-1")
    assert orjson.loads(inst.to_json())["transport"] == {"nats_tcp": "n_c.e-1"}
    assert Instance.from_json(inst.to_json()) == inst


def test_ids_above_i64_are_kept_negative_as_our_keys_read_them() -> None:
    big = 0xF000_0000_0000_0001
    record = _instance(big).to_json()
    assert orjson.loads(record)["instance_id"] == big  # u64 in 1.x's JSON
    inst = Instance.from_json(record)
    assert inst.instance_id == signed_id(big) < 0 and u64_id(inst.instance_id) == big
    assert lease_hex(inst.instance_id) == "f000000000000001"
    assert endpoint_key("n", "c", "e", inst.instance_id) == "v1/instances/n/c/e/f000000000000001"


@pytest.mark.parametrize("record, why", [
    (b'{"type":"Model","namespace":"n"}', "not an Endpoint"),
    (b'{"type":"Endpoint","component":"c","endpoint":"e","namespace":"n","instance_id":1,'
     b'"transport":{"http":"http://h:1/v1/rpc/e"}}', "http cannot be reached"),
])
def test_records_we_cannot_reach_are_refused_with_the_reason(record: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Instance.from_json(record)
