"""``python -m dynamo.mistralrs --model-path M``: Dynamo dropped its mistral.rs engine with dynamo-run; here it is
the same shape as the other worker modules, on our mistralrs engine (``dynamo-run in=dyn://NS.backend.generate
out=mistralrs M``)."""

from __future__ import annotations

from typing import Any

from dynamo.cli.v1.common import Opt, pos_int
from dynamo.cli.v1.worker import WorkerModule, model_opts
from dynamo.run_config import RunConfig


def apply(cfg: RunConfig, ns: Any, extra: dict[str, Any]) -> None:
    cfg.context_length = ns.context_length


MODULE = WorkerModule("dynamo.mistralrs", "mistralrs", [
    *model_opts(),
    Opt(("--context-length",), "context_length", "the context length (default: the model's)", type=pos_int),
    Opt(("--extra-engine-args",), "extra_engine_args", "JSON file of mistralrs engine arguments", metavar="FILE"),
], [], apply=apply)

main = MODULE.main
