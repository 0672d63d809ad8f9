"""Loglikelihoods computed in process with llama-cpp-python: the reference a served model's scores are
checked against (the lm-evaluation-harness tier).

The context is created as ``out=llamacpp`` creates its own (``engines/llamacpp/model.py``): the same GGUF,
``n_batch``/``n_ubatch`` 512, llama.cpp's default KV cache types, one sequence of the model's full context,
and flash attention on, as llama.cpp's default picks it on CPU (llama-cpp-python's ``Llama`` turns it off
unless told: with it off, SmolLM2's token logprobs move by up to 0.36).  Token ids are scored as given:
no BOS is added, so a request's ids and the reference's are the same ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class LlamaReference:
    def __init__(self, gguf: Path, n_ctx: int = 8192, flash_attn: bool = True):
        import llama_cpp

        self._llama = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                      flash_attn=flash_attn, logits_all=True, verbose=False)
        import numpy as np

        self._np = np

    def token_logprobs(self, ids: list[int]) -> list[tuple[float, bool]]:
        """For each token after the first: (its logprob given the ones before, whether it was the argmax)."""
        np = self._np
        llm = self._llama
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        m = logits.max(axis=1, keepdims=True)
        logp = logits - (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))
        out = []
        for i in range(1, len(ids)):
            row = logp[i - 1]
            out.append((float(row[ids[i]]), int(row.argmax()) == ids[i]))
        return out

    def loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """lm-eval's (sum of the continuation's logprobs, all of them greedy) for ``context + continuation``."""
        per = self.token_logprobs(context + continuation)[len(context) - 1:]
        return sum(lp for lp, _ in per), all(g for _, g in per)

    def greedy(self, ids: list[int], max_tokens: int, stop_ids: set[int]) -> list[int]:
        """The argmax continuation of ``ids``: up to ``max_tokens`` tokens, ending before a stop id."""
        np = self._np
        llm = self._llama
        llm.reset()
        llm.eval(ids)
        out: list[int] = []
        for _ in range(max_tokens):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if tok in stop_ids:
                break
            out.append(tok)
            llm.eval([tok])
        return out

    def close(self) -> None:
        self._llama.close()

    def __enter__(self) -> "LlamaReference":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
