"""The command line: in=/out= anywhere, known flags only, defaults and combination rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.cli.flags import parse_args
from dynamo.errors import UserError


def parse(*argv: str, tty: bool = False):
    return parse_args(list(argv), stdin_is_tty=tty)


def test_defaults():
    cfg = parse("out=echo_full")
    assert cfg.input == "stdin"  # not a terminal
    assert cfg.http_port == 8080
    assert cfg.http_host == "0.0.0.0"
    assert cfg.router_mode == "round-robin"
    assert cfg.kv_overlap_score_weight is None  # the workers' engine suggests one, else 2.0 (docs/routing.md)
    assert cfg.router_temperature == 0.0
    assert cfg.use_kv_events is True
    assert cfg.migration_limit == 0
    assert cfg.tensor_parallel_size == 1
    assert (cfg.num_nodes, cfg.node_rank, cfg.base_gpu_id) == (1, 0, 0)
    assert cfg.verbosity == 0
    assert cfg.model is None
    assert cfg.context_length is None and cfg.kv_cache_block_size is None


def test_default_input_is_text_on_a_terminal():
    assert parse("out=echo_full", tty=True).input == "text"


def test_in_and_out_are_accepted_anywhere():
    a = parse("in=http", "out=echo_core", "/models/x", "--http-port", "9000")
    b = parse("/models/x", "--http-port=9000", "out=echo_core", "in=http")
    c = parse("--http-port", "9000", "in=http", "/models/x", "out=echo_core")
    for cfg in (a, b, c):
        assert (cfg.input, cfg.output, cfg.model, cfg.http_port) == ("http", "echo_core", "/models/x", 9000)


def test_model_path_flag_and_positional():
    assert parse("out=echo_core", "--model-path", "/m").model == "/m"
    assert parse("out=echo_core", "/m", "--model-path", "/m").model == "/m"
    with pytest.raises(UserError, match="given twice"):
        parse("out=echo_core", "/a", "--model-path", "/b")


def test_every_flag_of_the_usage_line_parses(tmp_path: Path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"a": 1}))
    cfg = parse(
        "in=http", "out=echo_full", "--http-port", "1234", "--http-host", "127.0.0.1",
        "--model-name", "served", "--model-config", "/cfg", "--context-length", "512",
        "--kv-cache-block-size", "32", "--tensor-parallel-size", "2", "--num-nodes", "2",
        "--node-rank", "1", "--leader-addr", "10.0.0.1:9876", "--base-gpu-id", "3",
        "--extra-engine-args", str(args), "--router-mode", "kv", "--kv-overlap-score-weight", "2.5",
        "--router-temperature", "0.3", "--use-kv-events", "false", "--router-replica-sync", "false", "--migration-limit", "3", "-vv",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
    )
    assert cfg.http_port == 1234 and cfg.http_host == "127.0.0.1"
    assert cfg.model_name == "served" and cfg.model_config == "/cfg"
    assert cfg.context_length == 512 and cfg.kv_cache_block_size == 32
    assert (cfg.tensor_parallel_size, cfg.num_nodes, cfg.node_rank) == (2, 2, 1)
    assert cfg.leader_addr == "10.0.0.1:9876" and cfg.base_gpu_id == 3
    assert cfg.extra_engine_args == args
    assert cfg.router_mode == "kv" and cfg.kv_overlap_score_weight == 2.5
    assert cfg.router_temperature == 0.3 and cfg.use_kv_events is False and cfg.router_replica_sync is False
    assert cfg.migration_limit == 3 and cfg.verbosity == 2
    assert cfg.tool_call_parser == "hermes" and cfg.reasoning_parser == "qwen3"


def test_verbosity_is_honoured_with_in_and_out():
    assert parse("in=http", "out=echo_full", "-v").verbosity == 1
    assert parse("-v", "-v", "in=http", "out=echo_full").verbosity == 2


def test_too_much_verbosity():
    with pytest.raises(UserError, match="verbosity"):
        parse("out=echo_full", "-vvv")


def test_unknown_flag_is_an_error():
    with pytest.raises(UserError, match="unrecognized arguments: --bogus"):
        parse("out=echo_full", "--bogus")


def test_abbreviated_flags_are_not_guessed():
    with pytest.raises(UserError):
        parse("out=echo_full", "--http-p", "80")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["in=bogus"], "Invalid in= option 'bogus'"),
        (["out=bogus"], "Invalid out= option 'bogus'"),
        (["in=batch:"], "needs a file"),
        (["out=pystr:"], "needs a Python file"),
        (["in=http", "in=text"], "in= given twice"),
        (["out=echo_full", "out=echo_core"], "out= given twice"),
        (["--http-port", "70000"], "--http-port"),
        (["--http-port", "abc"], "--http-port"),
        (["--context-length", "0"], "--context-length"),
        (["--migration-limit", "2000"], "--migration-limit"),
        (["--router-mode", "fastest"], "invalid choice"),
        (["--use-kv-events", "maybe"], "true or false"),
        (["--router-replica-sync", "maybe"], "true or false"),
        (["--kv-overlap-score-weight", "-1"], "at least 0"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--tool-call-parser", "xml"], "--tool-call-parser 'xml' is not a known parser. Valid: auto, none, hermes"),
        (["--reasoning-parser", "o1"], "--reasoning-parser 'o1' is not a known parser"),
    ],
)
def test_bad_values(argv, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        parse(*argv)


def test_errors_point_to_help():
    with pytest.raises(UserError, match="--help"):
        parse("--bogus")


@pytest.mark.parametrize("flag", [["--context-length", "100"], ["--kv-cache-block-size", "8"],
                                  ["--tool-call-parser", "hermes"], ["--reasoning-parser", "none"]])
def test_worker_only_flags_are_rejected_on_a_frontend(flag):
    with pytest.raises(UserError, match="only be used on the worker"):
        parse("in=http", "out=dyn", *flag)


def test_migration_limit_and_queue_on_a_frontend():
    cfg = parse("in=http", "out=dyn", "--migration-limit", "2", "--queue-size", "8", "--queue-timeout", "1.5",
                "--max-inflight", "100")
    assert (cfg.migration_limit, cfg.queue_size, cfg.queue_timeout, cfg.max_inflight) == (2, 8, 1.5, 100)
    cfg = parse("in=http", "out=dyn")
    assert (cfg.queue_size, cfg.queue_timeout, cfg.max_inflight) == (256, 30.0, None)


@pytest.mark.parametrize("argv, message", [
    (["in=http", "out=echo_full", "--queue-size", "4"], "out=dyn"),
    (["in=http", "out=echo_full", "--queue-timeout", "4"], "out=dyn"),
    (["in=text", "out=echo_full", "--max-inflight", "4"], "in=http"),
    (["in=http", "out=dyn", "--max-inflight", "0"], "--max-inflight must be at least 1"),
    (["in=http", "out=dyn", "--queue-timeout", "-1"], "--queue-timeout must be at least 0"),
])
def test_overload_flags_where_they_apply(argv, message):
    with pytest.raises(UserError, match=message):
        parse(*argv)


def test_drain_timeout_is_a_worker_flag():
    assert parse("in=dyn://ns.backend.generate", "out=echo_core", "--drain-timeout", "2.5").drain_timeout == 2.5
    assert parse("in=dyn://ns.backend.generate", "out=echo_core").drain_timeout is None  # the env's default
    with pytest.raises(UserError, match="--drain-timeout applies to a worker"):
        parse("in=http", "out=dyn", "--drain-timeout", "5")
    with pytest.raises(UserError, match="--drain-timeout must be at least 0"):
        parse("in=dyn://ns.backend.generate", "out=echo_core", "--drain-timeout", "-1")


def test_out_auto_is_dyn():
    assert parse("in=http", "out=auto").output == "dyn"


def test_llama_cpp_alias():
    assert parse("out=llama_cpp").output == "llamacpp"


def test_endpoint_on_both_sides_is_rejected():
    with pytest.raises(UserError, match="Cannot use endpoint for both in and out"):
        parse("in=dyn://a.b.c", "out=dyn")


def test_mocker_needs_an_endpoint_input():
    with pytest.raises(UserError, match="in=dyn://"):
        parse("in=http", "out=mocker")
    assert parse("in=dyn://ns.mock.generate", "out=mocker").engine == "mocker"


def test_multi_node_rules():
    with pytest.raises(UserError, match="--node-rank 2 must be less than --num-nodes 2"):
        parse("out=echo_full", "--num-nodes", "2", "--node-rank", "2", "--leader-addr", "h:1")
    with pytest.raises(UserError, match="--leader-addr"):
        parse("out=echo_full", "--num-nodes", "2")


def test_extra_engine_args_must_exist_and_be_json(tmp_path: Path):
    with pytest.raises(UserError, match="no such file"):
        parse("out=echo_full", "--extra-engine-args", str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        parse("out=echo_full", "--extra-engine-args", str(bad))


def test_batch_input_must_be_an_existing_file(tmp_path: Path):
    with pytest.raises(UserError, match="Missing or not a file"):
        parse(f"in=batch:{tmp_path / 'nope.jsonl'}", "out=echo_full")
    with pytest.raises(UserError, match="Missing or not a file"):
        parse(f"in=batch:{tmp_path}", "out=echo_full")  # a folder is not a file
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "x"}\n')
    cfg = parse(f"in=batch:{f}", "out=echo_full")
    assert cfg.input_kind == "batch"


def test_python_engine_file_must_exist(tmp_path: Path):
    with pytest.raises(UserError, match="no such Python file"):
        parse(f"out=pystr:{tmp_path / 'nope.py'}")


def test_arguments_after_double_dash_are_kept_for_the_engine():
    cfg = parse("out=echo_full", "--", "--some-engine-flag", "x")
    assert cfg.extra_args == ["--some-engine-flag", "x"]


def test_endpoint_input():
    cfg = parse("in=dyn://ns.comp.ep", "out=echo_full")
    assert cfg.input_kind == "endpoint"
    assert cfg.input == "dyn://ns.comp.ep"


def test_disaggregation_flags():
    cfg = parse("in=dyn://ns.prefill.generate", "out=mocker", "m", "--disaggregation-mode", "prefill")
    assert cfg.disaggregation_mode == "prefill"
    assert parse("in=http", "out=dyn", "--max-local-prefill-length", "0").max_local_prefill_length == 0
    assert parse("in=http", "out=echo_full").disaggregation_mode == "agg"


@pytest.mark.parametrize("argv,message", [
    (["in=http", "out=mocker", "--disaggregation-mode", "decode"], "is for workers"),
    (["in=dyn://a.b.c", "out=echo_core", "--disaggregation-mode", "prefill"], "cannot hand KV state"),
    (["--disaggregation-mode", "both"], "invalid choice"),
    (["in=dyn://a.b.c", "out=mocker", "--max-local-prefill-length", "10"], "frontend flag"),
    (["in=http", "out=dyn", "--max-local-prefill-length", "-1"], "--max-local-prefill-length"),
])
def test_disaggregation_flag_errors(argv, message):
    with pytest.raises(UserError, match=message):
        parse(*argv)


def test_namespace_is_a_frontend_flag():
    assert parse("in=http", "out=dyn", "--namespace", "dynamo").namespace == "dynamo"
    assert parse("in=http", "out=dyn").namespace is None
    with pytest.raises(UserError, match="'--namespace' is a frontend flag"):
        parse("in=dyn://a.b.c", "out=mocker", "--namespace", "a")
    with pytest.raises(UserError, match="letters, digits"):
        parse("in=http", "out=dyn", "--namespace", "a/b")


def test_distributed_runtime_flags():
    cfg = parse("in=dyn://ns.comp.ep", "out=echo_full", "--discovery-backend", "kv_store", "--request-plane", "tcp",
                "--event-plane", "zmq")
    assert (cfg.discovery_backend, cfg.request_plane, cfg.event_plane) == ("etcd", "tcp", "zmq")
    cfg = parse("in=http", "out=dyn")
    assert (cfg.discovery_backend, cfg.request_plane, cfg.event_plane) == (None, None, None)  # the rule decides


@pytest.mark.parametrize("flag,value", [("--discovery-backend", "file"), ("--request-plane", "tcp"),
                                        ("--event-plane", "zmq")])
def test_distributed_runtime_flags_need_the_distributed_runtime(flag, value):
    with pytest.raises(UserError, match=f"{flag} is for the distributed runtime"):
        parse("in=http", "out=echo_full", flag, value)
