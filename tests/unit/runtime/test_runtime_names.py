import pytest

from dynamo.runtime.names import EndpointId, lease_hex, parse_lease_hex, slugify


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Qwen/Qwen3-0.6B", "qwen_qwen3-0_6b"),
        ("ns_backend", "ns_backend"),
        ("__Lead", "lead"),
        ("a b.c", "a_b_c"),
        ("llama3B_backend", "llama3b_backend"),
    ],
)
def test_slugify(text, expected):
    assert slugify(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("dyn://ns.comp.ep", ("ns", "comp", "ep")),
        ("ns.comp.ep", ("ns", "comp", "ep")),
        ("dyn://test", ("NS", "test", "E")),
        ("dyn://a.b", ("a", "b", "E")),
        ("dyn://a/b/c", ("a", "b", "c")),
        ("dyn://a.b.c.d.e", ("a", "b", "c_d_e")),
        ("dyn://.a..b.c/", ("a", "b", "c")),
        ("dyn://", ("NS", "C", "E")),
    ],
)
def test_parse_endpoint(text, expected):
    ep = EndpointId.parse(text)
    assert (ep.namespace, ep.component, ep.name) == expected


def test_keys_and_subjects():
    ep = EndpointId("llama3B", "backend", "generate")
    assert ep.service_name == "llama3b_backend"
    assert ep.etcd_prefix == "v1/instances/llama3B/backend/generate"
    assert ep.instance_key(0x694D98A1B2C3) == "v1/instances/llama3B/backend/generate/694d98a1b2c3"
    assert ep.subject(0x694D98A1B2C3) == "llama3b_backend.generate-694d98a1b2c3"
    assert ep.subject(0) == "llama3b_backend.generate"  # static
    assert str(ep) == "dyn://llama3B.backend.generate"


def test_lease_hex_roundtrip():
    assert lease_hex(255) == "ff"
    assert lease_hex(-1) == "ffffffffffffffff"
    assert parse_lease_hex("ffffffffffffffff") == -1
    assert parse_lease_hex(lease_hex(7587899072844905221)) == 7587899072844905221
