"""transformers' layer hooks: forward hooks on the token embedding and every decoder layer
of an open :class:`~logitdiff.sources.hf.HFSource` (:mod:`.layer_hooks`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .layer_families import Family


class HFLayers:
    """A transformers source's per-layer hidden states, a window of tokens at a time over a
    KV cache; ``split``: each window in two forward passes (the floor's other layout)."""

    engine = "hf"

    def __init__(self, source, family: Family, *, split: bool = False):
        self.src = source
        self.split = split
        cfg = source.config
        self.family = family
        self.layers = list(source.base.layers)
        self.n_layer = len(self.layers)
        self.hidden = int(cfg.hidden_size)
        self.modules = ([source.base.embed_tokens] if self.family.embedding else []) + self.layers
        self._kw: dict = {}

    def begin(self) -> None:
        self._kw = {}

    def close(self) -> None:
        self._kw = {}

    def window(self, tokens: Sequence[int], n_past: int, sel: np.ndarray):
        """Hidden states ``[points, len(sel), H]`` float32 and logits ``[len(sel), V]``
        float32 at the window's rows ``sel`` (indices into ``tokens``, sorted)."""
        import torch

        n = len(tokens)
        self.src._check_len(n_past + n, "per-layer scoring")
        out = np.empty((len(self.modules), len(sel), self.hidden), np.float32)
        logits = np.empty((len(sel), self.src.vocab_size), np.float32)
        cuts = [0, n // 2, n] if self.split and n >= 2 else [0, n]
        dev = self.src.device
        for a, b in zip(cuts, cuts[1:]):
            lo, hi = np.searchsorted(sel, a), np.searchsorted(sel, b)
            here = torch.as_tensor(sel[lo:hi] - a, device=dev)

            def hook(j):
                def keep(module, args, output):
                    h = output[0] if isinstance(output, tuple) else output
                    out[j, lo:hi] = h[0, here].float().cpu().numpy()
                return keep

            handles = [m.register_forward_hook(hook(j)) for j, m in enumerate(self.modules)]
            try:
                with torch.inference_mode():
                    o = self.src.base(input_ids=torch.tensor([list(tokens[a:b])], device=dev), use_cache=True, **self._kw)
                    self._kw = self.src._cache_kw(o)
                    if hi > lo:
                        logits[lo:hi] = self.src._head(o.last_hidden_state[0, here]).float().cpu().numpy()
            finally:
                for h in handles:
                    h.remove()
        return out, logits


