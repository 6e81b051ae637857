"""A leaner decoder layer for Llama-family models on CPU: the same arithmetic in fewer, larger ops.

A decode step of a 135M-parameter model is ~210 small matrix products and ~1,000 small ops, and a
fifth of its time went to Python between them (module calls, keyword plumbing, temporaries). The
lean layer runs the same step with
- the query, key and value projections as one product, and the gate and up projections as one:
  the weights concatenated by output rows. Each output element is still the same dot product over
  the same inputs, so the result is bit-for-bit the separate products' (checked on oneDNN's and MKL's
  fp32 kernels at 1 to 66 rows; `tests/core/test_lean.py` compares logits exactly);
- the RMS norms and rotary embedding without a module call each. A decode step's few rows take
  compiled calls (`attend.c`) that round as transformers' operations round: the norm (used only
  where it gave PyTorch's bits on this machine) and, on the engine's preallocated cache, the rotation
  of q and k with the cache write in one call. Elsewhere they are transformers' own operations, in
  its order.

The layer keeps its class's call signature and stays the module strategies hook and re-run, so hooks
see the same hidden states. Only layers whose classes are exactly transformers' Llama ones are
changed (Llama, SmolLM): another family's layer code differs in small ways (biases, sliding windows,
norms on queries) that this code would not reproduce. The separate projections keep their weights as
views of the fused ones (no memory is added), or are dropped where the weights are quantised next.

`FEEDBACK_LEAN=0` keeps transformers' own layer code (for comparison in the bench).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from feedback.core import gemv, kvcache, linear, threads

LEAN_ENV = "FEEDBACK_LEAN"


def wanted(given: bool | None = None) -> bool:
    """The lean layer as `given` (a `load_model` argument), else unless FEEDBACK_LEAN says 0/false/no/off."""
    if given is not None:
        return given
    return os.environ.get(LEAN_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward`'s operations, in its order. In fp32, for a decode step's few rows, one
    compiled call that rounds as they do (`attend.c`; used only where it gave PyTorch's bits on this
    machine, `_norm_lanes`), else one call of torch's own RMS norm (the same ops in C++ without a
    Python call each). Both bit-for-bit transformers' norm (`tests/core/test_lean.py`)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        n, lib = x.shape[-1], gemv.library()
        if (
            lib is not None
            and x.numel() <= threads.DECODE_TOKENS * n  # a prefill's many rows: PyTorch's threaded ops
            and x.device.type == "cpu"
            and x.is_contiguous()
        ):
            eps = float(norm.variance_epsilon)
            lanes = _norm_lanes(n, eps)
            if lanes and norm.weight.is_contiguous():
                y = torch.empty_like(x)
                lib.feedback_rms_norm(
                    x.data_ptr(), norm.weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps, lanes
                )
                return y
        return nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


@functools.cache
def _norm_lanes(n: int, eps: float) -> int:
    """The vector width (16 or 8) with which the compiled norm of `n` values gives exactly PyTorch's
    RMS norm here, checked on rows of many scales (its sum must follow PyTorch's order, which
    depends on the CPU and PyTorch's build); 0 where neither does (PyTorch's own ops are used)."""
    lib = gemv.library()
    if lib is None or n < 16:  # shorter rows take another path in PyTorch's sum
        return 0
    gen = torch.Generator().manual_seed(n)  # not the global generator: sampling seeds stay as they were
    weight = torch.randn(n, generator=gen)
    rows = [torch.randn(3, n, generator=gen) * 10.0**p for p in range(-4, 5)]
    rows.append(torch.randn(3, n, generator=gen) ** 3)
    for lanes in (16, 8):
        for x in rows:
            y = torch.empty_like(x)
            lib.feedback_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], n, eps, lanes)
            if not torch.equal(y, nn.functional.rms_norm(x, (n,), weight, eps)):
                break
        else:
            return lanes
    return 0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb` for one tensor (cos and sin already broadcast over heads)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class LeanLlamaLayer(llama.LlamaDecoderLayer):
    """`LlamaDecoderLayer` with fused projections (`qkv`, `gate_up`) and inline norms and rotary."""

    qkv: nn.Module
    gate_up: nn.Module
    qkv_sizes: tuple[int, int, int]
    heads: tuple[int, int, int]  # query heads, key/value heads, head size

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        cache = kwargs.pop("past_key_values", cache)  # the name transformers still accepts
        kwargs = dict(kwargs, position_ids=position_ids, use_cache=use_cache)  # what attention gets
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.self_attn.config._attn_implementation, llama.eager_attention_forward
        )
        h = None
        if attend is kvcache.grouped_attention and cache is not None:
            h = self._decode_attention(hidden_states, cache, position_embeddings, attention_mask)
        if h is None:
            h = hidden_states + self._attention(
                hidden_states, cache, position_embeddings, attend, attention_mask, kwargs
            )
        x = _norm(self.post_attention_layernorm, h)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return h + self.mlp.down_proj(self.mlp.act_fn(gate) * up)

    def _attention(
        self, hidden_states, cache, position_embeddings, attend, attention_mask, kwargs
    ) -> torch.Tensor:
        """The attention block's output (before the residual add), op by op."""
        attn = self.self_attn
        x = _norm(self.input_layernorm, hidden_states)
        qkv = self.qkv(x)
        cos, sin = position_embeddings
        q = None
        if attend is kvcache.grouped_attention and cache is not None:  # a decode step: one compiled call
            q = kvcache.rope_append(cache, attn.layer_idx, qkv, cos, sin, self.heads)
        if q is not None:
            k, v = cache.layers[attn.layer_idx].keys, cache.layers[attn.layer_idx].values
        else:
            heads = (*x.shape[:-1], -1, attn.head_dim)
            q, k, v = (t.view(heads).transpose(1, 2) for t in qkv.split(self.qkv_sizes, dim=-1))
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if cache is not None:
                k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        out, _ = attend(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
        return attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())

    def _decode_attention(
        self, hidden_states, cache, position_embeddings, attention_mask
    ) -> torch.Tensor | None:
        """A decode step's attention block with its residual add, in one compiled call
        (`feedback_attention_block`: the norm, q/k/v product, rotation and cache write, attention,
        output product and add that `_attention` takes op by op, the same kernels, the same bits);
        None where that call does not serve (then nothing is written): not the engine's cache, more
        rows than gemv takes in both products, a hook on the norm or a projection, no kernel here."""
        attn, norm, qkv, o_proj = self.self_attn, self.input_layernorm, self.qkv, self.self_attn.o_proj
        rows, width = hidden_states.shape[0], hidden_states.shape[-1]
        heads, kv_heads, d = self.heads
        cos, sin = position_embeddings
        layer = kvcache.appendable(cache, attn.layer_idx, rows, kv_heads, cos, sin)
        if (
            layer is None
            or hidden_states.shape[1:] != (1, width)
            or hidden_states.dtype != torch.float32
            or norm.weight.dtype != torch.float32
            or not hidden_states.is_contiguous()
            or not all(type(m) is linear.GemvLinear and rows <= m.gemv_rows for m in (qkv, o_proj))
            or _hooked(norm, qkv, o_proj)
        ):
            return None
        lanes, mask = (
            _norm_lanes(width, float(norm.variance_epsilon)),
            kvcache.keep_rows(attention_mask, layer.length + 1),
        )
        if not lanes or mask is None or not norm.weight.is_contiguous():
            return None
        keep, mask_stride = mask
        t = layer.length + 1
        scratch = torch.empty(rows * ((heads + 2 * kv_heads) * d + 2 * heads * d + width + heads * t))
        out = torch.empty_like(hidden_states)
        k, v = layer._k, layer._v

        def ptr(x: torch.Tensor | None) -> int | None:
            return None if x is None else x.data_ptr()

        gemv.library().feedback_attention_block(
            hidden_states.data_ptr(), out.data_ptr(), rows, width,
            norm.weight.data_ptr(), float(norm.variance_epsilon), lanes,
            qkv.weight.data_ptr(), ptr(qkv.bias),
            cos.data_ptr(), sin.data_ptr(), cos.stride(0) if cos.shape[0] > 1 else 0,
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), layer.length,
            ptr(keep), mask_stride, o_proj.weight.data_ptr(), ptr(o_proj.bias),
            heads, kv_heads, d, attn.scaling, scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        layer.appended()
        return out


def _hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook (of these modules', or every module's) would see a call of them."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in modules
    )


def _leanable(layer: nn.Module) -> bool:
    return (
        type(layer) is llama.LlamaDecoderLayer
        and type(layer.self_attn) is llama.LlamaAttention
        and type(layer.mlp) is llama.LlamaMLP
        and type(layer.input_layernorm) is llama.LlamaRMSNorm
        and type(layer.post_attention_layernorm) is llama.LlamaRMSNorm
        and not layer.training
    )


def _fuse(owner: nn.Module, names: tuple[str, ...], keep_parts: bool) -> nn.Linear:
    """One `nn.Linear` whose weight (and bias) are the named projections' stacked by output rows;
    the projections then hold views of it (`keep_parts`) or are removed."""
    parts = [getattr(owner, n) for n in names]
    weight = torch.cat([p.weight.detach() for p in parts])
    biases = [p.bias for p in parts]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    # buffers left out of the state dict: the model saves and counts its weights as the parts, as
    # transformers lays them out (a part is then a view of these, not a second copy)
    for name, value in (("weight", weight), ("bias", bias)):
        del fused._parameters[name]
        fused.register_buffer(name, value, persistent=False)
    start = 0
    for name, part in zip(names, parts):
        rows = part.out_features
        if keep_parts:
            part.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                part.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            part.folded = True  # not called by the layer: no kernel of its own to choose
        else:
            setattr(owner, name, None)
        start += rows
    return fused


def lean_layers(layers: nn.ModuleList, keep_parts: bool = True) -> int:
    """Each Llama decoder layer of `layers` as a `LeanLlamaLayer` in place (same parameters, hooks
    and call signature); returns how many. `keep_parts=False` drops the separate q/k/v and gate/up
    projections (for weights quantised next, so their fp32 copies are freed)."""
    count = 0
    for layer in layers:
        if not _leanable(layer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        sizes = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        with torch.no_grad():
            layer.qkv = _fuse(attn, ("q_proj", "k_proj", "v_proj"), keep_parts)
            layer.gate_up = _fuse(mlp, ("gate_proj", "up_proj"), keep_parts)
        layer.qkv_sizes = sizes
        layer.heads = (sizes[0] // attn.head_dim, sizes[1] // attn.head_dim, attn.head_dim)
        layer.__class__ = LeanLlamaLayer
        count += 1
    return count
