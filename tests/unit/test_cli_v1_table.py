"""docs/cli-1x.md's table of every Dynamo 1.x flag, held to the parsers of the 1.x entry points (cli/v1).

Each row says what a flag becomes (``same``, ``mapped: ...``, ``only A / B``, ``refused``) and gives an example
value; each row is checked here, given as the flag and as its variable, and every flag of every parser must
have a row (and every row a flag), so the table and the code cannot drift.  The flag beating its variable is
checked at the end.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from dynamo.cli.v1 import frontend, llama_cpp, mistralrs, mocker, router, sglang, trtllm, vllm
from dynamo.cli.v1.common import Spec
from dynamo.errors import UserError

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli-1x.md"
SPECS = {"frontend": frontend.spec, "mocker": mocker.spec, "router": router.spec,
         "llama_cpp": llama_cpp.MODULE.spec, "vllm": vllm.MODULE.spec, "sglang": sglang.MODULE.spec,
         "trtllm": trtllm.MODULE.spec, "mistralrs": mistralrs.MODULE.spec}


class Row(NamedTuple):
    module: str
    flag: str
    variable: str | None
    ours: str
    example: str | None

    def __str__(self) -> str:
        return f"{self.module}:{self.flag}"


def unquote(cell: str) -> str | None:
    cell = cell.strip()
    return None if cell == "—" else cell.strip("`")


def table_rows() -> list[Row]:
    rows: list[Row] = []
    module = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"### python -m dynamo\.(\w+)$", line)
        if heading:
            module = heading.group(1)
            continue
        if module is None or not line.startswith("| `"):
            continue
        cells = [c for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 5, line
        flag, variable, _default, ours, example = cells
        rows.append(Row(module, unquote(flag) or "", unquote(variable), ours.strip(), unquote(example)))
    return rows


ROWS = table_rows()
SPEC_CACHE: dict[str, Spec] = {}


def spec_of(module: str) -> Spec:
    if module not in SPEC_CACHE:
        SPEC_CACHE[module] = SPECS[module]()
    return SPEC_CACHE[module]


def value(text: str, tmp_path: Path) -> str:
    if text == "FILE":
        path = tmp_path / "file.pem"
        path.write_text("x")
        return str(path)
    if text == "MODEL":
        return str(tmp_path)
    return text


def argv_for(row: Row, text: str | None, tmp_path: Path) -> list[str]:
    return [row.flag] if text is None else [row.flag, value(text, tmp_path)]


def parse(row: Row, argv: list[str], env: dict[str, str] | None = None) -> Any:
    return spec_of(row.module).parse(argv, env or {})


def only_values(row: Row) -> list[str]:
    listed = row.ours.removeprefix("only ").split(";")[0]
    return [v.strip() for v in listed.split(" / ")]


def test_the_table_is_read():
    assert len(ROWS) > 500
    assert {r.module for r in ROWS} == set(SPECS)
    statuses = {r.ours.split(":")[0].split(" ")[0] for r in ROWS}
    assert statuses == {"same", "mapped", "only", "refused"}, statuses


@pytest.mark.parametrize("module", sorted(SPECS))
def test_every_flag_of_the_parser_has_a_row_and_every_row_a_flag(module: str):
    parser = spec_of(module).parser
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help", "--version"}
    rows = {r.flag for r in ROWS if r.module == module}
    assert flags - rows == set(), "flags without a row in docs/cli-1x.md"
    assert rows - flags == set(), "rows of docs/cli-1x.md without a flag"


@pytest.mark.parametrize("row", ROWS, ids=str)
def test_each_flag_is_taken_or_refused_as_the_table_says(row: Row, tmp_path: Path):
    argv = argv_for(row, row.example, tmp_path)
    if row.ours == "refused":
        with pytest.raises(UserError) as e:
            parse(row, argv)
        assert row.flag in str(e.value) and "\n" not in str(e.value)
    elif row.ours.startswith("only "):
        with pytest.raises(UserError) as e:
            parse(row, argv)
        assert row.flag in str(e.value) and "not implemented here" in str(e.value)
        for good in only_values(row):
            parse(row, argv_for(row, good, tmp_path))
    else:
        parse(row, argv)


@pytest.mark.parametrize("row", [r for r in ROWS if r.variable], ids=str)
def test_each_variable_is_taken_or_refused_as_its_flag(row: Row, tmp_path: Path):
    var = row.variable
    assert var is not None
    given = "true" if row.example is None else value(row.example, tmp_path)
    if row.ours == "refused":
        with pytest.raises(UserError) as e:
            parse(row, [], {var: given})
        assert var in str(e.value)
    elif row.ours.startswith("only "):
        with pytest.raises(UserError) as e:
            parse(row, [], {var: given})
        assert var in str(e.value)
        parse(row, [], {var: only_values(row)[0]})
    else:
        parse(row, [], {var: given})


def test_a_flag_wins_over_its_variable():
    cfg, _ = frontend.build(["--http-port", "9001"], {"DYN_HTTP_PORT": "9002"})
    assert cfg.http_port == 9001
    cfg, _ = frontend.build([], {"DYN_HTTP_PORT": "9002"})
    assert cfg.http_port == 9002
    cfg, _ = frontend.build(["--router-kv-events"], {"DYN_ROUTER_USE_KV_EVENTS": "false"})
    assert cfg.use_kv_events is True
    cfg, _ = frontend.build([], {"DYN_ROUTER_USE_KV_EVENTS": "false"})
    assert cfg.use_kv_events is False
    cfg, _ = frontend.build(["--router-mode", "kv"], {"DYN_ROUTER_MODE": "random"})
    assert cfg.router_mode == "kv"
    # a refused value in the variable does not matter once the flag says one we take
    cfg, _ = frontend.build(["--router-mode", "kv"], {"DYN_ROUTER_MODE": "direct"})
    assert cfg.router_mode == "kv"


def test_the_frontend_maps_onto_dynamo_runs_frontend():
    cfg, env = frontend.build(["--router-mode", "kv", "--namespace", "ns1", "--migration-limit", "3",
                               "--kv-overlap-score-weight", "1.5", "--no-router-replica-sync",
                               "--metrics-prefix", "fe1", "--discovery-backend", "file"], {})
    assert (cfg.input, cfg.output, cfg.http_port, cfg.http_host) == ("http", "dyn", 8000, "0.0.0.0")
    assert (cfg.router_mode, cfg.namespace, cfg.migration_limit, cfg.kv_overlap_score_weight) == ("kv", "ns1", 3, 1.5)
    assert cfg.router_replica_sync is False and cfg.discovery_backend == "file"
    assert env == {"DYN_METRICS_PREFIX": "fe1"}
    cfg, _ = frontend.build(["-i"], {})
    assert (cfg.input, cfg.output) == ("text", "dyn")
    with pytest.raises(UserError, match="go together"):
        frontend.build(["--tls-cert-path", "c.pem"], {})


def test_the_mocker_maps_its_flags_onto_mocker_arguments(tmp_path: Path):
    extra = tmp_path / "extra.json"
    extra.write_text('{"max_num_seqs": 7}')
    cfg, _ = mocker.build(["--model-path", str(tmp_path), "--block-size", "32", "--max-num-seqs", "9",
                           "--extra-engine-args", str(extra), "--num-workers", "3", "--speedup-ratio", "0",
                           "--is-prefill-worker"], {"DYN_NAMESPACE": "ns2"})
    assert cfg.input == "dyn://ns2.prefill.generate" and cfg.disaggregation_mode == "prefill"
    assert (cfg.output, cfg.num_workers, cfg.kv_cache_block_size) == ("mocker", 3, 32)
    import json

    assert cfg.extra_engine_args is not None
    args = json.loads(cfg.extra_engine_args.read_text())
    assert args["max_num_seqs"] == 7 and args["block_size"] == 32 and args["speedup_ratio"] == mocker.NO_DELAY_RATIO
    bad = tmp_path / "bad.json"
    bad.write_text('{"no_such_key": 1}')
    with pytest.raises(UserError, match="no_such_key"):
        mocker.build(["--model-path", str(tmp_path), "--extra-engine-args", str(bad)], {})


def test_workers_map_onto_the_worker_role(tmp_path: Path):
    cfg, _ = llama_cpp.MODULE.build(["--model-path", "m.gguf", "--namespace", "ns3", "--context-length", "512",
                                     "--dyn-tool-call-parser", "hermes", "--engine-request-limit", "4"], {})
    assert (cfg.input, cfg.output, cfg.model, cfg.context_length) == ("dyn://ns3.backend.generate", "llamacpp",
                                                                      "m.gguf", 512)
    assert cfg.tool_call_parser == "hermes" and cfg.max_inflight == 4
    cfg, _ = vllm.MODULE.build(["--model", "M", "--endpoint", "dyn://a.b.c", "--block-size", "32",
                                "--max-model-len", "4096"], {})
    assert (cfg.input, cfg.output, cfg.kv_cache_block_size, cfg.context_length) == ("dyn://a.b.c", "vllm", 32, 4096)
    try:
        import vllm as _vllm  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="need vLLM installed"):
            vllm.MODULE.build(["--model", "M", "--enforce-eager"], {})
    with pytest.raises(UserError, match="unrecognized arguments"):
        llama_cpp.MODULE.build(["--model-path", "m.gguf", "--enforce-eager"], {})


def test_an_engines_own_flags_become_the_engine_arguments_that_differ_from_its_defaults():
    """What ``python -m dynamo.vllm`` / ``dynamo.sglang`` do with the engine's parser (vLLM's and SGLang's are
    argparse parsers): only what the command line changes goes to our engine, our engine's choices stand
    for the rest."""
    import argparse

    from dynamo.cli.v1.worker import engine_flag_diff

    engine = argparse.ArgumentParser(prog="engine")
    engine.add_argument("--model", default="default/model")
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--kv-events-config", type=str, default=None)
    got = engine_flag_diff(engine, "--model", "M", ["--enforce-eager", "--gpu-memory-utilization", "0.9",
                                                    "--kv-events-config", '{"enable_kv_cache_events": false}'])
    assert got == {"enforce_eager": True, "kv_events_config": '{"enable_kv_cache_events": false}'}
