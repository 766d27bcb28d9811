"""Multi-turn chat against a running kvstore daemon, with a tiny random-weight Llama.

Each turn's prompt is the whole conversation so far, so every turn after the first reuses the
previous turns' K/V from kvstore. Per turn it prints the prompt tokens, the tokens reused by
tier and the time to first token with kvstore and without it (a plain prefill of the same
prompt). Nothing is downloaded: the model comes from a config and the tokenizer is built here.

    kvstore serve &                        # or: make serve
    python examples/multi_turn_chat.py --turns 4 [--address unix:///path/to/kvstore.sock]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

from kvstore.client import Client
from kvstore.integrations.transformers import wrap

VOCAB = 1000


def tiny_chat_model() -> tuple[LlamaForCausalLM, Tokenizer]:
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval(), tokenizer


def user_message(rng: random.Random, num_words: int) -> str:
    return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(num_words))


def plain_ttft_s(model: LlamaForCausalLM, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="daemon address (default: its socket)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--words-per-turn", type=int, default=300)
    parser.add_argument("--reply-tokens", type=int, default=32)
    args = parser.parse_args()

    model, tokenizer = tiny_chat_model()
    rng = random.Random(0)
    history: list[int] = []
    with Client(args.address) as client:
        chat = wrap(model, client, revision=f"demo-{time.time_ns()}")  # a fresh namespace
        print(f"{'turn':>4} {'prompt':>7} {'reused':>7}  {'by tier':<22} "
              f"{'ttft kvstore':>12} {'ttft plain':>10}")
        for turn in range(1, args.turns + 1):
            history += tokenizer.encode(user_message(rng, args.words_per_turn)).ids
            ids = torch.tensor([history])
            out = chat.generate(ids, max_new_tokens=args.reply_tokens, do_sample=False)
            stats = chat.last_stats
            tiers = ", ".join(f"{t}={n}" for t, n in stats.reused_tokens_per_tier.items()) or "-"
            print(f"{turn:>4} {stats.num_prompt_tokens:>7} {stats.num_reused_tokens:>7}  "
                  f"{tiers:<22} {stats.ttft_s * 1e3:>9.1f} ms "
                  f"{plain_ttft_s(model, ids) * 1e3:>7.1f} ms")
            history = out[0].tolist()  # the reply joins the conversation
        chat.close()


if __name__ == "__main__":
    main()
