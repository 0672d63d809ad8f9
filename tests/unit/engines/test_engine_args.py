"""Argument mapping and request/response conversion of the vLLM, SGLang and TensorRT-LLM engines.

These run without any of the three packages: the conversions are pure functions, and the engines'
outputs are imitated with objects shaped like theirs (vLLM ``RequestOutput``/``CompletionOutput``,
SGLang's streamed dicts, TensorRT-LLM ``GenerationResult``/``CompletionOutput``).  Where vLLM is
importable (the vLLM tier's virtualenv) the mapped arguments are also fed to vLLM's real types.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynamo.cli.flags import parse_args
from dynamo.engines import sglang as sg
from dynamo.engines import trtllm as trt
from dynamo.engines.registry import create_engine, engine_installed
from dynamo.engines.vllm import engine as vl
from dynamo.errors import UserError
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import (
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.run_config import RunConfig
from harness.proc import run_cli


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "Llama-Tiny"
    d.mkdir()
    return d


def card_for(folder: Path, **kw) -> ModelCard:
    return ModelCard(display_name="tiny", path=folder, eos_token_ids=[2, 0], **kw)


def request(**kw) -> PreprocessedRequest:
    sc = kw.pop("stop_conditions", StopConditions(max_tokens=8))
    so = kw.pop("sampling_options", SamplingOptions())
    oo = kw.pop("output_options", OutputOptions())
    return PreprocessedRequest(token_ids=[1, 5, 6], stop_conditions=sc, sampling_options=so, output_options=oo,
                               eos_token_ids=kw.pop("eos_token_ids", [2, 0]), **kw)


FULL_SAMPLING = SamplingOptions(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=42, presence_penalty=0.5,
                                frequency_penalty=0.25, repetition_penalty=1.1)


# -- vLLM ---------------------------------------------------------------------------------------------

class TestVllmEngineArgs:
    def test_flags_map_onto_engine_args(self, folder: Path) -> None:
        cfg = RunConfig(output="vllm", context_length=1024, kv_cache_block_size=32, tensor_parallel_size=2)
        args = vl.engine_args(cfg, card_for(folder), cpu=True)
        assert args == {"model": str(folder), "max_model_len": 1024, "block_size": 32, "tensor_parallel_size": 2,
                        "enforce_eager": True, "disable_log_stats": True}

    def test_defaults_leave_vllm_its_own(self, folder: Path) -> None:
        args = vl.engine_args(RunConfig(output="vllm"), card_for(folder), cpu=False)
        assert args == {"model": str(folder), "tensor_parallel_size": 1, "disable_log_stats": True}

    def test_extra_engine_args_win_over_flags(self, folder: Path) -> None:
        cfg = RunConfig(output="vllm", context_length=1024)
        extra = {"max_model_len": 512, "enforce_eager": False, "dtype": "half", "trust_remote_code": True}
        args = vl.engine_args(cfg, card_for(folder), extra, cpu=True)
        assert args["max_model_len"] == 512 and args["enforce_eager"] is False
        assert args["dtype"] == "half" and args["trust_remote_code"] is True

    def test_embedding_uses_the_pooling_runner(self, folder: Path) -> None:
        args = vl.engine_args(RunConfig(output="vllm", embedding=True), card_for(folder), pooling=True)
        assert args["runner"] == "pooling" and "convert" not in args  # vLLM converts a generative model itself
        args = vl.engine_args(RunConfig(output="vllm"), card_for(folder), {"convert": "embed"}, pooling=True)
        assert args["convert"] == "embed"
        assert "runner" not in vl.engine_args(RunConfig(output="vllm"), card_for(folder))

    def test_gguf_with_model_config_folder(self, folder: Path, tmp_path: Path) -> None:
        gguf = tmp_path / "m.gguf"
        card = card_for(folder, gguf_path=gguf)
        args = vl.engine_args(RunConfig(output="vllm"), card)
        assert args["model"] == str(gguf) and args["tokenizer"] == str(folder)

    def test_multi_node_uses_the_multiprocessing_backend(self, folder: Path) -> None:
        cfg = RunConfig(output="vllm", tensor_parallel_size=16, num_nodes=2, node_rank=1,
                        leader_addr="10.0.0.5:5000")
        args = vl.engine_args(cfg, card_for(folder))
        assert {k: args[k] for k in ("nnodes", "node_rank", "master_addr", "master_port",
                                     "distributed_executor_backend", "tensor_parallel_size")} == {
            "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.5", "master_port": 5000,
            "distributed_executor_backend": "mp", "tensor_parallel_size": 16}

    def test_single_node_sets_no_distributed_arguments(self, folder: Path) -> None:
        args = vl.engine_args(RunConfig(output="vllm", leader_addr="10.0.0.5:5000"), card_for(folder))
        assert not {"nnodes", "node_rank", "master_addr", "distributed_executor_backend"} & set(args)

    def test_ray_can_be_chosen_through_extra_args(self, folder: Path) -> None:
        cfg = RunConfig(output="vllm", num_nodes=2, leader_addr="h:1")
        args = vl.engine_args(cfg, card_for(folder), {"distributed_executor_backend": "ray"})
        assert args["distributed_executor_backend"] == "ray"

    @pytest.mark.parametrize("addr, expected", [
        ("10.0.0.5:5000", ("10.0.0.5", 5000)),
        ("leader", ("leader", vl.DEFAULT_MASTER_PORT)),
        ("[fe80::1]:7000", ("fe80::1", 7000)),
    ])
    def test_split_host_port(self, addr: str, expected: tuple[str, int]) -> None:
        assert vl.split_host_port(addr, vl.DEFAULT_MASTER_PORT) == expected

    @pytest.mark.parametrize("addr", [":5000", "host:port", "host:70000"])
    def test_bad_leader_addr(self, addr: str) -> None:
        with pytest.raises(UserError, match="--leader-addr"):
            vl.split_host_port(addr, 1)

    def test_model_is_required(self) -> None:
        with pytest.raises(UserError, match="needs a model"):
            vl.engine_args(RunConfig(output="vllm"), ModelCard(display_name="x"))


class TestGpuSelection:
    def test_base_zero_changes_nothing(self) -> None:
        assert vl.cuda_visible_devices(0, 4, None) is None
        assert trt.cuda_visible_devices(0, 4, "3") is None

    def test_base_offsets_the_gpu_ids(self) -> None:
        assert vl.cuda_visible_devices(4, 4, None) == "4,5,6,7"
        assert trt.cuda_visible_devices(2, 1, "") == "2"

    def test_base_indexes_an_existing_list(self) -> None:
        assert vl.cuda_visible_devices(1, 2, "4,5,6,7") == "5,6"

    def test_too_few_gpus(self) -> None:
        with pytest.raises(UserError, match="--base-gpu-id"):
            vl.cuda_visible_devices(3, 2, "0,1,2,3")

    def test_gpus_per_node(self) -> None:
        assert vl.gpus_per_node(16, 2) == 8 and vl.gpus_per_node(3, 2) == 2 and vl.gpus_per_node(1, 1) == 1


class TestVllmEnvironment:
    def test_cpu_defaults(self) -> None:
        env = vl.env_defaults({}, cpu=True)
        assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
                       "DO_NOT_TRACK": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}

    def test_set_variables_are_kept(self) -> None:
        env = vl.env_defaults({"VLLM_CPU_KVCACHE_SPACE": "4", "DO_NOT_TRACK": "0"}, cpu=True)
        assert "VLLM_CPU_KVCACHE_SPACE" not in env and "DO_NOT_TRACK" not in env

    def test_gpu_machine_gets_no_cpu_defaults(self) -> None:
        env = vl.env_defaults({}, cpu=False, verbosity=1)
        assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_HOST_IP" not in env
        assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"


class TestVllmSampling:
    def test_everything_maps(self) -> None:
        so = FULL_SAMPLING
        req = request(stop_conditions=StopConditions(max_tokens=16, min_tokens=2, stop=["END"],
                                                     stop_token_ids_hidden=[7, 2]),
                      sampling_options=so, output_options=OutputOptions(logprobs=3))
        assert vl.sampling_params(req) == {
            "detokenize": False, "max_tokens": 16, "min_tokens": 2, "stop_token_ids": [2, 0, 7],
            "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 42, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logprobs": 3}

    def test_stop_strings_stay_with_our_post_processor(self) -> None:
        req = request(stop_conditions=StopConditions(max_tokens=4, stop=["a", "b"]))
        assert "stop" not in vl.sampling_params(req)

    def test_ignore_eos_drops_eos_but_keeps_stop_tokens(self) -> None:
        req = request(stop_conditions=StopConditions(max_tokens=8, ignore_eos=True, stop_token_ids_hidden=[9]),
                      eos_token_ids=[2])
        params = vl.sampling_params(req)
        assert params["ignore_eos"] is True and params["stop_token_ids"] == [9]

    def test_no_max_tokens_means_up_to_the_context(self) -> None:
        assert vl.sampling_params(request(stop_conditions=StopConditions()))["max_tokens"] is None

    def test_top_k_disabled(self) -> None:
        assert vl.sampling_params(request(sampling_options=SamplingOptions(top_k=-1)))["top_k"] == 0

    def test_n_above_one_is_refused(self) -> None:
        with pytest.raises(UserError, match="n > 1"):
            vl.sampling_params(request(sampling_options=SamplingOptions(n=2)))

    def test_logit_bias(self) -> None:
        req = request(sampling_options=SamplingOptions(logit_bias={"42": 5.0, "7": -100.0}))
        assert vl.sampling_params(req)["logit_bias"] == {42: 5.0, 7: -100.0}

    def test_guided_decoding(self) -> None:
        req = request(sampling_options=SamplingOptions(guided_decoding={"json": {"type": "object"},
                                                                        "backend": "xgrammar"}))
        assert vl.sampling_params(req)["structured_outputs"] == {"json": {"type": "object"}}

    @pytest.mark.vllm
    def test_real_vllm_types_accept_the_mapping(self, folder: Path) -> None:
        vllm = pytest.importorskip("vllm")
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        so = SamplingOptions(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=42,
                             guided_decoding={"regex": "[ab]+"})
        req = request(stop_conditions=StopConditions(max_tokens=16, min_tokens=2, stop_token_ids_hidden=[7]),
                      sampling_options=so, output_options=OutputOptions(logprobs=2))
        kwargs = vl.sampling_params(req)
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        params = vllm.SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
        assert params.max_tokens == 16 and params.min_tokens == 2 and params.stop_token_ids == [2, 0, 7]
        assert params.detokenize is False and params.top_k == 40 and params.logprobs == 2
        cfg = RunConfig(output="vllm", context_length=256, kv_cache_block_size=16, num_nodes=2, node_rank=0,
                        leader_addr="127.0.0.1:29600")
        args = vllm.AsyncEngineArgs(**vl.engine_args(cfg, card_for(folder), {"dtype": "float32"}, cpu=True))
        assert (args.max_model_len, args.block_size, args.nnodes, args.master_port) == (256, 16, 2, 29600)
        with pytest.raises(TypeError):
            vllm.AsyncEngineArgs(**vl.engine_args(cfg, card_for(folder), {"no_such_argument": 1}))


def vllm_output(ids, reason=None, stop_reason=None, finished=None, logprobs=None, cum=None):
    choice = SimpleNamespace(index=0, text="", token_ids=ids, finish_reason=reason, stop_reason=stop_reason,
                             logprobs=logprobs, cumulative_logprob=cum)
    return SimpleNamespace(request_id="r", outputs=[choice], finished=reason is not None if finished is None else finished)


class TestVllmOutput:
    @pytest.mark.parametrize("reason, stop_reason, expected", [
        (None, None, None),
        ("stop", None, "eos"),       # the model's EOS
        ("stop", 2, "eos"),          # one of our EOS ids, given as a stop token
        ("stop", 7, "stop"),         # a stop_token_ids entry
        ("stop", "END", "stop"),     # a stop string (not sent by us, but handled)
        ("length", None, "length"),
        ("abort", None, "cancelled"),
    ])
    def test_finish_reasons(self, reason, stop_reason, expected) -> None:
        assert vl.finish_reason(reason, stop_reason, [2, 0]) == expected

    def test_unknown_finish_reason_is_an_error(self) -> None:
        assert "error" in vl.finish_reason("error", None, [2])

    def test_delta_tokens(self) -> None:
        out = vl.convert_output(vllm_output([5, 6]), [2])
        assert out.token_ids == [5, 6] and out.finish_reason is None

    def test_final_output(self) -> None:
        out = vl.convert_output(vllm_output([2], "stop", None), [2])
        assert out.token_ids == [2] and out.finish_reason == "eos"

    def test_abort_with_no_tokens(self) -> None:
        out = vl.convert_output(vllm_output([], "abort"), [2])
        assert out.token_ids == [] and out.finish_reason == "cancelled"

    def test_logprobs(self) -> None:
        lp = [{5: SimpleNamespace(logprob=-0.5, rank=1), 9: SimpleNamespace(logprob=-1.5, rank=2)}]
        out = vl.convert_output(vllm_output([5], logprobs=lp, cum=-0.5), [2], logprobs=True)
        assert out.log_probs == [-0.5] and out.cum_log_probs == -0.5
        assert out.top_logprobs == [[{"token_id": 5, "logprob": -0.5}, {"token_id": 9, "logprob": -1.5}]]

    def test_one_line_errors(self) -> None:
        assert vl.one_line(ValueError("1 validation error\n  block_size\n    bad")) == \
            "1 validation error block_size bad"


# -- SGLang -------------------------------------------------------------------------------------------

class TestSglangArgs:
    def test_flags_map_onto_server_args(self, folder: Path) -> None:
        cfg = RunConfig(output="sglang", tensor_parallel_size=8, num_nodes=2, node_rank=0,
                        leader_addr="10.217.98.122:9876", base_gpu_id=4, context_length=4096,
                        kv_cache_block_size=32)
        assert sg.engine_args(cfg, card_for(folder)) == {
            "model_path": str(folder), "skip_tokenizer_init": True, "incremental_streaming_output": True,
            "tp_size": 8, "nnodes": 2, "node_rank": 0, "dist_init_addr": "10.217.98.122:9876", "base_gpu_id": 4,
            "context_length": 4096, "page_size": 32}

    def test_single_gpu_defaults(self, folder: Path) -> None:
        assert sg.engine_args(RunConfig(output="sglang"), card_for(folder)) == {
            "model_path": str(folder), "skip_tokenizer_init": True, "incremental_streaming_output": True,
            "tp_size": 1}

    def test_extra_args_win(self, folder: Path) -> None:
        args = sg.engine_args(RunConfig(output="sglang", tensor_parallel_size=2), card_for(folder),
                              {"tp_size": 4, "dtype": "half", "trust_remote_code": True, "mem_fraction_static": 0.8})
        assert args["tp_size"] == 4 and args["dtype"] == "half" and args["mem_fraction_static"] == 0.8

    def test_follower_rank(self, folder: Path) -> None:
        cfg = RunConfig(output="sglang", input="none", tensor_parallel_size=16, num_nodes=2, node_rank=1,
                        leader_addr="10.0.0.1:5000")
        engine = sg.SglangEngine(cfg, card_for(folder))
        assert engine.follower and engine.args["node_rank"] == 1 and engine.args["nnodes"] == 2

    def test_sampling(self) -> None:
        req = request(stop_conditions=StopConditions(max_tokens=16, min_tokens=2, stop=["x"],
                                                     stop_token_ids_hidden=[7]),
                      sampling_options=FULL_SAMPLING)
        assert sg.sampling_params(req) == {
            "max_new_tokens": 16, "min_new_tokens": 2, "stop_token_ids": [2, 0, 7], "temperature": 0.7,
            "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "repetition_penalty": 1.1, "top_k": 40, "sampling_seed": 42}

    def test_sampling_ignore_eos(self) -> None:
        req = request(stop_conditions=StopConditions(max_tokens=3, ignore_eos=True))
        assert sg.sampling_params(req) == {"max_new_tokens": 3, "ignore_eos": True}

    @pytest.mark.parametrize("guided, key, value", [
        ({"json": {"type": "object"}}, "json_schema", '{"type": "object"}'),
        ({"regex": "a+"}, "regex", "a+"),
        ({"grammar": "root ::= 'a'"}, "ebnf", "root ::= 'a'"),
        ({"choice": ["yes", "no?"]}, "regex", "(yes|no\\?)"),
    ])
    def test_guided_decoding(self, guided, key, value) -> None:
        assert sg.sampling_params(request(sampling_options=SamplingOptions(guided_decoding=guided)))[key] == value

    @pytest.mark.parametrize("reason, expected", [
        (None, None),
        ({"type": "stop", "matched": 2}, "eos"),
        ({"type": "stop", "matched": 7}, "stop"),
        ({"type": "stop", "matched": "END"}, "stop"),
        ({"type": "length", "length": 8}, "length"),
        ({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}, "cancelled"),
    ])
    def test_finish_reasons(self, reason, expected) -> None:
        assert sg.finish_reason(reason, [2, 0]) == expected

    def test_abort_with_an_error_status_is_an_error(self) -> None:
        reason = {"type": "abort", "message": "prompt too long", "status_code": 400, "err_type": "BadRequest"}
        assert sg.finish_reason(reason, [2]) == {"error": "SGLang: prompt too long"}

    def test_incremental_stream(self) -> None:
        conv = sg.OutputConverter([2])
        items = [{"output_ids": [5, 6], "meta_info": {"finish_reason": None}},
                 {"output_ids": [7], "meta_info": {"finish_reason": None}},
                 {"output_ids": [2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}]
        outs = [conv.convert(i) for i in items]
        assert [o.token_ids for o in outs] == [[5, 6], [7], [2]]
        assert [o.finish_reason for o in outs] == [None, None, "eos"]

    def test_cumulative_stream(self) -> None:
        conv = sg.OutputConverter([2], incremental=False)
        items = [{"output_ids": [5, 6], "meta_info": {}},
                 {"output_ids": [5, 6, 7], "meta_info": {}},
                 {"output_ids": [5, 6, 7, 8], "meta_info": {"finish_reason": {"type": "length", "length": 4}}}]
        outs = [conv.convert(i) for i in items]
        assert [o.token_ids for o in outs] == [[5, 6], [7], [8]]
        assert outs[-1].finish_reason == "length"


# -- TensorRT-LLM -------------------------------------------------------------------------------------

class TestTrtllmArgs:
    def test_yaml_extra_args_as_in_the_docs(self, tmp_path: Path) -> None:
        f = tmp_path / "trtllm_extra.yaml"
        f.write_text("backend: pytorch\nkv_cache_config:\n  event_buffer_max_size: 1024\n")
        assert trt.load_extra_args(f) == {"backend": "pytorch", "kv_cache_config": {"event_buffer_max_size": 1024}}

    def test_json_is_yaml_too(self, tmp_path: Path) -> None:
        f = tmp_path / "extra.json"
        f.write_text(json.dumps({"max_batch_size": 8}))
        assert trt.load_extra_args(f) == {"max_batch_size": 8}

    def test_empty_file(self, tmp_path: Path) -> None:
        f = tmp_path / "empty.yaml"
        f.write_text("")
        assert trt.load_extra_args(f) == {}

    @pytest.mark.parametrize("text, message", [
        ("backend: [pytorch\n", "not valid YAML"),
        ("- a\n- b\n", "expected a YAML mapping"),
    ])
    def test_bad_yaml(self, tmp_path: Path, text: str, message: str) -> None:
        f = tmp_path / "bad.yaml"
        f.write_text(text)
        with pytest.raises(UserError, match=message):
            trt.load_extra_args(f)

    def test_flags_and_yaml_merge(self, folder: Path) -> None:
        cfg = RunConfig(output="trtllm", tensor_parallel_size=16, num_nodes=2, context_length=8192,
                        kv_cache_block_size=64, leader_addr="h:1")
        extra = {"backend": "pytorch", "kv_cache_config": {"event_buffer_max_size": 1024},
                 "max_batch_size": 32}
        backend, args = trt.split_backend(trt.engine_args(cfg, card_for(folder), extra))
        assert backend == "pytorch"
        assert args == {"model": str(folder), "skip_tokenizer_init": True, "tensor_parallel_size": 16,
                        "gpus_per_node": 8, "max_seq_len": 8192, "max_batch_size": 32,
                        "kv_cache_config": {"tokens_per_block": 64, "event_buffer_max_size": 1024}}

    def test_yaml_wins_inside_nested_settings(self, folder: Path) -> None:
        cfg = RunConfig(output="trtllm", kv_cache_block_size=64)
        args = trt.engine_args(cfg, card_for(folder), {"kv_cache_config": {"tokens_per_block": 32}})
        assert args["kv_cache_config"] == {"tokens_per_block": 32}

    def test_backends(self) -> None:
        assert trt.split_backend({"model": "m"}) == ("pytorch", {"model": "m"})
        assert trt.split_backend({"model": "m", "backend": "tensorrt"})[0] == "tensorrt"
        with pytest.raises(UserError, match="backend 'tpu'"):
            trt.split_backend({"backend": "tpu"})

    def test_gguf_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(UserError, match="GGUF"):
            trt.engine_args(RunConfig(output="trtllm"), ModelCard(display_name="g", gguf_path=tmp_path / "m.gguf"))

    def test_sampling(self) -> None:
        req = request(stop_conditions=StopConditions(max_tokens=16, min_tokens=2, stop_token_ids_hidden=[7, 2]),
                      sampling_options=FULL_SAMPLING, output_options=OutputOptions(logprobs=1))
        assert trt.sampling_params(req) == {
            "detokenize": False, "max_tokens": 16, "min_tokens": 2, "end_id": 2, "pad_id": 2,
            "stop_token_ids": [0, 7], "temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.1, "top_k": 40, "seed": 42, "logprobs": 1}

    def test_greedy(self) -> None:
        params = trt.sampling_params(request(sampling_options=SamplingOptions(temperature=0.0, top_p=0.5)))
        assert params["top_k"] == 1 and "temperature" not in params and "top_p" not in params

    def test_ignore_eos(self) -> None:
        params = trt.sampling_params(request(stop_conditions=StopConditions(max_tokens=4, ignore_eos=True)))
        assert params["ignore_eos"] is True and params["end_id"] == -1 and "stop_token_ids" not in params

    @pytest.mark.parametrize("reason, stop_reason, expected", [
        (None, None, None), ("stop", None, "eos"), ("stop", 0, "eos"), ("stop", 7, "stop"),
        ("length", None, "length"), ("cancelled", None, "cancelled"),
    ])
    def test_finish_reasons(self, reason, stop_reason, expected) -> None:
        assert trt.finish_reason(reason, stop_reason, [2, 0]) == expected

    def test_timeout_is_an_error(self) -> None:
        assert "timed out" in trt.finish_reason("timeout", None, [2])["error"]

    def test_streamed_results(self) -> None:
        def step(diff, reason=None, finished=False):
            choice = SimpleNamespace(index=0, token_ids_diff=diff, finish_reason=reason, stop_reason=None)
            return SimpleNamespace(outputs=[choice], finished=finished)

        outs = [trt.convert_output(s, [2]) for s in (step([5]), step([6, 7]), step([], "length", True))]
        assert [o.token_ids for o in outs] == [[5], [6, 7], []]
        assert [o.finish_reason for o in outs] == [None, None, "length"]


# -- missing packages ---------------------------------------------------------------------------------

@pytest.mark.parametrize("engine, hint", [
    ("sglang", "pip install sglang"),
    ("trtllm", "pip install tensorrt-llm"),
    ("vllm", "pip install vllm"),
])
def test_missing_package_names_what_to_install(engine: str, hint: str, folder: Path) -> None:
    if engine_installed(engine):
        pytest.skip(f"{engine} is installed here")
    with pytest.raises(UserError, match=hint):
        create_engine(engine, RunConfig(output=engine), card_for(folder))


def test_cli_reports_a_missing_engine_in_one_line(tiny_model: Path) -> None:
    if engine_installed("sglang"):
        pytest.skip("sglang is installed here")
    proc = run_cli(["in=none", "out=sglang", str(tiny_model)], timeout=60)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert lines and "pip install sglang" in lines[0]
    assert "Traceback" not in proc.stderr


def test_trtllm_yaml_extra_args_pass_the_flag_parser(tmp_path: Path, folder: Path) -> None:
    f = tmp_path / "trtllm_extra.yaml"
    f.write_text("backend: pytorch\nkv_cache_config:\n  event_buffer_max_size: 1024\n")
    cfg = parse_args(["in=none", "out=trtllm", str(folder), "--extra-engine-args", str(f)])
    engine = trt.TrtllmEngine(cfg, card_for(folder), trt.load_extra_args(cfg.extra_engine_args), f)
    assert engine.backend == "pytorch" and engine.args["kv_cache_config"] == {"event_buffer_max_size": 1024}
