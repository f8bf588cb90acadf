"""What the benchmark sends: conversations of user turns, and when each request arrives.

Every workload is a list of conversations. A synthetic request is a one-turn
conversation; a multi-turn conversation resends its whole history (with the replies
the server really gave) at each turn, which is what makes its prefix shareable. All
randomness comes from a seeded `random.Random`, so a seed gives the same prompts and
the same arrival schedule on every machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

# Short common words: most are one token in BPE vocabularies, so a prompt of N words
# is roughly N prompt tokens (the report uses the token counts the server returns).
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "team minute idea kid body back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education"
).split()

WORKLOADS = ("synthetic", "multi-turn")


@dataclass(frozen=True)
class LengthRange:
    """An inclusive range of lengths, written `N` or `MIN:MAX` on the command line."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        parts = text.replace("-", ":").split(":")
        try:
            values = [int(part) for part in parts]
        except ValueError:
            raise ValueError(f"{text!r} is not a length: write N or MIN:MAX, e.g. 128 or 64:256") from None
        if len(values) == 1:
            values *= 2
        if len(values) != 2 or not 1 <= values[0] <= values[1]:
            raise ValueError(f"{text!r} is not a length range: write N or MIN:MAX with 1 <= MIN <= MAX")
        return cls(values[0], values[1])

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass
class Conversation:
    """User turns to send in order; `messages` grows with each reply the server gives."""

    user_turns: list[str]
    max_tokens: list[int]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def turn(self) -> int:
        """Index of the next turn to send."""
        return sum(1 for message in self.messages if message["role"] == "assistant")

    @property
    def done(self) -> bool:
        return self.turn >= len(self.user_turns)

    def next_request(self) -> tuple[list[dict[str, Any]], int]:
        """The messages and max_tokens of the next turn: the history plus the new user turn."""
        turn = self.turn
        return [*self.messages, {"role": "user", "content": self.user_turns[turn]}], self.max_tokens[turn]

    def record_reply(self, reply: str) -> None:
        """Append the turn just sent and the server's reply, so the next turn resends both."""
        turn = self.turn
        self.messages += [{"role": "user", "content": self.user_turns[turn]}, {"role": "assistant", "content": reply}]


def random_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def synthetic(count: int, input_len: LengthRange, output_len: LengthRange, seed: int | str) -> list[Conversation]:
    """`count` independent one-turn requests of random words."""
    rng = random.Random(seed)
    return [Conversation([random_text(rng, input_len.draw(rng))], [output_len.draw(rng)]) for _ in range(count)]


def multi_turn(
    conversations: int, turns: int, input_len: LengthRange, output_len: LengthRange, seed: int | str
) -> list[Conversation]:
    """`conversations` chats of `turns` turns; each turn adds `input_len` new words."""
    rng = random.Random(seed)
    return [
        Conversation(
            [random_text(rng, input_len.draw(rng)) for _ in range(turns)], [output_len.draw(rng) for _ in range(turns)]
        )
        for _ in range(conversations)
    ]


def arrival_times(count: int, rate: float, seed: int | str) -> list[float]:
    """Seconds from the start at which each request is due: a Poisson process of `rate` per second.

    Gaps are exponential with mean 1/rate; an infinite rate sends everything at once.
    """
    if rate <= 0:
        raise ValueError(f"a request rate must be positive, not {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times
