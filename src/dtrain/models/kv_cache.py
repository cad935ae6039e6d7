"""The built-in GPT's key/value cache for generation: each attention layer's keys and values of
the tokens seen so far, so that each new token costs one position's work instead of the whole
sequence's. Nothing here is a module or a parameter: a model's state_dict is the same with it."""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values, (batch, heads, tokens, head_dim) each."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' keys and values after those held: all of them, now held."""
        if self.keys is not None and self.values is not None:
            keys = torch.cat((self.keys, keys), dim=2)
            values = torch.cat((self.values, values), dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def mask(self, new: int, causal: bool, device: torch.device) -> torch.Tensor | None:
        """Which keys (all held, the `new` last ones included) each of the `new` queries sees:
        every earlier one and, when `causal`, the new ones up to its own. None where a query
        sees every key (one new token, or not causal)."""
        if new == 1 or not causal:
            return None
        seen = torch.ones(new, self.length, dtype=torch.bool, device=device)
        return seen.tril(diagonal=self.length - new)


class KVCache:
    """Every attention layer's cache, in the model's order; `length`: the tokens held."""

    def __init__(self, depth: int) -> None:
        self.layers = [LayerCache() for _ in range(depth)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0
