"""The weights of the bench's random-weight engines, drawn inside the engine's own processes."""

from __future__ import annotations

from typing import Any

# vLLM's dummy loader fills every weight, norms included, with uniform values of about 1e-3:
# the logits come out nearly flat and greedy comparisons meet ties. The weights are drawn
# again at the usual init scale (transformers' Llama initializer_range) before any request.
INIT_STD = 0.02


def init_weights(model: Any, std: float = INIT_STD) -> int:
    """Norm weights to 1, every other parameter normal(0, ``std``), from one seeded generator
    per device, in name order (the same weights in every engine of a run); returns how many
    parameters were drawn."""
    import torch

    generators: dict[str, torch.Generator] = {}
    params = sorted(model.named_parameters(), key=lambda item: item[0])
    with torch.no_grad():
        for name, param in params:
            if "norm" in name:
                param.fill_(1.0)
                continue
            gen = generators.get(str(param.device))
            if gen is None:
                gen = generators[str(param.device)] = torch.Generator(param.device)
                gen.manual_seed(0)
            draw = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            param.copy_(draw.normal_(0.0, std, generator=gen))
    return len(params)
