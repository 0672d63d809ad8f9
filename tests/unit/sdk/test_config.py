"""The config layers of ``dynamo serve`` (dynamo.sdk.lib.config): precedence, Common, overrides, reading."""

from __future__ import annotations

import json

import pytest

from dynamo.sdk.lib.config import ENV_VAR, ConfigError, ServiceConfig, load_yaml, merge_layers, parse_overrides


def test_command_line_beats_yaml_beats_decorator():
    decorator = {"Worker": {"ServiceArgs": {"workers": 1, "resources": {"cpu": 1}}}}
    yaml_layer = {"Worker": {"ServiceArgs": {"workers": 2}, "temperature": 0.5, "model": "a"}}
    cli = parse_overrides(["--Worker.model=b", "--Worker.ServiceArgs.workers", "3"])
    merged = merge_layers([decorator, yaml_layer, cli])
    assert merged["Worker"] == {"ServiceArgs": {"workers": 3, "resources": {"cpu": 1}}, "temperature": 0.5, "model": "b"}


def test_common_configs_take_shared_keys_section_wins_within_a_layer():
    yaml_layer = {"Common": {"model": "m-common", "block-size": 64},
                  "Worker": {"common-configs": ["model", "block-size"], "model": "m-own"},
                  "Other": {"x": 1}}
    merged = merge_layers([{}, yaml_layer, {}])
    assert merged["Worker"]["model"] == "m-own"
    assert merged["Worker"]["block-size"] == 64
    assert "model" not in merged["Other"]  # only sections that list the key share it


def test_common_on_the_command_line_beats_a_section_in_yaml():
    yaml_layer = {"Common": {"model": "m-common"}, "Worker": {"common-configs": ["model"], "model": "m-own"}}
    merged = merge_layers([{}, yaml_layer, parse_overrides(["--Common.model=/models/x.gguf"])])
    assert merged["Worker"]["model"] == "/models/x.gguf"
    assert merged["Common"]["model"] == "/models/x.gguf"


def test_overrides_parse_values_as_yaml():
    got = parse_overrides(["--A.n=2", "--A.flag", "--A.f=0.5", "--A.s=hello world", "--A.l=[1, 2]", "--B.c.d=true"])
    assert got == {"A": {"n": 2, "flag": True, "f": 0.5, "s": "hello world", "l": [1, 2]}, "B": {"c": {"d": True}}}


@pytest.mark.parametrize("bad", ["--noservice=1", "positional", "--A..b=1"])
def test_bad_overrides_are_errors(bad):
    with pytest.raises(ConfigError):
        parse_overrides([bad])


def test_load_yaml_errors_are_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="sections"):
        load_yaml(str(p))
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml(str(tmp_path / "missing.yaml"))
    p.write_text("A:\n  x: 1\nB:\n")
    assert load_yaml(str(p)) == {"A": {"x": 1}, "B": {}}


def test_service_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"Worker": {"model": "m", "n-ctx": 512, "flash": True, "off": False,
                                                       "lora": {"a": 1}, "ServiceArgs": {"workers": 2},
                                                       "common-configs": ["model"], "engine-tp": 2}}))
    ServiceConfig.reset()
    try:
        cfg = ServiceConfig.get_instance()
        assert cfg is ServiceConfig.get_instance()
        assert cfg.get("Worker")["model"] == "m"
        assert cfg.get("Missing", {}) == {}
        assert cfg.require("Worker", "model") == "m"
        with pytest.raises(ConfigError, match="Worker.nope is required"):
            cfg.require("Worker", "nope")
        assert cfg.as_args("Worker") == ["--model", "m", "--n-ctx", "512", "--flash", "--lora", '{"a": 1}',
                                         "--engine-tp", "2"]
        assert cfg.as_args("Worker", prefix="engine-") == ["--tp", "2"]
    finally:
        ServiceConfig.reset()
