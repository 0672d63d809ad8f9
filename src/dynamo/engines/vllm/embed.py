"""``out=vllm --embedding``: sentence embeddings from vLLM's pooling runner.

vLLM starts as for generation (vllm.py: the same arguments, environment and error handling) with
``runner="pooling"``: an embedding model (``BertModel``, ``*EmbeddingModel``, a sentence-transformers
folder) is served as it declares itself, and a generative model (``*ForCausalLM``) is converted into one
by vLLM (``convert="auto"`` resolves to ``embed``), pooled as vLLM pools it (the last token, unless
``--extra-engine-args`` sets ``pooler_config``, e.g. ``{"pooler_config": {"pooling_type": "MEAN"}}``).
Vectors come back L2-normalised (vLLM's default for embeddings), as the OpenAI API's are.

Strings are tokenized here with the model's tokenizer, special tokens added (what vLLM's own
``/v1/embeddings`` does), and every input goes to ``AsyncLLM.encode`` as token ids; the inputs of one
request are encoded concurrently, so vLLM batches them.  ``dimensions`` is vLLM's to accept: models with
Matryoshka dimensions take it, others give a 400.  An input longer than the context is a 400.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any, Mapping

from dynamo.engines.token_engine_common import one_line
from dynamo.engines.vllm.engine import VllmEngine
from dynamo.errors import EngineError, ModelError, RequestError
from dynamo.llm.embeddings import EmbeddingInput, Embeddings
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)


class VllmEmbeddingEngine:
    kind = "embedding"

    def __init__(self, cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None = None,
                 extra_path: Path | None = None):
        from dynamo.llm.tokenizer import Tokenizer

        self.card = card
        self.core = VllmEngine(cfg, card, extra, extra_path, pooling=True)
        self.tokenizer = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]
        self._ids = itertools.count()
        self._params: Any = None  # vLLM's PoolingParams, VLLMClientError and tokens_input, once started
        self._client_error: Any = None
        self._tokens_input: Any = None

    async def start(self) -> None:
        await self.core.start()
        if self.core.llm is None:  # a follower node of a multi-node engine serves nothing itself
            return
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input

        from vllm import PoolingParams

        self._params, self._client_error, self._tokens_input = PoolingParams, VLLMClientError, tokens_input
        tasks = await self.core.llm.get_supported_tasks()
        if "embed" not in tasks:
            await self.core.close()
            raise ModelError(f"vLLM cannot serve {self.card.display_name} for embeddings: its pooling tasks are "
                             f"{sorted(tasks)}, not 'embed'")

    async def close(self) -> None:
        await self.core.close()

    async def embed(self, inputs: list[EmbeddingInput], dimensions: int | None, ctx: Context) -> Embeddings:
        llm = self.core.llm
        if llm is None:
            raise EngineError("vllm embedding engine is not started")
        try:  # vLLM checks dimensions against the model (Matryoshka or not) when the request is added
            params = self._params(task="embed", dimensions=dimensions)
        except Exception as e:
            raise RequestError(f"vLLM rejected the pooling parameters: {one_line(e)}", param="dimensions") from None
        limit = self.card.context_length
        token_lists = []
        for i, item in enumerate(inputs):
            ids = self.tokenizer.hf.encode(item, add_special_tokens=True).ids if isinstance(item, str) else list(item)
            if len(ids) > limit:
                raise RequestError(f"input[{i}] has {len(ids)} tokens, more than the model's context ({limit})",
                                   param="input")
            token_lists.append(ids)
        base = f"{ctx.id}-{next(self._ids)}"
        tasks = [asyncio.ensure_future(self._one(llm, ids, params, f"{base}-{i}")) for i, ids in enumerate(token_lists)]
        try:
            vectors = await asyncio.gather(*tasks)
        except BaseException:  # one input failed (or we were cancelled): the others stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return Embeddings(list(vectors), sum(len(ids) for ids in token_lists))

    async def _one(self, llm: Any, ids: list[int], params: Any, rid: str) -> list[float]:
        final = None
        try:  # a client that goes away cancels us; vLLM's encode aborts the request then
            async for out in llm.encode(self._tokens_input(ids), params, rid):
                final = out
        except self._client_error as e:  # the request itself: dimensions this model does not have, ...
            param = getattr(e, "parameter", None) or ("dimensions" if params.dimensions is not None else None)
            raise RequestError(f"vLLM rejected the request: {one_line(e)}", param=param) from None
        except Exception as e:  # EngineDeadError, EngineGenerateError
            raise EngineError(f"vLLM failed: {one_line(e)}") from None
        if final is None or getattr(final, "error", None) is not None:
            raise EngineError(f"vLLM returned no embedding{': ' + str(final.error) if final is not None else ''}")
        return [float(v) for v in final.outputs.data.tolist()]


def create(cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None, extra_path: Path | None) -> VllmEmbeddingEngine:
    return VllmEmbeddingEngine(cfg, card, extra, extra_path)
