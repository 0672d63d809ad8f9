"""``dynamo build ... --kubernetes DIR`` as a user runs it (a subprocess, from the graph's folder), its
manifests checked against the Kubernetes API's own schema: the ``kubernetes`` client's models (pydantic,
unknown fields forbidden, validated strictly: a string where the API wants an integer fails)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.proc import cli_env

k8s = pytest.importorskip("kubernetes.client")

ROOT = Path(__file__).resolve().parents[3]
LLM = ROOT / "examples" / "llm"
HELLO = ROOT / "examples" / "hello_world"
BUILD = [sys.executable, "-m", "dynamo.sdk.cli", "build"]
MODELS = {"Deployment": "V1Deployment", "Service": "V1Service", "ConfigMap": "V1ConfigMap"}


def validate(doc: dict[str, Any]) -> None:
    getattr(k8s, MODELS[doc["kind"]]).model_validate(doc, strict=True)


def build(tmp_path: Path, *args: str, cwd: Path = LLM) -> tuple[subprocess.CompletedProcess[str], dict[str, list[dict]]]:
    out = tmp_path / "k8s"
    p = subprocess.run(BUILD + [*args, "--kubernetes", str(out)], cwd=cwd, capture_output=True, text=True,
                       env=cli_env(), timeout=60)
    files = {f.name: list(yaml.safe_load_all(f.read_text())) for f in sorted(out.glob("*.yaml"))} if out.exists() else {}
    return p, files


def by_kind(files: dict[str, list[dict]], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for docs in files.values() for d in docs if d["kind"] == kind}


def test_the_disagg_graph_is_a_valid_deployment_and_service_per_service_with_the_config_as_a_configmap(tmp_path):
    p, files = build(tmp_path, "graphs.disagg:Frontend", "-f", "configs/disagg_router.yaml", "--image", "reg/dynamo:1",
                     "--Worker.ServiceArgs.workers=3", "--Worker.ServiceArgs.resources.gpu=1",
                     "--Worker.ServiceArgs.resources.memory=20Gi", "--etcd-endpoints", "http://my-etcd:2379",
                     "--nats-server", "nats://my-nats:4222")
    assert p.returncode == 0, p.stderr
    assert set(files) == {"configmap.yaml", "frontend.yaml", "worker.yaml", "prefillworker.yaml"}
    for docs in files.values():
        for doc in docs:
            validate(doc)
    deployments, services = by_kind(files, "Deployment"), by_kind(files, "Service")
    assert set(deployments) == set(services) == {"disagg-frontend", "disagg-worker", "disagg-prefillworker"}
    assert {n: d["spec"]["replicas"] for n, d in deployments.items()} == \
        {"disagg-frontend": 1, "disagg-worker": 3, "disagg-prefillworker": 1}
    for name, d in deployments.items():  # the selector picks the pods the Deployment makes, and the Service's
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert services[name]["spec"]["selector"].items() <= labels.items()
    worker = deployments["disagg-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert worker["image"] == "reg/dynamo:1"
    assert worker["command"] == ["python", "-m", "dynamo.sdk.runner", "graphs.disagg:Frontend", "Worker", "0",
                                 "--working-dir", "/workspace"]
    assert worker["resources"] == {"requests": {"cpu": "1", "memory": "20Gi"},
                                   "limits": {"memory": "20Gi", "nvidia.com/gpu": "1"}}
    env = {e["name"]: e for e in worker["env"]}
    assert env["ETCD_ENDPOINTS"]["value"] == "http://my-etcd:2379"
    assert env["NATS_SERVER"]["value"] == "nats://my-nats:4222"
    assert env["DYNAMO_SERVICE_CONFIG"]["valueFrom"]["configMapKeyRef"] == {"name": "disagg-config", "key": "config.json"}
    config = json.loads(by_kind(files, "ConfigMap")["disagg-config"]["data"]["config.json"])
    assert config["Frontend"]["router-mode"] == "kv" and config["Frontend"]["host"] == "0.0.0.0"
    assert config["Worker"]["disaggregation-mode"] == "decode"
    assert config["Worker"]["ServiceArgs"]["workers"] == 3  # the command line reached the config too
    frontend = deployments["disagg-frontend"]["spec"]["template"]["spec"]["containers"][0]
    assert frontend["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert services["disagg-frontend"]["spec"]["ports"][0]["port"] == 8000
    assert services["disagg-worker"]["spec"]["clusterIP"] == "None"  # no port: headless


def test_the_schema_check_rejects_what_the_api_server_would(tmp_path):
    _, files = build(tmp_path, "graphs.agg:Frontend", "-f", "configs/agg.yaml", "--image", "x")
    deployment = by_kind(files, "Deployment")["agg-worker"]
    validate(deployment)
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["replicas"] = "1"
    with pytest.raises(ValueError, match="replicas"):
        validate(bad)
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["workdir"] = "/x"
    with pytest.raises(ValueError, match="workdir"):
        validate(bad)


def test_hello_world_api_service_gets_its_port_and_a_named_graph(tmp_path):
    p, files = build(tmp_path, "hello_world:Frontend", "-f", "config.yaml", "--image", "reg/hello:2", "--name", "Hello",
                     cwd=HELLO)
    assert p.returncode == 0, p.stderr
    for docs in files.values():
        for doc in docs:
            validate(doc)
    services = by_kind(files, "Service")
    assert services["hello-frontend"]["spec"]["ports"][0]["port"] == 3000
    assert "ports" not in services["hello-backend"]["spec"]
    assert "wrote " in p.stdout and "Deployment hello-backend" in p.stdout


@pytest.mark.parametrize("args,message", [
    (["graphs.agg:Frontend", "-f", "configs/agg.yaml"], "error: service Worker has no image"),
    (["graphs.agg:Frontend", "--image", "x", "--Worker.ServiceArgs.resources.tpu=2"],
     "error: Worker.ServiceArgs.resources: unknown key(s) tpu"),
    (["graphs.agg:Frontend", "--image", "x", "--Worker.ServiceArgs.workers=0"],
     "error: Worker.ServiceArgs.workers must be an integer >= 1, not 0"),
])
def test_what_cannot_be_built_is_one_line_and_nothing_written(tmp_path, args, message):
    p, files = build(tmp_path, *args)
    assert p.returncode == 2
    assert p.stderr.startswith(message) and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert files == {}


def test_without_kubernetes_it_says_what_it_builds(tmp_path):
    p = subprocess.run(BUILD + ["graphs.agg:Frontend"], cwd=LLM, capture_output=True, text=True, env=cli_env(),
                       timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: dynamo build writes Kubernetes manifests only: give "
                                             "--kubernetes DIR (container images are not built here; name one with "
                                             "--image)"]
