"""The OpenAI-compatible HTTP service (aiohttp): the application, its route table, start and stop.

The routes live in their own modules, one per family, and know nothing of this one: chat and
completions (chat.py), embeddings, responses, Anthropic's messages (messages.py, with
``--enable-anthropic-api``), tokenize, models, health (health.py: /health, /live, /metrics).  Shared by them: request bodies (body.py), the SSE writer (sse.py), the frontend-wide limit
and the in-flight requests (admission.py), the error responses (errors.py).  API keys, TLS, CORS and
the body limit come from options.py once, at start-up, so nothing of them is on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web

from dynamo.aio import Acceptor
from dynamo.frontend.http.admission import Admission, Handler
from dynamo.frontend.http.body import BODY_LIMIT_KEY
from dynamo.frontend.http.chat import ChatRoutes
from dynamo.frontend.http.debug_memory import DebugMemoryRoute
from dynamo.frontend.http.embeddings import EmbeddingsRoute
from dynamo.frontend.http.errors import error_middleware
from dynamo.frontend.http.health import HealthRoutes
from dynamo.frontend.http.lora import LoraRoutes
from dynamo.frontend.http.messages import MessagesRoutes, messages_disabled
from dynamo.frontend.http.metrics import FrontendMetrics
from dynamo.frontend.http.models import ModelsRoute
from dynamo.frontend.http.options import HttpOptions
from dynamo.frontend.http.responses import ResponsesRoute
from dynamo.frontend.http.tokenize import TokenizeRoutes
from dynamo.frontend.http.traced import traced
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.lora import runtime_lora_allowed
from dynamo.llm.media import use_policy

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024  # a burst of hundreds of new connections must not overflow the accept queue
DEFAULT_MAX_INFLIGHT = 1024  # --max-inflight on in=http: requests in progress (generating or queued) at once


class HttpService:
    def __init__(self, models: ModelManager, *, metrics: FrontendMetrics | None = None,
                 max_inflight: int = DEFAULT_MAX_INFLIGHT, options: HttpOptions | None = None):
        self.models = models
        self.metrics = metrics or FrontendMetrics()
        self.admission = Admission(max_inflight, self.metrics)
        self.options = options or HttpOptions()
        use_policy(self.options.media)  # the pre-processor loads images under it
        self.app = web.Application(client_max_size=self.options.body_limit,
                                   middlewares=[*self.options.middlewares(), error_middleware])
        self.app[BODY_LIMIT_KEY] = self.options.body_limit
        self.options.install(self.app)
        self._add_routes()
        self._runner: web.AppRunner | None = None
        self._acceptor: Acceptor | None = None
        self.port: int | None = None

    def _add_routes(self) -> None:
        router, gate = self.app.router, self.admission.gate

        def admit(endpoint: str, handler: Handler) -> Handler:  # behind the limit, in its server span if traced
            return traced(endpoint, gate(endpoint, handler))

        models = ModelsRoute(self.models)
        router.add_get("/v1/models", models.list_models)
        chat = ChatRoutes(self.models, self.admission)
        router.add_post("/v1/chat/completions", admit("chat_completions", chat.chat))
        router.add_post("/v1/completions", admit("completions", chat.completions))
        router.add_post("/v1/embeddings", admit("embeddings", EmbeddingsRoute(self.models, self.admission).handle))
        responses = ResponsesRoute(self.models, self.admission)
        router.add_post("/v1/responses", admit("responses", responses.handle))
        router.add_get("/v1/responses/{response_id}", responses.retrieve)
        router.add_get("/v1/responses/{response_id}/input_items", responses.list_input_items)
        router.add_delete("/v1/responses/{response_id}", responses.delete)
        if self.options.anthropic_api:
            messages = MessagesRoutes(self.models, self.admission)
            router.add_post("/v1/messages", admit("messages", messages.create))
            router.add_post("/v1/messages/count_tokens", messages.count_tokens)
        else:
            router.add_post("/v1/messages", messages_disabled)
            router.add_post("/v1/messages/count_tokens", messages_disabled)
        tokenize = TokenizeRoutes(self.models)
        router.add_post("/tokenize", tokenize.tokenize)
        router.add_post("/detokenize", tokenize.detokenize)
        if runtime_lora_allowed():
            LoraRoutes(self.models).install(router)
        router.add_get("/tokenizer_info", tokenize.tokenizer_info)
        health = HealthRoutes(self.models, self.metrics)
        router.add_get("/health", health.health)
        router.add_get("/live", health.live)
        router.add_get("/metrics", health.prometheus)
        DebugMemoryRoute().install(router)  # only with DYN_DEBUG_MEMORY set

    # -- lifecycle
    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=5.0)
        await self._runner.setup()
        sock = _listen_socket(host, port)
        # our own accept loop: 256 clients connecting at once are accepted in one turn, not one per turn
        self._acceptor = Acceptor(sock, self._runner.server, ssl=self.options.ssl_context())  # type: ignore[arg-type]
        self.port = sock.getsockname()[1]
        log.info("OpenAI-compatible HTTP service listening on %s://%s:%d", self.options.scheme, host, self.port)
        self.metrics.prepare_in_background()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, give in-flight requests ``grace`` seconds to finish, then end them."""
        if self._runner is None:
            return
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        inflight = self.admission.tasks
        if inflight:
            log.info("waiting up to %gs for %d in-flight request(s)", grace, len(inflight))
            _, pending = await asyncio.wait(list(inflight), timeout=grace)
            if pending:
                # out of patience: stop the engines, so each stream still ends with its finish chunk and
                # [DONE] (a unary request gets what was generated) instead of a cut connection
                log.info("ending %d request(s) still in flight", len(pending))
                for ctx in list(self.admission.contexts):
                    ctx.stop_generating()
                await asyncio.wait(pending, timeout=2.0)
        await self._runner.cleanup()
        self._runner = None


def _listen_socket(host: str, port: int) -> socket.socket:
    from dynamo.frontend.http.listen import take_adopted

    adopted = take_adopted()  # --http-workers: the parent bound it
    if adopted is not None:
        return adopted
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from dynamo.errors import UserError

        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock
