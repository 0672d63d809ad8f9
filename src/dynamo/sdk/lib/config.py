"""A graph's configuration: merging the layers (``dynamo serve``) and reading the result (the services).

The config is one mapping of sections, one per service class name, plus ``Common``.  ``dynamo serve``
merges four layers, highest first: the command line (``--Service.key=value``, dotted keys nest), the
YAML file (``-f``), the ``@service`` decorator (its ``workers``/``resources``/``image`` as the section's
``ServiceArgs``) and, lowest, the defaults the service's own code passes to ``get``.  ``Common`` holds
values several services share; a section takes the keys it lists under ``common-configs`` from it.
Within one layer a section's own value beats ``Common``'s; across layers the higher layer wins whether
it set ``Common`` or the section, so ``--Common.model=X`` reaches every service that shares ``model``
even where the YAML set it per section.

The merged result travels to every process as JSON in ``DYNAMO_SERVICE_CONFIG`` (as in the original),
where :meth:`ServiceConfig.get_instance` reads it once.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Iterable, Mapping

import yaml

ENV_VAR = "DYNAMO_SERVICE_CONFIG"
COMMON = "Common"
COMMON_KEYS = "common-configs"
SERVICE_ARGS = "ServiceArgs"


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message is the whole story."""


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` onto a copy of ``base``: mappings merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_value(text: str) -> Any:
    """A command-line value as YAML reads it (``2`` -> 2, ``true`` -> True, ``[a, b]`` a list), else the text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    """``--Service.key=value`` / ``--Service.key value`` arguments into a nested mapping."""
    out: dict[str, Any] = {}
    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognised argument {arg!r}: overrides are --Service.key=value")
        if "=" in arg:
            path, text = arg[2:].split("=", 1)
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            path, text = arg[2:], items[i + 1]
            i += 1
        else:
            path, text = arg[2:], "true"
        keys = path.split(".")
        if any(not k for k in keys):
            raise ConfigError(f"bad override {arg!r}: empty key in {path!r}")
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r} conflicts with another one setting {key!r}")
        node[keys[-1]] = parse_value(text)
        i += 1
    return out


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) or v is None for v in data.values()):
        raise ConfigError(f"config file {path}: expected sections (Service: {{key: value}}) at the top level")
    return {str(k): (v or {}) for k, v in data.items()}


def merge_layers(layers: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge config layers given lowest first, applying ``Common`` through ``common-configs`` per layer."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = deep_merge(merged, layer)
    shared: dict[str, list[str]] = {}
    for name, section in merged.items():
        if isinstance(section, dict) and COMMON_KEYS in section:
            keys = section[COMMON_KEYS]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ConfigError(f"{name}.{COMMON_KEYS} must be a list of key names")
            shared[name] = keys
    for name, keys in shared.items():
        for key in keys:
            value, found = None, False
            for layer in layers:  # the highest layer that sets Common.key or Section.key wins
                own = layer.get(name) or {}
                common = layer.get(COMMON) or {}
                if isinstance(own, Mapping) and key in own:
                    value, found = own[key], True
                elif isinstance(common, Mapping) and key in common:
                    value, found = common[key], True
            if found:
                merged[name][key] = copy.deepcopy(value)
    return merged


class ServiceConfig(dict):
    """The merged config as the services read it: a dict of sections, with the original's helpers."""

    _instance: "ServiceConfig | None" = None

    @classmethod
    def get_instance(cls) -> "ServiceConfig":
        """The process's config, read once from ``DYNAMO_SERVICE_CONFIG`` (empty when unset)."""
        if cls._instance is None:
            raw = os.environ.get(ENV_VAR, "")
            try:
                data = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f"{ENV_VAR} is not valid JSON: {e}") from None
            cls._instance = cls(data if isinstance(data, dict) else {})
        return cls._instance

    @classmethod
    def reset(cls) -> None:
        """Forget the instance (tests, or after changing the environment)."""
        cls._instance = None

    def require(self, section: str, key: str) -> Any:
        values = self.get(section) or {}
        if key not in values:
            raise ConfigError(f"{section}.{key} is required: set it in the YAML file under {section}: "
                              f"or with --{section}.{key}=...")
        return values[key]

    def as_args(self, section: str, prefix: str = "", exclude: tuple[str, ...] = ()) -> list[str]:
        """A section as command-line flags for an engine: ``--key value``; ``True`` is a bare ``--key``,
        ``False`` and ``None`` are left out, lists and mappings go as JSON.  With ``prefix`` only the keys
        starting with it, the prefix removed.  ``ServiceArgs``, ``common-configs`` and the keys in ``exclude``
        (the ones the service reads itself) are never flags."""
        out: list[str] = []
        for key, value in (self.get(section) or {}).items():
            if key in (SERVICE_ARGS, COMMON_KEYS, *exclude) or not key.startswith(prefix):
                continue
            flag = "--" + key[len(prefix):]
            if value is True:
                out.append(flag)
            elif value is False or value is None:
                continue
            elif isinstance(value, (list, dict)):
                out += [flag, json.dumps(value)]
            else:
                out += [flag, str(value)]
        return out
