"""The paged KV cache of hybrid models' attention layers: ``k``/``v`` ``[La, pages, page_size, Hkv, D]``.

Only the model runner (and the attention kernels) touch these tensors; which page is whose is the
``PageAllocator`` (``cache/pages.py``). Page ids start at 0; a block table row is padded with page 0,
which the kernels never read past a sequence's length.
"""

from __future__ import annotations

import torch

from mambaserve.server.cache.pages import PageAllocator


def page_bytes(num_attention_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
    """One page, every attention layer, K and V."""
    return 2 * num_attention_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> KVPool:
        """``num_pages`` pages of every attention layer of ``model`` (a hybrid), its KV heads on this rank."""
        a = model.attention_dims
        return cls(len(model.dims.attention_layers), num_pages, page_size, a.num_kv_heads, a.head_dim, dtype, device)

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def token_index(self, table: list[int], a: int, b: int, device) -> torch.Tensor:
        """Where tokens [a, b) of a sequence whose pages are ``table`` live in ``k``/``v`` viewed as
        ``[La, pages * page_size, Hkv, D]``."""
        ps = self.page_size
        return torch.tensor([table[p // ps] * ps + p % ps for p in range(a, b)], dtype=torch.long, device=device)

    def tokens_major(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` (``k`` or ``v``) as ``[pages * page_size, La, Hkv, D]``: one row per token slot (a view)."""
        layers, pages, ps = cache.shape[:3]
        return cache.view(layers, pages * ps, *cache.shape[3:]).transpose(0, 1)
