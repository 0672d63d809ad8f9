"""What every Dynamo 1.x entry point shares: flags that also read a ``DYN_*`` variable, flags refused in one
line, the runtime flags, ``--dump-config-to``, and running the :class:`RunConfig` they map onto.

Why a parser of its own rather than ``dynamo-run``'s: 1.x's command lines are a fact users' launch scripts
and manifests depend on (its flag names, its variables, that the flag beats the variable), and ours are
another (``in=``/``out=``).  Each 1.x flag is declared here once as an :class:`Opt` (we honour it, maybe
only some of its values) or a :class:`Refused` (we do not: exit 2 with one line naming it, never accepted
and ignored); docs/cli-1x.md lists every one, and tests/unit/test_cli_v1_table.py holds the code to it.

A flag we honour takes its value from, in order: the command line, its variable (when set and not empty),
1.x's default (or ours where the table says so).  A refused flag's variable set to anything is refused too:
an operator's ``DYN_ROUTER_TTL_SECS`` would otherwise be ignored in silence.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dynamo.errors import UserError
from dynamo.run_config import RunConfig

DOCS = "docs/cli-1x.md"
DEFAULT_NAMESPACE = "dynamo"  # 1.x's DYN_NAMESPACE default for workers


def to_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be at least 0, got {value}")
    return value


def pos_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be a number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be a number > 0, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a port between 0 and 65535, got {value}")
    return value


@dataclass(frozen=True)
class Opt:
    """A 1.x flag we honour.  ``flags``: its spellings (a ``switch`` also gets ``--no-`` forms when
    ``negatable``); ``only``: the values we honour, the others are refused naming the value; ``env_to``: the
    flag is passed on as this process's environment variable, which the runtime reads (e.g. NATS TLS)."""

    flags: tuple[str, ...]
    dest: str
    help: str
    env: str | None = None
    default: Any = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    switch: bool = False
    negatable: bool = True
    only: tuple[Any, ...] | None = None
    env_to: str | None = None
    metavar: str | None = None


@dataclass(frozen=True)
class Refused:
    """A 1.x flag we do not implement: given, it is a one-line error (exit 2) that names it.  ``takes_value``
    says whether 1.x's flag takes a value (so the error names the flag, not a stray argument)."""

    flags: tuple[str, ...]
    why: str
    env: str | None = None
    takes_value: bool = True


def refused(names: str, why: str, env: str | None = None, *, switch: bool = False) -> Refused:
    """A :class:`Refused` from its spellings separated by spaces (e.g. ``"--router-ttl-secs"``); a ``switch``
    also refuses each spelling's ``--no-`` form, as 1.x's boolean flags have one."""
    flags = names.split()
    if switch:
        flags += ["--no-" + f[2:] for f in flags]
    return Refused(tuple(flags), why, env, takes_value=not switch)


class Parser(argparse.ArgumentParser):
    """argparse with our errors: one line, exit 2 (a :class:`UserError` the entry point prints)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message}. Run 'python -m {self.prog} --help' for the flags it takes.")


class RefuseAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, why: str = "", **kwargs: Any) -> None:
        self.why = why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:
        raise UserError(f"{option_string} (a Dynamo 1.x flag) is not implemented here: {self.why} ({DOCS})")


class VersionAction(argparse.Action):
    """``--version``, looked up only when asked (importlib.metadata costs start-up time)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{parser.prog} (dynamo-run-py {version()})")
        parser.exit()


class Spec:
    """One entry point's 1.x flags: build its argparse parser and read argv and the environment."""

    def __init__(self, prog: str, description: str, opts: Sequence[Opt], refusals: Sequence[Refused],
                 epilog: str = "") -> None:
        self.prog = prog
        self.opts = list(opts)
        self.refusals = list(refusals)
        self.parser = Parser(prog=prog, description=description, epilog=epilog, allow_abbrev=False,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        self.parser.add_argument("--version", action=VersionAction)
        taken = self.parser.add_argument_group("Dynamo 1.x flags taken (the flag wins over its variable)")
        for o in self.opts:
            kwargs: dict[str, Any] = {"dest": o.dest, "default": None, "help": self._help(o)}
            if o.switch:
                flags = list(o.flags)
                if o.negatable:
                    kwargs["action"] = argparse.BooleanOptionalAction
                else:
                    kwargs["action"] = "store_const"
                    kwargs["const"] = True
                taken.add_argument(*flags, **kwargs)
            else:
                kwargs.update(type=self._conv(o.flags[0], o.type), metavar=o.metavar or o.dest.upper())
                if o.choices:
                    kwargs["choices"] = o.choices
                    kwargs.pop("metavar")
                taken.add_argument(*o.flags, **kwargs)
        if self.refusals:
            group = self.parser.add_argument_group(
                "Dynamo 1.x flags refused here (each is a one-line error, exit 2; " + DOCS + ")")
            for r in self.refusals:
                group.add_argument(*r.flags, action=RefuseAction, why=r.why, nargs=None if r.takes_value else 0,
                                   dest=argparse.SUPPRESS, default=argparse.SUPPRESS, metavar="V",
                                   help=r.why + (f" [{r.env}]" if r.env else ""))

    @staticmethod
    def _help(o: Opt) -> str:
        tail = []
        if o.env:
            tail.append(f"env var: {o.env}")
        tail.append(f"default: {o.default}")
        if o.only is not None:
            tail.append("honoured: " + ", ".join(str(v) for v in o.only))
        return f"{o.help} ({'; '.join(tail)})"

    @staticmethod
    def _conv(flag: str, conv: Callable[[str], Any]) -> Callable[[str], Any]:
        def run(text: str) -> Any:
            try:
                return conv(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"{flag}: {e}") from None
        return run

    def parse(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              known_only: bool = False) -> tuple[argparse.Namespace, list[str], dict[str, str]]:
        """argv and the environment read: the values (every :class:`Opt` dest set), the arguments left
        over (``known_only``: an engine's own flags), and the environment variables to set for the runtime
        (``env_to``)."""
        env = os.environ if env is None else env
        if known_only:
            ns, rest = self.parser.parse_known_args(list(argv))
        else:
            ns, rest = self.parser.parse_args(list(argv)), []
        for r in self.refusals:
            if r.env and env.get(r.env, "") != "":
                raise UserError(f"{r.env} (Dynamo 1.x's {r.flags[0]}) is not implemented here: {r.why} ({DOCS})")
        env_out: dict[str, str] = {}
        for o in self.opts:
            value = getattr(ns, o.dest)
            source = o.flags[0]
            if value is None and o.env and env.get(o.env, "") != "":
                source = o.env
                raw = env[o.env]
                try:
                    value = to_bool(raw) if o.switch else o.type(raw)
                except ValueError as e:
                    raise UserError(f"{o.env}={raw!r}: {e}") from None
                if o.choices and value not in o.choices:
                    raise UserError(f"{o.env}={raw!r}: expected one of {', '.join(o.choices)}")
            if value is None:
                value = o.default
            elif o.only is not None and value not in o.only:
                shown = _given(argv, o, value) if source.startswith("-") else f"{source}={value}"
                raise UserError(f"{shown} (Dynamo 1.x) is not implemented here; honoured: "
                                + ", ".join(_spell(o, v) for v in o.only) + f" ({DOCS})")
            setattr(ns, o.dest, value)
            if o.env_to and value not in (None, False):
                env_out[o.env_to] = "true" if value is True else str(value)
        return ns, rest, env_out


def _given(argv: Sequence[str], o: Opt, value: Any) -> str:
    """The flag as the user wrote it (the last of its spellings on the command line), with its value."""
    spellings = set(o.flags) | {"--no-" + f[2:] for f in o.flags if f.startswith("--")}
    for arg in reversed(argv):
        name = arg.split("=", 1)[0]
        if name in spellings:
            return name if o.switch else f"{name} {value}"
    return _spell(o, value)


def _spell(o: Opt, value: Any) -> str:
    if o.switch:
        return o.flags[0] if value else "--no-" + o.flags[0][2:]
    return f"{o.flags[0]} {value}"


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("dynamo-run-py")
    except Exception:
        return "unknown"


# -- the runtime flags every 1.x process has ----------------------------------------------------------

def runtime_opts() -> list[Opt]:
    return [
        Opt(("--discovery-backend",), "discovery_backend", "where processes find each other: etcd (ETCD_ENDPOINTS) "
            "or file (DYN_FILE_KV); unset: etcd when ETCD_ENDPOINTS is set or etcd answers on localhost:2379, "
            "else file (1.x: etcd)", env="DYN_DISCOVERY_BACKEND", default=None,
            choices=("kubernetes", "etcd", "file", "mem"), only=("etcd", "file")),
        Opt(("--request-plane",), "request_plane", "how requests reach workers; unset: nats when NATS_SERVER is "
            "set or a NATS answers on localhost:4222, else tcp (1.x: tcp)", env="DYN_REQUEST_PLANE",
            choices=("nats", "tcp")),
        Opt(("--event-plane",), "event_plane", "how KV events travel; unset: nats when NATS answers, else zmq",
            env="DYN_EVENT_PLANE", choices=("nats", "zmq")),
        Opt(("--response-plane",), "response_plane", "the response transport: tcp (workers call back)",
            env="DYN_RESPONSE_PLANE", default="tcp", choices=("tcp", "quic"), only=("tcp",)),
        Opt(("--nats-tls-ca-cert-path",), "nats_tls_ca", "CA certificate verifying the NATS server",
            env="NATS_TLS_CA_CERT_PATH", env_to="NATS_TLS_CA_CERT_PATH", metavar="PEM"),
        Opt(("--nats-tls-client-cert-path",), "nats_tls_cert", "client certificate for NATS mTLS",
            env="NATS_TLS_CLIENT_CERT_PATH", env_to="NATS_TLS_CLIENT_CERT_PATH", metavar="PEM"),
        Opt(("--nats-tls-client-key-path",), "nats_tls_key", "client key for NATS mTLS",
            env="NATS_TLS_CLIENT_KEY_PATH", env_to="NATS_TLS_CLIENT_KEY_PATH", metavar="PEM"),
        Opt(("--nats-tls-insecure",), "nats_tls_insecure", "do not verify the NATS server's certificate",
            env="NATS_TLS_INSECURE", default=False, switch=True, env_to="NATS_TLS_INSECURE"),
        Opt(("--dump-config-to",), "dump_config_to", "write the flags read and the configuration they map onto "
            "to this JSON file, then run", env="DYN_DUMP_CONFIG_TO", metavar="FILE"),
    ]


TCP_TLS_PATHS = (("cert-path", "certificate this process serves its TCP listeners with (TLS on when the key "
                  "is set too)"),
                 ("key-path", "private key of --tcp-tls-cert-path"),
                 ("ca-cert-path", "CA that signed the peers' certificates: this process dials its TCP peers in TLS"),
                 ("client-cert-path", "client certificate this process presents to TCP listeners (mutual TLS)"),
                 ("client-key-path", "private key of --tcp-tls-client-cert-path"),
                 ("client-ca-cert-path", "CA this process's TCP listeners require client certificates from "
                  "(mutual TLS)"))


def tcp_tls_opts() -> list[Opt]:
    """1.x's TLS flags for the TCP request plane and response streams: each sets its DYN_TCP_TLS_* variable,
    which the runtime reads (runtime/tcp_tls.py)."""
    return [Opt((f"--tcp-tls-{name}",), "tcp_tls_" + name.replace("-", "_"), help,
                env=(var := "DYN_TCP_TLS_" + name.upper().replace("-", "_")), env_to=var, metavar="PEM")
            for name, help in TCP_TLS_PATHS]


def worker_tcp_tls_opts() -> list[Opt]:
    """The TCP TLS flags 1.x's workers take beyond the frontend's."""
    return [
        Opt(("--tcp-tls-insecure",), "tcp_tls_insecure", "dial TCP peers in TLS without verifying their "
            "certificates (development only)", env="DYN_TCP_TLS_INSECURE", default=False, switch=True,
            env_to="DYN_TCP_TLS_INSECURE"),
        Opt(("--tcp-tls-server-name",), "tcp_tls_server_name", "name to verify TCP peers' certificates for, "
            "instead of the dialed host", env="DYN_TCP_TLS_SERVER_NAME", env_to="DYN_TCP_TLS_SERVER_NAME"),
        Opt(("--tcp-tls-handshake-timeout",), "tcp_tls_handshake_timeout", "seconds a TLS handshake on the TCP "
            "planes may take (default 3)", env="DYN_TCP_TLS_HANDSHAKE_TIMEOUT_SECS", type=pos_int,
            env_to="DYN_TCP_TLS_HANDSHAKE_TIMEOUT_SECS"),
    ]


def worker_runtime_opts() -> list[Opt]:
    """The runtime flags of 1.x's workers (``DynamoRuntimeArgGroup``) that we honour."""
    return [
        Opt(("--namespace",), "namespace", "the dynamo namespace the worker serves in (the endpoint's, when "
            "--endpoint is not given)", env="DYN_NAMESPACE", default=DEFAULT_NAMESPACE),
        Opt(("--endpoint",), "endpoint", "where the worker serves: dyn://namespace.component.endpoint "
            "(default dyn://NAMESPACE.backend.generate; a prefill worker NAMESPACE.prefill.generate)",
            env="DYN_ENDPOINT"),
        Opt(("--dyn-tool-call-parser",), "tool_call_parser", "how to read tool calls from the model's text "
            "(dynamo-run's --tool-call-parser)", env="DYN_TOOL_CALL_PARSER"),
        Opt(("--dyn-reasoning-parser",), "reasoning_parser", "how to split reasoning from the answer "
            "(dynamo-run's --reasoning-parser)", env="DYN_REASONING_PARSER"),
        Opt(("--custom-jinja-template",), "custom_jinja_template", "a Jinja chat template file replacing the "
            "model's (dynamo-run's --chat-template)", env="DYN_CUSTOM_JINJA_TEMPLATE", metavar="FILE"),
        Opt(("--endpoint-types",), "endpoint_types", "the APIs the model is served for: chat and completions",
            env="DYN_ENDPOINT_TYPES", default="chat,completions", only=("chat,completions", "completions,chat")),
        Opt(("--engine-request-limit",), "engine_request_limit", "requests the worker takes at once; more are "
            "refused as busy and go to another worker (dynamo-run's --max-inflight)",
            env="DYN_ENGINE_REQUEST_LIMIT", type=pos_int),
        Opt(("--output-modalities",), "output_modalities", "what the model outputs: text",
            env="DYN_OUTPUT_MODALITIES", default="text", only=("text",)),
    ]


def worker_runtime_refusals() -> list[Refused]:
    return [
        refused("--kv-state-endpoint", "a separate KV state endpoint (ours is the worker's recovery endpoint)",
                "DYN_KV_STATE_ENDPOINT"),
        refused("--connector", "deprecated in 1.x; KV transfer is configured by --disaggregation-mode here",
                "DYN_CONNECTOR"),
        refused("--fpm-trace", "forward-pass metric traces", "DYN_FPM_TRACE", switch=True),
        refused("--dyn-default-thinking-mode", "a default thinking mode", "DYN_DEFAULT_THINKING_MODE"),
        refused("--exclude-tools-when-tool-choice-none", "dropping tools from the template on tool_choice none",
                "DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", switch=True),
        refused("--dyn-enable-structural-tag", "structural tags", "DYN_ENABLE_STRUCTURAL_TAG", switch=True),
        refused("--dyn-structural-tag-scope", "structural tags", "DYN_STRUCTURAL_TAG_SCOPE"),
        refused("--dyn-structural-tag-schema", "structural tags", "DYN_STRUCTURAL_TAG_SCHEMA"),
        refused("--dyn-structural-tag", "structural tags", "DYN_STRUCTURAL_TAG"),
        refused("--multimodal-embedding-cache-capacity-gb", "the multimodal embedding cache",
                "DYN_MULTIMODAL_EMBEDDING_CACHE_CAPACITY_GB"),
        refused("--multimodal-embedding-cache-publisher", "the multimodal embedding cache",
                "DYN_MULTIMODAL_EMBEDDING_CACHE_PUBLISHER", switch=True),
        refused("--media-output-fs-url", "media output", "DYN_MEDIA_OUTPUT_FS_URL"),
        refused("--media-output-http-url", "media output", "DYN_MEDIA_OUTPUT_HTTP_URL"),
        refused("--health-check-payload", "the health-check canary", "DYN_HEALTH_CHECK_PAYLOAD"),
        refused("--durable-kv-events", "JetStream-durable KV events (deprecated in 1.x)", "DYN_DURABLE_KV_EVENTS",
                switch=True),
    ]


def worker_endpoint(ns: argparse.Namespace, *, prefill: bool = False) -> str:
    """The ``dyn://`` endpoint a 1.x worker serves: ``--endpoint``, else ``NAMESPACE.backend.generate``
    (``NAMESPACE.prefill.generate`` for a prefill worker), as 1.x's workers default."""
    if ns.endpoint:
        ep = ns.endpoint if ns.endpoint.startswith("dyn://") else "dyn://" + ns.endpoint
        if len(ep[6:].split(".")) != 3 or not all(ep[6:].split(".")):
            raise UserError(f"--endpoint {ns.endpoint!r}: expected dyn://namespace.component.endpoint")
        return ep
    return f"dyn://{ns.namespace}.{'prefill' if prefill else 'backend'}.generate"


def apply_worker_runtime(cfg: RunConfig, ns: argparse.Namespace) -> None:
    """The 1.x worker runtime flags onto ``cfg`` (a worker: ``in=dyn://...``)."""
    apply_runtime(cfg, ns)
    cfg.tool_call_parser = ns.tool_call_parser
    cfg.reasoning_parser = ns.reasoning_parser
    if ns.custom_jinja_template:
        cfg.chat_template = Path(ns.custom_jinja_template).expanduser()
    cfg.max_inflight = ns.engine_request_limit


def apply_runtime(cfg: RunConfig, ns: argparse.Namespace) -> None:
    cfg.discovery_backend = ns.discovery_backend
    cfg.request_plane = ns.request_plane
    cfg.event_plane = ns.event_plane


def dump_config(path: str, module: str, ns: argparse.Namespace, cfg: RunConfig | None,
                extra: Mapping[str, Any] | None = None) -> None:
    """``--dump-config-to FILE``: the 1.x flags as read (flag, variable or default) and the RunConfig they
    became, as JSON, so an operator sees what a launch script amounted to."""
    data: dict[str, Any] = {"module": module, "flags": {k: _jsonable(v) for k, v in sorted(vars(ns).items())}}
    if cfg is not None:
        data["run_config"] = {k: _jsonable(v) for k, v in dataclasses.asdict(cfg).items()}
    if extra:
        data.update({k: _jsonable(v) for k, v in extra.items()})
    try:
        Path(path).expanduser().write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise UserError(f"--dump-config-to {path}: {e.strerror or e}") from None


def _jsonable(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def entry(build: Callable[[list[str]], tuple[RunConfig, dict[str, str]]], argv: list[str] | None = None) -> int:
    """Run one 1.x entry point: ``build`` reads argv into a :class:`RunConfig` and the variables the runtime
    is to read (flags passed on as variables, set only now so that reading argv has no side effects); a
    :class:`UserError` while reading is one line and exit 2, as ``dynamo-run``'s."""
    from dynamo.cli.flags import validate
    from dynamo.cli.main import run_parsed

    args = sys.argv[1:] if argv is None else argv
    try:
        cfg, env_out = build(args)
        validate(cfg)
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    os.environ.update(env_out)
    return run_parsed(cfg)
