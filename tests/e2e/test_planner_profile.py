"""``dynamo-planner profile`` (``python -m dynamo.planner.profiler``) against a mocker worker: a short
sweep through a real frontend on real etcd and NATS writes curves the planner can read back."""

from __future__ import annotations

import sys
from typing import Iterator

import pytest

from dynamo.planner.profile_data import WorkerProfile
from harness.fleet import mocker_worker_cmd
from harness.proc import run_cli
from harness.servers import EtcdServer, NatsServer

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}


def profile(args: list[str], env: dict[str, str], timeout: float = 150):
    return run_cli(["-m", "dynamo.planner.profiler", *args], env=env, timeout=timeout, program="python")


@pytest.fixture(autouse=True)
def _python_program(monkeypatch):
    import harness.proc as proc

    real = proc.cli_command
    monkeypatch.setattr(proc, "cli_command", lambda name="dynamo-run": [sys.executable] if name == "python"
                        else real(name))


def test_a_short_sweep_writes_curves_the_planner_reads(env, tiny_model, tmp_path):
    worker = mocker_worker_cmd(tmp_path, tiny_model, "prof.backend.generate", "profiled",
                               {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 2.0})
    out = tmp_path / "prof"
    r = profile(["--worker-cmd", worker, "--out", str(out), "--isl", "64,1024", "--concurrency", "1,8",
                 "--decode-isl", "256", "--osl", "16", "--prefill-requests", "2", "--decode-rounds", "1"], env)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "worker serves profiled after" in r.stdout
    p = WorkerProfile.load(out)
    assert [q.isl for q in p.prefill] == [64, 1024] and [q.concurrency for q in p.decode] == [1, 8]
    # the mocker's simulated GPU: a longer prompt takes longer, more streams decode slower per token but
    # faster in all, and fill more of the KV cache
    assert p.prefill[1].ttft_ms > p.prefill[0].ttft_ms
    assert p.decode[1].itl_ms > p.decode[0].itl_ms
    assert p.decode[1].decode_tok_s > p.decode[0].decode_tok_s
    assert 0 <= p.decode[0].kv_usage < p.decode[1].kv_usage <= 1
    assert 0 < p.load_time_s < 60
    assert p.worker_cmd == worker and p.notes["model"] == "profiled"
    assert (out / "logs" / "worker.log").exists()
    # the worker was stopped with SIGTERM and drained: its log ends with the drain, not a traceback
    assert "Traceback" not in (out / "logs" / "worker.log").read_text()


def test_a_worker_that_cannot_start_is_one_line(env, tmp_path):
    r = profile(["--worker-cmd", f"{sys.executable} -m dynamo.cli in=dyn://prof.backend.generate out=mocker "
                 f"{tmp_path / 'no-such-model'}", "--out", str(tmp_path / "p")], env, timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynamo-planner profile: the worker exited with status"), r.stderr
    assert not (tmp_path / "p" / "profile.json").exists()


def test_bad_flags_are_refused(env, tmp_path):
    r = profile(["--worker-cmd", "x", "--out", str(tmp_path), "--isl", "0,12"], env, timeout=30)
    assert r.returncode == 2 and "positive integers" in r.stderr
