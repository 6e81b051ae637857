"""KV cache and attention whose cost per step stays flat as rows and context grow.

Measured before this module (`python /tmp/i15/prof.py`-style torch profile of a bare decode step,
16 rows on a 1,024-token context, SmolLM2-135M, CPU): 78 % of the step was `aten::copy_` from the
key/value heads expanded to every query head (`repeat_kv` in eager attention) and 11 % `aten::cat`
from `DynamicCache` appending by concatenation — the whole cache copied per layer per step — against
5 % for the weights' matmuls. Two pieces remove both copies:

- `PreallocatedCache`: every layer's keys and values live in buffers sized once for the run (prompt
  plus max new tokens, rows x kv-heads x capacity x head-dim); a step writes its token in place and
  attention reads a view of the filled part. Rows leaving the batch are dropped by index selection,
  as with transformers' own caches (it is a `transformers.Cache` of `DynamicLayer` subclasses).
- `grouped_attention`: attention that reads the grouped key/value heads as they are — each
  key/value head is shared by its group of query heads through a reshape of the queries — instead
  of copying them to every query head; a forward of many tokens (a prefill) goes to torch's fused
  SDPA kernel with grouped heads. It is registered with transformers' `AttentionInterface` (with
  SDPA's boolean mask) and selected by name, so the model code is untouched.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from feedback.core import gemv
from feedback.strategies.base import pad_front

GROUPED = "feedback_grouped"


def grouped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """Attention without repeating key/value heads. query [B, H, Q, D]; key, value [B, Hkv, T, D];
    returns ([B, Q, H, D], weights [B, H, Q, T] or None) as transformers' attention functions do.

    A forward of many tokens (a prompt's prefill, a perplexity window) goes to torch's fused
    `scaled_dot_product_attention` with grouped heads: on CPU its flash kernel never builds the
    [Q, T] score matrix per head, which made long prompts 1.3-1.6 x slower than transformers' SDPA
    forward. A decode step (one token a row) stays on the eager product below, measured faster for
    one query and the kernel that keeps a row's logits the same in any batch."""
    if query.shape[2] > 1 and not (dropout and module.training):
        # no mask: no padding and no cached prefix (transformers' SDPA mask says so), so causal alone;
        # the kernel then skips the blocks above the diagonal
        out = nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            is_causal=attention_mask is None,
            scale=scaling,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None
    if not (dropout and module.training):
        out = compiled_attention(query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    return _eager_grouped(module, query, key, value, attention_mask, scaling, dropout)


def compiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor | None:
    """A decode step's attention ([B, H, 1, D] queries) by the compiled kernel (`attend.c`), as
    [B, 1, H, D]; None where it does not serve (not fp32 on CPU, no kernel on this machine, a mask
    that is not SDPA's boolean one). Each row's result is the same alone or in any batch, whatever
    the padding in front of it (the eager product's need not be), and it builds no [B, H, T] weights.
    Measured on the development CPU: the engine's 1-row step without it (and without the one-call
    layer and step that include it) took 1.242 x (`docs/results/decode_kernels.py`)."""
    lib = gemv.library()
    b, h, q, d = query.shape
    kv, t = key.shape[1], key.shape[2]
    tensors = (query, key, value)
    if (
        lib is None
        or q != 1
        or h % kv
        or any(x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1 for x in tensors)
    ):
        return None
    mask = keep_rows(attention_mask, t)
    if mask is None:
        return None
    keep, mask_stride = mask
    scratch = torch.empty(b * h * t)
    out = torch.empty(b, 1, h, d)
    lib.feedback_attend(
        query.data_ptr(), query.stride(0), query.stride(1),
        key.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
        value.data_ptr(), value.stride(0), value.stride(1), value.stride(2),
        None if keep is None else keep.data_ptr(), mask_stride,
        scratch.data_ptr(), out.data_ptr(), b, h, kv, t, d, scaling, torch.get_num_threads(),
    )  # fmt: skip
    return out


def keep_rows(attention_mask: torch.Tensor | None, t: int) -> tuple[torch.Tensor | None, int] | None:
    """SDPA's boolean mask of a decode step ([B or 1, 1, 1, t], True: attended) as rows of t for the
    compiled kernels, with their stride (0: one row for all); (None, 0) for no mask; None for a mask
    they do not read (additive, or of several queries)."""
    if attention_mask is None:
        return None, 0
    if attention_mask.dtype != torch.bool or attention_mask.shape[-2:] != (1, t):
        return None
    keep = attention_mask.reshape(attention_mask.shape[0], t)
    if keep.stride(-1) != 1:
        keep = keep.contiguous()
    return keep, keep.stride(0) if keep.shape[0] > 1 else 0


def _eager_grouped(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
):
    """Eager attention reading each key/value head for its group of query heads (a reshape of the queries)."""
    b, h, q, d = query.shape
    if attention_mask is None and q > 1:  # SDPA's "causal alone" (no padding, no cached prefix)
        attention_mask = torch.ones(q, key.shape[2], dtype=torch.bool, device=query.device).tril(
            key.shape[2] - q
        )
        attention_mask = attention_mask[None, None]
    kv = key.shape[1]
    g = h // kv
    grouped = query.reshape(b, kv, g * q, d)  # query heads h = kv_head * g + i, each g in a row
    scores = torch.matmul(grouped, key.transpose(2, 3)) * scaling
    scores = scores.view(b, kv, g, q, -1)
    if (
        attention_mask is not None
    ):  # boolean, True where a key is attended: [B, 1, Q, T], broadcast over heads
        scores = scores.masked_fill(~attention_mask[:, :, None], torch.finfo(scores.dtype).min)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.view(b, kv, g * q, -1), value).view(b, h, q, -1)
    return out.transpose(1, 2).contiguous(), weights.view(b, h, q, -1)


AttentionInterface.register(GROUPED, grouped_attention)
# SDPA's mask: boolean, or None where causal order alone is the mask (the fused kernel's fast path)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED, sdpa_mask)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of `capacity` positions, written in place; `keys`
    and `values` are views of the filled part (what `DynamicLayer` users read)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty(b, h, self.capacity, d)
        self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def appended(self) -> None:
        """One more position was written in place at `length` (by a compiled kernel)."""
        self.length += 1
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:  # never for an engine run (sized to it); grow, don't fail
            self.capacity = max(2 * self.capacity, self.length + n)
            self._k, self._v = self._grown(self._k), self._grown(self._v)
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def _grown(self, buf: torch.Tensor) -> torch.Tensor:
        """`buf` with room for `capacity` positions (its filled part kept)."""
        room = buf.new_empty(*buf.shape[:2], self.capacity - buf.shape[2], buf.shape[3])
        return torch.cat([buf, room], dim=2)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0
        self._k = self._v = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k, self._v = (
                self._k.repeat_interleave(repeats, dim=0),
                self._v.repeat_interleave(repeats, dim=0),
            )
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()


def appendable(
    cache: Cache, index: int, rows: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> PreallocatedLayer | None:
    """Layer `index` of `cache` where a decode step's compiled kernels can write one new token a
    row in place: a preallocated fp32 CPU cache of `rows` rows with room for it, and rotary cos and
    sin [rows or 1, 1, D] they can read; None otherwise."""
    if not isinstance(cache, PreallocatedCache) or cache.offloading or gemv.library() is None:
        return None
    layer = cache.layers[index]
    if not layer.is_initialized:
        return None
    d = layer._k.shape[-1]
    return layer if writable(layer, rows, kv_heads, d) and rotary_readable(cos, sin, rows, d) else None


def writable(layer: PreallocatedLayer, rows: int, kv_heads: int, d: int) -> bool:
    """Whether the compiled kernels can write one more token a row into `layer` in place: filled,
    with room, fp32 CPU buffers [rows, kv_heads, capacity, d]."""
    if not layer.is_initialized or layer.length >= layer.capacity:
        return False
    k, v = layer._k, layer._v
    return (
        k.shape == (rows, kv_heads, layer.capacity, d)
        and v.shape == k.shape
        and k.dtype == v.dtype == torch.float32
        and k.device.type == v.device.type == "cpu"
        and k.is_contiguous()
        and v.is_contiguous()
    )


def rotary_readable(cos: torch.Tensor, sin: torch.Tensor, rows: int, d: int) -> bool:
    """Whether the compiled kernels read these rotary tables: fp32 CPU [rows or 1, 1, d], rows of
    unit stride, cos and sin laid out alike."""
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (cos, sin))
        and cos.shape == sin.shape
        and cos.shape[1:] == (1, d)
        and cos.shape[0] in (1, rows)
        and cos.stride(-1) == 1
        and cos.stride() == sin.stride()
    )


def rope_append(
    cache: Cache,
    index: int,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: tuple[int, int, int],
) -> torch.Tensor | None:
    """A decode step's tail of the q/k/v projection in one compiled call (`attend.c`): the queries
    rotated and returned ([B, H, 1, D]), the keys rotated and the values written into layer `index`
    of a preallocated `cache` in place. The same bits as rotating with transformers' operations and
    `update`; None (and nothing written) where it does not serve: not one fp32 CPU token a row, not
    a preallocated cache with room (`appendable`), no kernel here. `heads`: (query heads, key/value
    heads, head size); `qkv` [B, 1, (H + 2 Hkv) D] as the fused projection gives it; cos, sin [B or
    1, 1, D]."""
    h, kv, d = heads
    b = qkv.shape[0]
    layer = appendable(cache, index, b, kv, cos, sin)
    if (
        layer is None
        or layer._k.shape[-1] != d
        or qkv.shape[1:] != (1, (h + 2 * kv) * d)
        or qkv.dtype != torch.float32
        or not qkv.is_contiguous()
    ):
        return None
    q = torch.empty(b, h, 1, d)
    k, v, slot = layer._k, layer._v, layer.length * d * 4  # the token's byte offset in a head's rows
    gemv.library().feedback_rope_append(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0) if cos.shape[0] > 1 else 0,
        q.data_ptr(), k.data_ptr() + slot, k.stride(0), k.stride(1),
        v.data_ptr() + slot, v.stride(0), v.stride(1), b, h, kv, d,
    )  # fmt: skip
    layer.appended()
    return q


class PreallocatedCache(Cache):
    """A cache for `capacity` positions per row, every layer preallocated on its first write."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])


CACHE_ENV = "FEEDBACK_KV_CACHE"  # "dynamic": transformers' growing cache (what ran before, for comparison)


def run_cache(config, capacity: int) -> Cache:
    """The cache for one engine run: preallocated where every layer attends to the whole sequence
    (sliding-window or other layer kinds keep transformers' own dynamic cache, as does
    FEEDBACK_KV_CACHE=dynamic)."""
    text = config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or os.environ.get(CACHE_ENV, "").strip().lower() == "dynamic":
        return DynamicCache(config=config)
    return PreallocatedCache(text.num_hidden_layers, capacity)


def row_kv(cache: Cache, row: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of one row's keys and values in every layer, from position `start` on (a left-padded
    row's padding left out)."""
    return [
        (layer.keys[row : row + 1, :, start:].clone(), layer.values[row : row + 1, :, start:].clone())
        for layer in cache.layers
    ]


def cache_from(config, kv: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> Cache:
    """A run cache holding `kv` (one (keys, values) per layer, as `row_kv` gives), room for `capacity`
    positions."""
    cache = run_cache(config, capacity)
    for index, (keys, values) in enumerate(kv):
        cache.update(keys, values, index)
    return cache


def shareable(config) -> bool:
    """Whether runs on this model can share decode steps: its run cache is preallocated (every layer
    attends to the whole sequence), whose rows can be stacked and re-padded (`stack_rows`). A
    sliding-window layer's cache keeps only its window, which no left padding can line up."""
    return isinstance(run_cache(config, 1), PreallocatedCache)


def stack_rows(parts: list[tuple[Cache, int]], room: int) -> PreallocatedCache:
    """One preallocated cache holding the rows of each (cache, shift) of `parts`, in order, every
    part's positions moved `shift` to the right (zeros in front, which the attention mask hides;
    a negative shift drops leading positions, which must be padding) so that all end at the same
    position; with room for `room` more positions."""
    widths = {cache.get_seq_length() + shift for cache, shift in parts}
    if len(widths) != 1:
        raise ValueError(f"stacked rows must end at one position, got {sorted(widths)}")
    (width,) = widths
    layers = len(parts[0][0].layers)
    out = PreallocatedCache(layers, width + room)
    for index in range(layers):
        keys, values = [], []
        for cache, shift in parts:
            layer = cache.layers[index]
            keys.append(pad_front(layer.keys, shift, 2))
            values.append(pad_front(layer.values, shift, 2))
        out.update(torch.cat(keys), torch.cat(values), index)
    return out
