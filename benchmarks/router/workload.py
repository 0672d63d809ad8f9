"""The router benchmark's workload: groups of users sharing a system prompt, multi-turn conversations.

Everything is decided up front from a seed, so every router mode gets exactly the same prompts in the
same order at the same offsets (only the follow-up turns depend on when the previous answer ended):

* ``groups`` system prompts of ``round(prefix_ratio * isl)`` tokens each (none at ratio 0: the chat
  template's short default system prompt, less than one KV block, is then the only shared text);
* conversations start at Poisson times (rate ``rate / turns``, open loop: a start never waits for the
  server) during ``duration`` seconds; each belongs to a random group;
* turn 1 is the group's system prompt plus a unique user message, ``isl`` tokens in all (with
  ``system_words``, the system prompt is that many random words and the user message ``turn_tokens``);
* with ``clients`` > 0 the load is a closed loop instead: that many clients each run one conversation
  after another (taken in order from a pool drawn up front) until ``duration`` has passed;
* with ``clients`` and ``interleave``, conversations interleave instead, as many users' do behind a
  fixed number of connections: a free client sends one of the follow-up turns whose think time is
  over, picked at random, else the pool's next conversation.  Without it, each client carries
  one conversation at a time, and two clients alternating under round-robin keep each conversation on
  one worker by accident (a cache hit no real router could count on);
* turn k > 1 resends the whole history: the previous messages, the assistant's answer to turn k-1 and a
  new user message of ``turn_tokens`` tokens; it is sent ``think_time`` seconds (exponential mean) after
  the previous turn's stream ended.  The answer in the history is, by default, a fixed synthetic text of
  ``osl`` tokens, not the mocker's output (random token ids, which would make the prompts differ between
  modes).  With ``real_answers`` it is what the model said, as every chat client sends it back: the
  requests are then greedy (``temperature: 0``), so both modes get the same answers to the same prompts
  (batched decoding can change a last bit, rarely a token), and an engine that kept the answer's KV
  (llama.cpp's slot does) reuses it on the next turn.  A synthetic answer the model never produced is a
  part of every follow-up that no cache can hold, which makes a history hit cost more than it does for
  a real chat client.

Token counts are exact for the message texts (byte-level BPE does not merge across the spaces between
words, so the tokens of a text are the sum of its words' tokens); the chat template adds a few.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class WorkloadConfig:
    prefix_ratio: float = 0.9
    isl: int = 4096  # tokens of a first turn (system + user), before the chat template
    groups: int = 32
    turns: int = 3
    turn_tokens: int = 256  # tokens of each later user message
    osl: int = 64  # max_tokens of every request (and tokens of the synthetic answer in the history)
    rate: float = 6.0  # requests per second on average (conversations start at rate / turns)
    duration: float = 40.0  # seconds during which conversations start
    think_time: float = 1.0  # mean seconds between an answer and the next turn
    seed: int = 0
    system_words: int = 0  # > 0: system prompts of this many words (not prefix_ratio x isl tokens)
    clients: int = 0  # > 0: closed loop, this many clients each running conversations back to back
    interleave: bool = False  # with clients: any free client sends any conversation's next ready turn
    real_answers: bool = False  # the history carries the model's answers (greedy requests), not synthetic ones


@dataclass
class Conversation:
    cid: int
    group: int
    start: float  # offset of turn 1 from the start of the run, seconds
    users: list[str] = field(default_factory=list)  # user message of each turn
    answers: list[str] = field(default_factory=list)  # synthetic answer of each turn but the last
    thinks: list[float] = field(default_factory=list)  # pause before each turn after the first
    system: str | None = None

    def messages(self, turn: int, answers: list[str] | None = None) -> list[dict[str, str]]:
        """The chat messages of turn ``turn`` (0-based): the history, then the new user message.  ``answers``
        replaces the synthetic answers (the model's own, collected by the client)."""
        said = self.answers if answers is None else answers
        msgs: list[dict[str, str]] = []
        if self.system is not None:
            msgs.append({"role": "system", "content": self.system})
        for k in range(turn):
            msgs.append({"role": "user", "content": self.users[k]})
            msgs.append({"role": "assistant", "content": said[k]})
        msgs.append({"role": "user", "content": self.users[turn]})
        return msgs


class TextMaker:
    """Random texts of an exact number of tokens for one tokenizer."""

    def __init__(self, tokenizer: Any, rng: random.Random, pool: int = 4000):
        self.rng = rng
        words = {"".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9))) for _ in range(pool)}
        self.words: list[tuple[str, int]] = []
        for w in sorted(words):
            n = len(tokenizer.encode(" " + w, add_special_tokens=False).ids)
            self.words.append((w, n))
        self.singles = [w for w, n in self.words if n == 1]
        assert self.singles, "tokenizer has no one-token words"

    def words_text(self, words: int) -> str:
        """``words`` random words (as many tokens as the tokenizer makes of them)."""
        return " ".join(self.rng.choice(self.words)[0] for _ in range(words))

    def text(self, tokens: int) -> str:
        out: list[str] = []
        left = tokens
        while left > 0:
            w, n = self.rng.choice(self.words)
            if n > left:
                w, n = self.rng.choice(self.singles), 1
            out.append(w)
            left -= n
        return " ".join(out)


def build(cfg: WorkloadConfig, tokenizer: Any) -> list[Conversation]:
    """The conversations of a run.  Open loop: each with its start offset.  Closed loop
    (``cfg.clients``): a pool the clients take from in order, more than they can use (start 0)."""
    rng = random.Random(cfg.seed)
    maker = TextMaker(tokenizer, random.Random(cfg.seed + 1))
    if cfg.system_words > 0:
        systems: list[str | None] = [maker.words_text(cfg.system_words) for _ in range(cfg.groups)]
        first_user = cfg.turn_tokens
    else:
        sys_tokens = int(round(cfg.prefix_ratio * cfg.isl))
        systems = [maker.text(sys_tokens) if sys_tokens > 0 else None for _ in range(cfg.groups)]
        first_user = max(1, cfg.isl - sys_tokens)
    conv_rate = cfg.rate / max(1, cfg.turns)
    convs: list[Conversation] = []
    # closed loop: enough conversations for clients that each finish one every 50 ms
    pool = int(cfg.duration * 20 * cfg.clients / max(1, cfg.turns)) + cfg.clients if cfg.clients > 0 else 0
    t = 0.0 if pool else rng.expovariate(conv_rate)
    while (len(convs) < pool) if pool else (t < cfg.duration):
        c = Conversation(len(convs), rng.randrange(cfg.groups), t)
        c.system = systems[c.group]
        c.users.append(maker.text(first_user))
        for _ in range(1, cfg.turns):
            c.answers.append(maker.text(cfg.osl))
            c.users.append(maker.text(cfg.turn_tokens))
            c.thinks.append(rng.expovariate(1.0 / cfg.think_time) if cfg.think_time > 0 else 0.0)
        convs.append(c)
        if not pool:
            t += rng.expovariate(conv_rate)
    return convs
