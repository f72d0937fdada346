"""The transformers reference path's cache (`DynamicCache`): the surgery tests use to compare the
reference forward (`NemotronLabsDiffusionModel.forward`) with the runtime's."""

from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]


def crop(cache: DynamicCache, n: int) -> None:
    """Keep the first `n` positions of every layer."""
    for layer in _layers(cache):
        if layer.keys.shape[-2] > n:
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]


def keep(cache: DynamicCache, positions: torch.Tensor | list[int]) -> None:
    """Keep exactly `positions` (ordered) of every layer, in that order.

    Example: a cache of length 7 after keep([0, 1, 2, 4, 6]) has length 5 and holds what were
    positions 0, 1, 2, 4, 6 (the prefix plus an accepted tree path).
    """
    idx = torch.as_tensor(positions, dtype=torch.long)
    for layer in _layers(cache):
        i = idx.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, i)
        layer.values = layer.values.index_select(-2, i)


def commit(cache: DynamicCache, prefix_len: int, accepted: torch.Tensor | list[int]) -> None:
    """After a forward over new tokens: keep the prefix plus `accepted` offsets into the new part.

    Equivalent to keep(prefix + accepted) but copies only the accepted rows, never the prefix;
    a contiguous run starting at 0 is a plain crop.
    """
    acc = [int(a) for a in accepted]
    end = prefix_len + len(acc)
    if acc != list(range(len(acc))):
        # only the new tail moves: gather the accepted rows into place, then crop
        idx = torch.tensor(acc, dtype=torch.long) + prefix_len
        with torch.inference_mode():  # runtime caches hold inference tensors
            for layer in _layers(cache):
                i = idx.to(layer.keys.device)
                layer.keys[..., prefix_len:end, :] = layer.keys.index_select(-2, i)
                layer.values[..., prefix_len:end, :] = layer.values.index_select(-2, i)
    crop(cache, prefix_len + len(acc))


@contextmanager
def read_only(cache: DynamicCache):
    """Run forwards that read the cache but leave no K/V behind."""
    n = length(cache)
    try:
        yield cache
    finally:
        crop(cache, n)
