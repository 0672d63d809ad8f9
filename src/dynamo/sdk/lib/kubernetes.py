"""Kubernetes manifests for a graph (``dynamo build ... --kubernetes DIR``): the same processes ``dynamo serve``
starts, as plain Deployments and Services.

One ConfigMap holds the merged config (``config.json``, read by every pod as ``DYNAMO_SERVICE_CONFIG``,
exactly what ``dynamo serve`` hands its children).  Each service is a Deployment whose pods run
``python -m dynamo.sdk.runner MODULE:Root Service 0`` (the runner ``dynamo serve`` starts per replica;
every pod is replica 0: pods of one Deployment are interchangeable, and are told apart by their runtime
lease), with ``replicas`` from ``ServiceArgs.workers``, requests and limits from ``ServiceArgs.resources``
and the cluster's etcd and NATS as ``ETCD_ENDPOINTS``/``NATS_SERVER``: on etcd the services find each
other as they do anywhere else, with the planes advertised on the pod's IP (``DYN_TCP_RPC_HOST``).  A
service with an HTTP port (its section's ``port``, or ``@api`` routes: 3000) gets a ClusterIP Service on
it, listening on every interface (``host: 0.0.0.0`` in its section: loopback would be unreachable); one
without gets a headless Service (its pods' DNS names, no port).

Plain objects rather than Dynamo's own DynamoGraphDeployment resource, so they apply to any cluster without
an operator; docs/deploy.md maps one onto the other.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from ..graph import Graph
from .config import SERVICE_ARGS, ConfigError

CONFIG_KEY = "config.json"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_API_PORT = 3000
# SIGTERM to SIGKILL: a replica drains its endpoints (DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT, 30 s by
# default) and then its roles stop; Kubernetes' own default of 30 s would cut the drain short
TERMINATION_GRACE_S = 60


def dns_name(text: str) -> str:
    """A DNS-1123 label: lowercase letters, digits and '-', at most 63, starting and ending alphanumeric."""
    out = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    if not out:
        raise ConfigError(f"{text!r} gives no valid Kubernetes name")
    return out


def resources_of(name: str, resources: Any) -> dict[str, dict[str, str]]:
    """``ServiceArgs.resources`` (``cpu``, ``memory``, ``gpu``) as a container's requests and limits.

    CPU is a request only (a CPU limit throttles a latency-bound server); memory is both (the scheduler
    places by the request, the limit keeps a leak from starving the node); GPUs must be limits in
    Kubernetes (``nvidia.com/gpu``)."""
    if not resources:
        return {}
    if not isinstance(resources, dict):
        raise ConfigError(f"{name}.{SERVICE_ARGS}.resources must be a mapping (cpu, memory, gpu)")
    unknown = sorted(set(resources) - {"cpu", "memory", "gpu"})
    if unknown:
        raise ConfigError(f"{name}.{SERVICE_ARGS}.resources: unknown key(s) {', '.join(unknown)} "
                          "(cpu, memory and gpu are turned into Kubernetes resources)")
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if resources.get("cpu") is not None:
        requests["cpu"] = str(resources["cpu"])
    if resources.get("memory") is not None:
        requests["memory"] = limits["memory"] = str(resources["memory"])
    if resources.get("gpu") is not None:
        try:
            gpus = int(str(resources["gpu"]))
        except ValueError:
            raise ConfigError(f"{name}.{SERVICE_ARGS}.resources.gpu must be a whole number, not "
                              f"{resources['gpu']!r}") from None
        if gpus:
            limits[GPU_RESOURCE] = str(gpus)
    out: dict[str, dict[str, str]] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def http_port(config: dict[str, Any], name: str, has_api: bool) -> int | None:
    section = config.get(name) or {}
    if "port" in section:
        port = section["port"]
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ConfigError(f"{name}.port must be a port number, not {port!r}")
        return port
    return DEFAULT_API_PORT if has_api else None


def manifests(graph: Graph, config: dict[str, Any], target: str, *, name: str, image: str | None,
              etcd: str, nats: str, workdir: str) -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects it holds, for every service of ``graph`` and the shared ConfigMap."""
    graph_name = dns_name(name)
    config = copy.deepcopy(config)
    ports: dict[str, int | None] = {}
    for spec in graph.order:
        port = http_port(config, spec.name, bool(spec.apis()))
        ports[spec.name] = port
        if port is not None:
            config.setdefault(spec.name, {})["host"] = "0.0.0.0"
    config_map = f"{graph_name}-config"
    files: dict[str, list[dict[str, Any]]] = {"configmap.yaml": [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": config_map, "labels": {"app.kubernetes.io/part-of": graph_name}},
        "data": {CONFIG_KEY: json.dumps(config, indent=2, sort_keys=True)},
    }]}
    for spec in graph.order:
        args = (config.get(spec.name) or {}).get(SERVICE_ARGS) or {}
        svc_image = args.get("image") or image
        if not svc_image:
            raise ConfigError(f"service {spec.name} has no image: set image= in its @service, "
                              f"{spec.name}.{SERVICE_ARGS}.image in the config, or --image")
        workers = args.get("workers", 1)
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ConfigError(f"{spec.name}.{SERVICE_ARGS}.workers must be an integer >= 1, not {workers!r}")
        obj_name = dns_name(f"{graph_name}-{spec.name}")
        labels = {"app.kubernetes.io/name": obj_name, "app.kubernetes.io/part-of": graph_name,
                  "app.kubernetes.io/component": dns_name(spec.name), "dynamo.namespace": dns_name(spec.namespace)}
        env = [
            {"name": "DYNAMO_SERVICE_CONFIG",
             "valueFrom": {"configMapKeyRef": {"name": config_map, "key": CONFIG_KEY}}},
            {"name": "ETCD_ENDPOINTS", "value": etcd},
            {"name": "NATS_SERVER", "value": nats},
            {"name": "DYN_TCP_RPC_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ]
        container: dict[str, Any] = {
            "name": dns_name(spec.name), "image": svc_image, "workingDir": workdir,
            "command": ["python", "-m", "dynamo.sdk.runner", target, spec.name, "0", "--working-dir", workdir],
            "env": env,
        }
        resources = resources_of(spec.name, args.get("resources"))
        if resources:
            container["resources"] = resources
        port = ports[spec.name]
        service_spec: dict[str, Any] = {"selector": {"app.kubernetes.io/name": obj_name}}
        if port is not None:
            container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
            container["readinessProbe"] = {"tcpSocket": {"port": "http"}, "periodSeconds": 5}
            service_spec["ports"] = [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
        else:
            service_spec["clusterIP"] = "None"
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": obj_name, "labels": labels},
            "spec": {
                "replicas": workers,
                "selector": {"matchLabels": {"app.kubernetes.io/name": obj_name}},
                "template": {
                    "metadata": {"labels": dict(labels)},  # a copy: no YAML anchor between the two
                    "spec": {"containers": [container], "terminationGracePeriodSeconds": TERMINATION_GRACE_S},
                },
            },
        }
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": obj_name, "labels": dict(labels)},
                   "spec": service_spec}
        files[f"{dns_name(spec.name)}.yaml"] = [deployment, service]
    return files
