"""The engine bench's model shapes and token-id workloads: multi-turn chat, long documents
queried several times, more documents than the engine's cache holds, and a fresh engine."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama's geometry; its weights are drawn at random (no downloads)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def config_json(self, dtype: str, max_position_embeddings: int) -> dict[str, Any]:
        """A transformers ``config.json`` of a ``LlamaForCausalLM`` of this shape."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "initializer_range": 0.02, "torch_dtype": dtype, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 0,
        }

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


SHAPES = {
    # A prefill of 1k tokens takes about 0.1-0.2 s on the 2-core CI box: long enough that a
    # hit shows against recompute, short enough for the whole bench to take minutes.
    "tiny": Shape(4, 256, 4, 2, 64, 704, 4096),
    "small": Shape(8, 1024, 8, 2, 128, 2816, 32000),  # head_dim as the 8B's
    "8b": Shape(32, 4096, 32, 8, 128, 14336, 128256),  # Llama-3-8B
}


@dataclass(frozen=True, slots=True)
class WorkloadSize:
    """How long and how many of each workload's prompts (tokens; counts)."""

    conversations: int = 2
    turns: int = 4
    system_tokens: int = 512  # the chat's first prompt starts with this
    user_tokens: int = 64  # each turn's new user message
    answer_tokens: int = 32  # the previous turn's answer, carried into the next prompt
    documents: int = 2
    document_tokens: int = 1024
    questions: int = 3  # per document
    question_tokens: int = 32
    overflow_documents: int = 4  # more than the engine's cache holds (``engine_blocks``)
    overflow_passes: int = 2
    max_tokens: int = 16  # generated per request: the outputs compared

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadSize.{name} must be >= 1, got {getattr(self, name)}")
        if self.overflow_documents < 3:
            raise ValueError("WorkloadSize.overflow_documents must be >= 3: the engine's cache "
                             "holds two documents")

    def max_prompt_tokens(self) -> int:
        chat = self.system_tokens + self.turns * self.user_tokens
        chat += (self.turns - 1) * self.answer_tokens
        return max(chat, self.document_tokens + self.question_tokens)

    def engine_blocks(self, block_size: int, max_model_len: int) -> int:
        """The engine's KV cache in blocks: two and a quarter documents with their questions
        (and never less than one longest request), so the overflow workload's documents
        evict each other before they come round again."""
        per_document = -(-(self.document_tokens + self.question_tokens) // block_size)
        # vLLM keeps one block back (its null block) and needs max_model_len in the rest.
        return max(-(-max_model_len // block_size) + 1, per_document * 9 // 4)


QUICK = WorkloadSize(conversations=1, turns=2, system_tokens=256, user_tokens=32,
                     answer_tokens=16, documents=1, document_tokens=256, questions=2,
                     question_tokens=16, overflow_documents=3, overflow_passes=2, max_tokens=8)


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts in rounds: every configuration runs round i before any runs round i + 1."""

    name: str
    rounds: tuple[tuple[tuple[int, ...], ...], ...]

    def num_requests(self) -> int:
        return sum(len(r) for r in self.rounds)


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))  # 0-2: pad, bos, eos


def chat(size: WorkloadSize, vocab: int, seed: int = 1) -> Workload:
    """Each turn's prompt is the last turn's prompt, an answer and a new user message. The
    answers are fixed tokens, not the engine's, so every configuration sees the same prompts."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, size.system_tokens + size.user_tokens, vocab)
               for _ in range(size.conversations)]
    rounds = [tuple(prompts)]
    for _ in range(size.turns - 1):
        prompts = [p + _tokens(rng, size.answer_tokens + size.user_tokens, vocab)
                   for p in prompts]
        rounds.append(tuple(prompts))
    return Workload("chat", tuple(rounds))


def documents(size: WorkloadSize, vocab: int, seed: int = 2, name: str = "docs") -> Workload:
    """Round i asks every document its i-th question."""
    rng = random.Random(seed)
    docs = [_tokens(rng, size.document_tokens, vocab) for _ in range(size.documents)]
    return Workload(name, tuple(
        tuple(d + _tokens(rng, size.question_tokens, vocab) for d in docs)
        for _ in range(size.questions)))


def overflow(size: WorkloadSize, vocab: int, seed: int = 3) -> Workload:
    """More documents than the engine's cache holds, asked round-robin: by the time a
    document comes round again the engine has evicted it."""
    rng = random.Random(seed)
    docs = [_tokens(rng, size.document_tokens, vocab) for _ in range(size.overflow_documents)]
    return Workload("overflow", tuple(
        tuple(d + _tokens(rng, size.question_tokens, vocab) for d in docs)
        for _ in range(size.overflow_passes)))


def warm_workloads(size: WorkloadSize, vocab: int) -> tuple[Workload, ...]:
    """What every configuration's first engine runs, in this order."""
    return chat(size, vocab), documents(size, vocab), overflow(size, vocab)


def restart_workload(size: WorkloadSize, vocab: int) -> Workload:
    """The documents again, in a fresh engine (the daemon kept): an engine restart or a
    second replica."""
    return documents(size, vocab, name="restart")


def warmup_prompts(size: WorkloadSize, vocab: int) -> list[list[int]]:
    """Prompts each engine runs before any timed one (its first forward passes are slow),
    of tokens no workload uses (the bench's token ids start at 3; these are id 3 repeated,
    which random prompts never begin with 64 times)."""
    longest = size.max_prompt_tokens()
    return [[3] * longest, [3] * 64 + [4] * (size.question_tokens + 1)]
