"""What a worker's ``load_lora`` endpoint reads as the adapter's file: vLLM's ``lora_path`` or Dynamo's
``source.uri`` (a local path or a ``file://`` URI); anything else is a clear error, never a guess."""

from __future__ import annotations

import pytest

from dynamo.errors import UserError
from dynamo.worker.lora_control import adapter_path


def test_vllms_path_and_dynamos_file_uri():
    assert adapter_path({"lora_name": "a", "lora_path": "/m/a.gguf"}) == "/m/a.gguf"
    assert adapter_path({"lora_name": "a", "source": {"uri": "file:///m/my%20a.gguf"}}) == "/m/my a.gguf"
    assert adapter_path({"lora_name": "a", "source": {"uri": "/m/a.gguf"}}) == "/m/a.gguf"


@pytest.mark.parametrize(("body", "says"), [
    ({"source": {"uri": "s3://bucket/a"}}, "only local files"),
    ({"source": {"uri": "hf://org/a"}}, "only local files"),
    ({"source": {"uri": ""}}, "source.uri"),
    ({"source": {}}, "source.uri"),
    ({}, "'lora_path' (or 'source.uri') is required"),
    ({"lora_path": 3}, "'lora_path' (or 'source.uri') is required"),
])
def test_what_cannot_be_loaded_is_said(body, says):
    with pytest.raises(UserError) as err:
        adapter_path({"lora_name": "a", **body})
    assert says in str(err.value)
