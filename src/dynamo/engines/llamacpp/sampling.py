"""Choosing each sequence's next token for ``out=llamacpp``: llama.cpp sampler chains (logit bias, grammar,
penalties, top-k/top-p/min-p, temperature, seed), and the logprobs the client asked for.

Greedy requests without penalties skip llama.cpp's sampler (which copies the whole vocabulary into a
candidate array per token) and take the argmax of the logits with numpy: the same token, cheaper.

Logprobs are a log-softmax of the logits each token was sampled from, i.e. the model's raw distribution
(before logit_bias, grammar, penalties and temperature), as vLLM reports by default.  Guided decoding's
grammars come from grammar.py, checked by llama.cpp's parser when the request arrives.
"""

from __future__ import annotations

import os
from typing import Any

from dynamo.engines.llamacpp.grammar import gbnf_for
from dynamo.engines.llamacpp.model import Llama
from dynamo.errors import RequestError


class Samplers:
    """Makes the sampler chains of one loaded model (``seed``: the engine's default for sampled requests)."""

    def __init__(self, llama: Llama, seed: int | None):
        self.llama = llama
        self.seed = seed

    def grammar(self, guided: dict[str, Any] | None) -> str | None:
        """The request's grammar, checked by llama.cpp's parser now (a bad one is the client's 400)."""
        grammar = gbnf_for(guided)
        if grammar is not None:
            L = self.llama.L
            probe = L.llama_sampler_init_grammar(self.llama.vocab, grammar.encode(), b"root")
            if not probe:
                raise RequestError("llama.cpp cannot parse this grammar", param="guided_grammar")
            L.llama_sampler_free(probe)
        return grammar

    def make(self, so: Any, grammar: str | None = None) -> Any:
        """A sampler chain for a request's sampling options (free it with :meth:`free`)."""
        L = self.llama.L
        n_vocab = self.llama.n_vocab
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if so.logit_bias:
            biases = (L.llama_logit_bias * len(so.logit_bias))(
                *(L.llama_logit_bias(int(k), float(v)) for k, v in so.logit_bias.items()))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(n_vocab, len(biases), biases))
        if grammar is not None:  # the samplers after it only see tokens the grammar allows
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_grammar(self.llama.vocab, grammar.encode(), b"root"))
        temperature = 1.0 if so.temperature is None else so.temperature
        rep, freq, pres = so.repetition_penalty, so.frequency_penalty, so.presence_penalty
        if (rep not in (None, 1.0)) or freq or pres:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(
                n_vocab, 64, float(rep or 1.0), float(freq or 0.0), float(pres or 0.0)))
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if so.top_k and so.top_k > 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(int(so.top_k)))
        if so.top_p is not None and so.top_p < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(float(so.top_p), 1))
        if so.min_p:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(float(so.min_p), 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(float(temperature)))
        seed = so.seed if so.seed is not None else self.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF))
        return chain

    def free(self, sampler: Any) -> None:
        self.llama.L.llama_sampler_free(sampler)


def is_greedy(so: Any) -> bool:
    """Temperature 0 without penalties: the next token is the argmax of the logits."""
    return (so.temperature is not None and so.temperature <= 0 and so.repetition_penalty in (None, 1.0)
            and not so.frequency_penalty and not so.presence_penalty)


def logsumexp(np: Any, x: Any) -> Any:
    """log(sum(exp(x))) over the last axis, stable.  In float32 (numpy sums pairwise: about 1e-6 relative
    over 49k terms); float64 exponentials cost four times as much."""
    m = x.max(axis=-1, keepdims=True)
    return (np.log(np.exp(x - m).sum(axis=-1, keepdims=True)) + m).squeeze(-1)


def token_logprobs(np: Any, row: Any, token: int, n: int) -> tuple[float, list[dict[str, Any]]]:
    """The chosen token's logprob under one logits row and the ``n`` likeliest tokens' (log-softmax in
    numpy: a few tens of microseconds over a 49k vocabulary)."""
    lse = float(logsumexp(np, row))
    tops: list[dict[str, Any]] = []
    if n > 0:
        for t in np.argpartition(row, -n)[-n:].tolist():
            tops.append({"token_id": t, "logprob": float(row[t]) - lse})
    return float(row[token]) - lse, tops


def prompt_logprobs(np: Any, x: Any, following: list[int], n: int) -> list[dict[str, Any]]:
    """Each prompt token's logprob under the logits row of the position before it (``x``: one row per
    token of ``following``), with the ``n`` likeliest tokens' (vectorised over the chunk)."""
    count = len(following)
    lse = logsumexp(np, x)
    chosen = (x[np.arange(count), np.asarray(following)] - lse).tolist()
    top_ids = np.argpartition(x, -n, axis=1)[:, -n:] if n > 0 else None
    entries = []
    for i in range(count):
        tops = []
        if top_ids is not None:
            tops = [{"token_id": int(t), "logprob": float(x[i, t] - lse[i])} for t in top_ids[i]]
        entries.append({"logprob": chosen[i], "top_logprobs": tops})
    return entries
