"""What Dynamo 1.x's worker modules share (``python -m dynamo.llama_cpp|vllm|sglang|trtllm|mistralrs``): each
is ``dynamo-run in=dyn://NS.backend.generate out=<engine> MODEL`` with 1.x's runtime flags (common.py) and
its engine's flags, declared per module; the engine's own command-line flags, where 1.x passes them through
(vLLM's, SGLang's), become our engine's ``--extra-engine-args`` JSON (a temporary file removed at exit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dynamo.cli.v1.common import (
    Opt,
    Refused,
    Spec,
    apply_worker_runtime,
    dump_config,
    entry,
    pos_int,
    runtime_opts,
    tcp_tls_opts,
    worker_endpoint,
    worker_runtime_opts,
    worker_runtime_refusals,
    worker_tcp_tls_opts,
)
from dynamo.cli.v1.mocker import write_args
from dynamo.engines.engine_args import read_json_args
from dynamo.errors import UserError
from dynamo.run_config import RunConfig

DISAGG_MODES = ("agg", "prefill", "decode")


def model_opts(*, model_flags: tuple[str, ...] = ("--model-path",),
               name_flags: tuple[str, ...] = ("--model-name", "--served-model-name"),
               env_prefix: str | None = None) -> list[Opt]:
    return [
        Opt(model_flags, "model_path", "the model: a GGUF file, a Hugging Face folder or repo id",
            env=f"{env_prefix}MODEL" if env_prefix else None, metavar="MODEL"),
        Opt(name_flags, "model_name", "the name clients use (default: from the model)",
            env=f"{env_prefix}SERVED_MODEL_NAME" if env_prefix else None, metavar="NAME"),
    ]


def disagg_opt(env: str | None = None, choices: tuple[str, ...] = DISAGG_MODES) -> Opt:
    return Opt(("--disaggregation-mode",), "disaggregation_mode", "agg, prefill (prefills, hands the KV state "
               "to a decode worker) or decode", env=env, default="agg", choices=choices,
               only=DISAGG_MODES if set(choices) - set(DISAGG_MODES) else None)


class WorkerModule:
    """One 1.x worker module: its spec and how its flags become our engine's."""

    def __init__(self, prog: str, engine: str, opts: Sequence[Opt], refusals: Sequence[Refused], *,
                 passthrough: Callable[[str, list[str]], dict[str, Any]] | None = None,
                 apply: Callable[[RunConfig, argparse.Namespace, dict[str, Any]], None] | None = None,
                 description: str = "") -> None:
        self.prog = prog
        self.engine = engine
        self.passthrough = passthrough
        self.apply = apply
        self.spec_opts = [*opts, *worker_runtime_opts(), *runtime_opts(), *tcp_tls_opts(), *worker_tcp_tls_opts()]
        self.spec_refusals = [*refusals, *worker_runtime_refusals()]
        self.description = description or (
            f"Dynamo 1.x's {prog} worker on dynamo-run's: dynamo-run in=dyn://NAMESPACE.backend.generate "
            f"out={engine} MODEL with these flags mapped (docs/cli-1x.md).")

    def spec(self) -> Spec:
        epilog = ""
        if self.passthrough is not None:
            epilog = (f"Other flags are {self.engine}'s own engine flags: they are read with {self.engine}'s "
                      "parser and passed to the engine (they need it installed).")
        return Spec(self.prog, self.description, self.spec_opts, self.spec_refusals, epilog=epilog)

    def build(self, argv: list[str], env: Mapping[str, str] | None = None) -> tuple[RunConfig, dict[str, str]]:
        ns, rest, env_out = self.spec().parse(argv, env, known_only=self.passthrough is not None)
        if not ns.model_path:
            raise UserError(f"{self.prog}: the model is required ({self.spec_opts[0].flags[0]} MODEL)")
        mode = getattr(ns, "disaggregation_mode", None) or "agg"
        cfg = RunConfig(input=worker_endpoint(ns, prefill=mode == "prefill"), output=self.engine,
                        model=ns.model_path, model_name=ns.model_name, disaggregation_mode=mode)
        apply_worker_runtime(cfg, ns)
        extra: dict[str, Any] = {}
        if getattr(ns, "extra_engine_args", None) and self.engine != "trtllm":
            extra.update(read_json_args(Path(ns.extra_engine_args).expanduser()))
        if self.apply is not None:
            self.apply(cfg, ns, extra)
        if rest:
            unknown = [a for a in rest if a.startswith("-")]
            if self.passthrough is None or unknown and unknown[0].startswith("--dyn-"):
                raise UserError(f"unrecognized arguments: {' '.join(rest)}. Run 'python -m {self.prog} --help' "
                                "for the flags it takes.")
            extra.update(self.passthrough(ns.model_path, rest))
        if extra:
            cfg.extra_engine_args = write_args(extra)
        if ns.dump_config_to:
            dump_config(ns.dump_config_to, self.prog, ns, cfg, {"engine_args": extra, "environment_set": env_out})
        return cfg, env_out

    def main(self, argv: list[str] | None = None) -> int:
        return entry(self.build, argv)


def engine_flag_diff(parser: argparse.ArgumentParser, model_flag: str, model: str, argv: list[str]
                     ) -> dict[str, Any]:
    """An engine's own flags as keyword arguments: what ``argv`` sets that differs from the engine's own
    defaults (so our engine's choices stand where the user said nothing), as JSON values."""
    base = vars(parser.parse_args([model_flag, model]))
    given = vars(parser.parse_args([*argv, model_flag, model]))
    out = {}
    for key, value in given.items():
        if key in ("model", "model_path") or base.get(key) == value:
            continue
        out[key] = json.loads(json.dumps(value, default=_json_value))
    return out


def _json_value(value: Any) -> Any:
    """A parsed flag value that is an object (vLLM parses ``--kv-events-config '{...}'`` into a dataclass or a
    pydantic model) as the JSON object it was given as, so the engine rebuilds it; anything else as text."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def int_opt(flags: tuple[str, ...], dest: str, help: str, env: str | None = None) -> Opt:
    return Opt(flags, dest, help, env=env, type=pos_int)
