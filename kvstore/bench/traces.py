"""Request traces for the policy benchmark: the Mooncake FAST'25 JSONL format and synthetic
generators (multi-turn chat, long-document QA, agentic branching trees, a no-reuse stream).

A trace is a list of requests, each a prompt named by hash ids: one id per 512-token unit of
the prompt, equal ids meaning an equal prefix up to and including that unit (Mooncake's
convention; the last unit may be partial). The generators write the same form, so a replayed
file and a generated trace go through one path.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey

UNIT_TOKENS = 512  # tokens per Mooncake hash id


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one per UNIT_TOKENS of the prompt, the last may be partial


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[Request, ...]


def block_keys(request: Request, block_tokens: int) -> list[BlockKey]:
    """Keys of the request's full ``block_tokens`` blocks (a trailing partial block is not
    stored, as the store does): block j of unit u is named by (u's id, j)."""
    per_unit = UNIT_TOKENS // block_tokens
    num_blocks = min(request.input_tokens, len(request.hash_ids) * UNIT_TOKENS) // block_tokens
    return [BlockKey(request.hash_ids[b // per_unit].to_bytes(8, "little", signed=True)
                     + (b % per_unit).to_bytes(8, "little")) for b in range(num_blocks)]


def load_mooncake(path: str | Path) -> Trace:
    """A Mooncake trace file: one ``{"timestamp": ms, "input_length", "output_length",
    "hash_ids"}`` object a line; named by the file's name."""
    path = Path(path)
    requests = []
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(Request(float(row["timestamp"]) / 1000.0,
                                        int(row["input_length"]), int(row["output_length"]),
                                        tuple(int(h) for h in row["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"{path}:{number}: not a Mooncake trace line ({exc})"
                                      ) from None
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(path.name, tuple(requests))


class _Prompt:
    """A growing prompt as hash-id units; extending a partial unit gives it a new id."""

    def __init__(self, ids: Iterator[int], units: list[tuple[int, int]] | None = None) -> None:
        self._ids = ids
        self.units = list(units or [])  # (id, tokens in the unit)

    def extended(self, num_tokens: int) -> _Prompt:
        units = list(self.units)
        if units and units[-1][1] < UNIT_TOKENS:
            _, used = units.pop()
            take = min(num_tokens, UNIT_TOKENS - used)
            units.append((next(self._ids), used + take))
            num_tokens -= take
        while num_tokens > 0:
            take = min(num_tokens, UNIT_TOKENS)
            units.append((next(self._ids), take))
            num_tokens -= take
        return _Prompt(self._ids, units)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.units)

    def request(self, arrival_s: float, output_tokens: int) -> Request:
        return Request(arrival_s, self.num_tokens, output_tokens,
                       tuple(i for i, _ in self.units))


def _ids(start: int = 1) -> Iterator[int]:
    i = start
    while True:
        yield i
        i += 1


def chat(num_sessions: int = 150, duration_s: float = 600.0, seed: int = 0) -> Trace:
    """Multi-turn chat: 4 shared system prompts (1.5-4k tokens, skewed popularity), sessions of
    1-12 turns (about 4), each turn the whole history plus a new message, 5-60 s apart."""
    rng = random.Random(seed)
    ids = _ids()
    systems = [_Prompt(ids).extended(rng.randint(1536, 4096)) for _ in range(4)]
    requests = []
    for _ in range(num_sessions):
        prompt = rng.choices(systems, weights=(8, 4, 2, 1))[0]
        t = rng.uniform(0, duration_s)
        for _turn in range(min(12, 1 + int(rng.expovariate(1 / 3.0)))):
            prompt = prompt.extended(rng.randint(30, 400))
            output = rng.randint(50, 600)
            requests.append(prompt.request(t, output))
            prompt = prompt.extended(output)
            t += rng.uniform(5, 60)
    return Trace("chat", tuple(sorted(requests, key=lambda r: r.arrival_s)))


def doc_qa(num_docs: int = 24, num_questions: int = 500, rate_per_s: float = 1.0,
           seed: int = 0) -> Trace:
    """Long-document QA: a 1k-token instruction, then one of ``num_docs`` documents of about
    20k tokens (Zipf popularity, s = 1), then a short question of its own."""
    rng = random.Random(seed)
    ids = _ids()
    instruction = _Prompt(ids).extended(1024)
    docs = [instruction.extended(rng.randint(19_000, 21_000)) for _ in range(num_docs)]
    weights = [1.0 / (rank + 1) for rank in range(num_docs)]
    requests, t = [], 0.0
    for _ in range(num_questions):
        t += rng.expovariate(rate_per_s)
        doc = rng.choices(docs, weights=weights)[0]
        requests.append(doc.extended(rng.randint(20, 200)).request(t, rng.randint(20, 300)))
    return Trace("doc-qa", tuple(requests))


def agentic(num_tasks: int = 40, duration_s: float = 600.0, seed: int = 0) -> Trace:
    """Agentic branching trees: a shared 3k-token tool preamble and a task (1-3k tokens), then
    steps that each append a tool result (300-3000 tokens) to their parent's prompt and branch
    into 1-3 children, up to 6 deep, issued 1-8 s after their parent."""
    rng = random.Random(seed)
    ids = _ids()
    preamble = _Prompt(ids).extended(3072)
    requests = []
    for _ in range(num_tasks):
        frontier = [(preamble.extended(rng.randint(1000, 3000)), rng.uniform(0, duration_s), 0)]
        while frontier:
            prompt, t, depth = frontier.pop()
            requests.append(prompt.request(t, rng.randint(50, 400)))
            if depth == 6:
                continue
            width = rng.choices((0, 1, 2, 3), weights=(1, 6, 2, 1))[0] if depth else 2
            for _ in range(width):
                frontier.append((prompt.extended(rng.randint(300, 3000)),
                                 t + rng.uniform(1, 8), depth + 1))
    return Trace("agentic", tuple(sorted(requests, key=lambda r: r.arrival_s)))


def no_reuse(num_requests: int = 400, rate_per_s: float = 1.0, seed: int = 0) -> Trace:
    """Unique prompts of 1-16k tokens: nothing is ever used twice."""
    rng = random.Random(seed)
    ids = _ids()
    requests, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate_per_s)
        tokens = int(math.exp(rng.uniform(math.log(1024), math.log(16384))))
        requests.append(_Prompt(ids).extended(tokens).request(t, rng.randint(50, 500)))
    return Trace("no-reuse", tuple(requests))


SYNTHETIC = {"chat": chat, "doc-qa": doc_qa, "agentic": agentic, "no-reuse": no_reuse}
