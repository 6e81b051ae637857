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

import ctypes
import dataclasses
import functools
import os
import weakref

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers import activations
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from feedback.core import gemv, kvcache, linear, threads

try:  # what transformers' forward can record (`output_hidden_states`, …), registered by class name
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as _RECORDABLE
except ImportError:  # another transformers: its model body keeps its own class
    _RECORDABLE = None

LEAN_ENV = "FEEDBACK_LEAN"
# PyTorch splits an elementwise op of more values than this between its threads, each part with its
# own vector loop and scalar tail; the compiled SiLU takes one part only (where PyTorch runs one)
SILU_GRAIN = 32768
# the activations that are `nn.functional.silu` of their input (transformers' own, for "silu")
SILU = tuple(t for t in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if t is not None)


def wanted(given: bool | None = None) -> bool:
    """The lean layer as `given` (a `load_model` argument), else unless FEEDBACK_LEAN says 0/false/no/off."""
    if given is not None:
        return given
    return os.environ.get(LEAN_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`LlamaRMSNorm.forward`'s operations, in its order. In fp32, for a decode step's few rows, one
    compiled call that rounds as they do (`attend.c`; used only where it gave PyTorch's bits on this
    machine, `_norm_lanes`), else one call of torch's own RMS norm (the same ops in C++ without a
    Python call each). Both bit-for-bit transformers' norm (`tests/core/test_lean.py`). A hooked
    norm is called as a module, so its hooks see the call."""
    if _hooked(norm):
        return norm(x)
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


@functools.cache
def _silu_block() -> int:
    """The split (32 or 16 values: two of PyTorch's vectors with AVX-512 or AVX2) at which the
    compiled SiLU gives exactly PyTorch's here, checked on a million values of many scales and on
    short lengths of values whose two ways round apart, so the split shows; 0 where neither does
    (PyTorch's SiLU is used). On the development machine the compiled SiLU gave PyTorch's bits for
    every fp32 value."""
    lib = gemv.library()
    if lib is None:
        return 0
    gen = torch.Generator().manual_seed(0)  # not the global generator: sampling seeds stay as they were
    values = torch.cat([torch.randn(1 << 17, generator=gen) * 2.0**p for p in range(-8, 8, 2)])
    edges = [0.0, -0.0, 88.0, -88.0, 100.0, 101.0, -103.9, -104.5, 1e30, -1e30, float("inf"), float("-inf")]
    values = torch.cat([values, torch.tensor(edges)])
    vector, scalar = values.clone(), values.clone()
    lib.feedback_silu(vector.data_ptr(), values.numel(), 8)  # every value by the vector loop
    lib.feedback_silu(scalar.data_ptr(), values.numel(), values.numel() + 1)  # every value by expf
    apart = values[vector != scalar]
    pieces = list(values.split(SILU_GRAIN // 2)) + [apart[:n] for n in (48, 40, 24)]
    for block in (32, 16):
        for x in pieces:
            got = x.clone()
            lib.feedback_silu(got.data_ptr(), got.numel(), block)
            if not torch.equal(got.view(torch.int32), nn.functional.silu(x).view(torch.int32)):
                break
        else:
            return block
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
        h, whole = None, False
        if attend is kvcache.grouped_attention and cache is not None:
            h, whole = self._decode(hidden_states, cache, position_embeddings, attention_mask)
        if h is None:
            h = hidden_states + self._attention(
                hidden_states, cache, position_embeddings, attend, attention_mask, kwargs
            )
        if whole:
            return h
        x = _norm(self.post_attention_layernorm, h)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        # SiLU over the gate's rows laid side by side, as transformers' separate gate product gives
        # them: PyTorch's kernel splits a tensor between its vector and scalar loops by position,
        # and the two round some values differently (a strided view would split each row)
        return h + self.mlp.down_proj(self.mlp.act_fn(gate.contiguous()) * up)

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

    def _decode(
        self, hidden_states, cache, position_embeddings, attention_mask
    ) -> tuple[torch.Tensor | None, bool]:
        """A decode step of this layer in one compiled call (`feedback_decoder_stack` over it alone):
        the whole layer where both halves serve, else the attention half with its residual add; the
        same kernels `_attention` and `forward` take op by op, so the same bits. Returns the output
        and whether the MLP half is in it, or (None, False) where the call does not serve (then
        nothing is written)."""
        if not self._compiled(hidden_states.shape[0]):  # first, as it costs least (many rows stop here)
            return None, False
        step = _step(self, hidden_states, cache, position_embeddings, attention_mask)
        entry = None if step is None else self._entry(step, cache)
        if entry is None:
            return None, False
        out = torch.empty_like(hidden_states)
        _run(step, [entry], hidden_states, out)
        cache.layers[self.self_attn.layer_idx].appended()
        return out, bool(entry.gate_up.w)

    def _compiled(self, rows: int, mlp: bool = False) -> bool:
        """Whether a compiled kernel takes both of the attention half's products at `rows` rows (and
        the MLP's): gemv's for fp32 weights, quant.c's for the quantised modes' (their `matrix()`)."""
        parts = (self.qkv, self.self_attn.o_proj) + ((self.gate_up, self.mlp.down_proj) if mlp else ())
        return all(linear.compiled_rows(m) >= rows for m in parts)

    def _attention_parts(self) -> tuple[nn.Module, ...]:
        """The attention half's modules whose calls the compiled step skips (a hook on one needs
        that half op by op)."""
        return (self.input_layernorm, self.qkv, self.self_attn, self.self_attn.o_proj)

    def _mlp_parts(self) -> tuple[nn.Module, ...]:
        """The MLP half's modules whose calls the compiled step skips."""
        mlp = self.mlp
        return (self.post_attention_layernorm, self.gate_up, mlp, mlp.down_proj, mlp.act_fn)

    def _parts(self) -> tuple[nn.Module, ...]:
        """The layer and each part whose module call the compiled step skips (a hook on any of them
        needs the layer called as a module)."""
        return (self, *self._attention_parts(), *self._mlp_parts())

    def _entry(self, step: gemv.Step, cache) -> gemv.Layer | None:
        """This layer's part of a decode step's compiled call (`gemv.Layer`), its MLP left out
        (`gate_up.w` None) where that half does not serve; None where the attention half does not:
        its cache is not at the step's position with room for the token, a product gemv does not
        take, a hook on the norm or a projection, a norm that would not give PyTorch's bits."""
        attn, norm, qkv, o_proj = self.self_attn, self.input_layernorm, self.qkv, self.self_attn.o_proj
        layer = cache.layers[attn.layer_idx]
        if (
            layer.length != step.at
            or not kvcache.writable(layer, step.rows, step.kv_heads, step.d)
            or not self._compiled(step.rows)
            or not _norm_ready(norm, step)
            or _hooked(*self._attention_parts())
        ):
            return None
        entry = gemv.Layer(
            norm_w=norm.weight.data_ptr(), qkv=qkv.matrix(), o=o_proj.matrix(),
            k=layer._k.data_ptr(), v=layer._v.data_ptr(),
            kb=layer._k.stride(0), kh=layer._k.stride(1), vb=layer._v.stride(0), vh=layer._v.stride(1),
            eps=norm.variance_epsilon, scale=attn.scaling,
        )  # fmt: skip
        mlp, norm = self.mlp, self.post_attention_layernorm
        gate_up, down = self.gate_up, mlp.down_proj
        if (
            step.silu_block
            and type(mlp.act_fn) in SILU
            and down.in_features == step.inter
            and (step.rows * step.inter <= SILU_GRAIN or step.threads == 1)
            and self._compiled(step.rows, mlp=True)
            and _norm_ready(norm, step)
            and not _hooked(*self._mlp_parts())
        ):
            entry.post_norm_w, entry.post_eps = norm.weight.data_ptr(), norm.variance_epsilon
            entry.gate_up, entry.down = gate_up.matrix(), down.matrix()
        return entry


@dataclasses.dataclass
class _Plan:
    """A decode run's compiled-call entries (`LeanLlamaModel._plan`): for the run whose cache
    `cache` refers to (weakly: the plan keeps no buffer alive), at the step sizes `key`, with each
    layer's modules whose hook would need the layer called as a module (`parts`)."""

    cache: weakref.ref
    key: tuple
    entries: ctypes.Array  # every layer's, a zeroed one where `whole` is False
    whole: tuple[bool, ...]  # whether the layer's both halves serve (else it is called as a module)
    parts: tuple[tuple[nn.Module, ...], ...]  # each layer's `_parts`
    indices: tuple[int, ...]  # each entry's layer in the cache


class LeanLlamaModel(llama.LlamaModel):
    """`LlamaModel` whose decode steps run their layers and the final norm in compiled calls
    (`feedback_decoder_stack`), each call a run of consecutive layers that nothing watches: one new
    token a row on the engine's preallocated cache with grouped attention, every such layer's both
    halves served by the kernels (`LeanLlamaLayer._entry`). A layer with a hook on it or a part of
    it (a strategy's) is called as a module between the calls, as transformers' loop calls it, so
    its hooks run where they would. The embedding, mask and rotary tables are transformers' own, as
    its forward makes them, and the kernels are the ones each layer's `_decode` takes, so the output
    is the same bits. Any other forward is transformers' own, through the lean layers."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        cache = kwargs.pop("past_key_values", cache)  # the name transformers still accepts
        if not kwargs and use_cache and input_ids is not None and inputs_embeds is None:
            hidden = self._decode_stack(input_ids, attention_mask, position_ids, cache)
            if hidden is not None:
                return llama.BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache)
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

    def _decode_stack(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor | None:
        """The final norm's output for a decode step run in compiled calls, or None (nothing written)."""
        layers = list(self.layers)[: self.config.num_hidden_layers]  # (a ModuleList's slice builds a new one)
        if (
            self.training
            or self.config.output_hidden_states  # transformers' forward records each layer's output
            or self.config.output_attentions
            or input_ids.ndim != 2
            or input_ids.shape[1] != 1
            or not isinstance(cache, kvcache.PreallocatedCache)
            or self.config._attn_implementation != kvcache.GROUPED
            or not layers
            or not all(type(layer) is LeanLlamaLayer for layer in layers)
            or not layers[0]._compiled(input_ids.shape[0], mlp=True)  # (many rows)
        ):
            return None
        embeds = self.embed_tokens(input_ids)
        if position_ids is None:  # as transformers' forward makes them
            position_ids = (torch.arange(1, device=embeds.device) + cache.get_seq_length()).unsqueeze(0)
        mask = llama.create_causal_mask(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(embeds, position_ids=position_ids)
        step = _step(layers[0], embeds, cache, position_embeddings, mask)
        plan = None if step is None or not step.silu_block else self._plan(layers, step, cache)
        ready = None if plan is None else self._ready(plan, step, cache)
        if ready is None:
            return None
        # in turn: each run of ready layers in one compiled call, each other layer as a module
        final = not _hooked(self.norm) and _norm_ready(self.norm, step)
        h, i, n = embeds, 0, len(layers)
        while i < n:
            if not ready[i]:
                h = layers[i](
                    h,
                    attention_mask=mask,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=True,
                )
                i += 1
                continue
            j = i + 1
            while j < n and ready[j]:
                j += 1
            out, last = torch.empty_like(h), j == n and final
            _run(step, plan.entries, h, out, final=self.norm if last else None, first=i, count=j - i)
            for index in plan.indices[i:j]:
                cache.layers[index].appended()
            if last:
                return out
            h, i = out, j
        return _norm(self.norm, h)

    def _plan(self, layers, step: gemv.Step, cache) -> _Plan | None:
        """Every layer's `_entry` for this step, or None where no layer's both halves serve. Built at
        a run's first step (~26 µs a layer) and kept while the run's cache and the step's sizes stay:
        within a run the layers' parts and weights stay, so each later step checks only what can
        change between steps (`_ready`)."""
        plan = self.__dict__.get("_decode_plan")
        key = (step.rows, step.width, step.lanes, step.silu_block, step.inter, step.threads)
        if plan is not None and plan.cache() is cache and plan.key == key:
            return plan
        entries = [layer._entry(step, cache) for layer in layers]
        whole = tuple(e is not None and bool(e.gate_up.w) for e in entries)
        if not any(whole):
            return None
        plan = _Plan(
            cache=weakref.ref(cache),
            key=key,
            entries=(gemv.Layer * len(entries))(*(e if w else gemv.Layer() for e, w in zip(entries, whole))),
            whole=whole,
            parts=tuple(layer._parts() for layer in layers),
            indices=tuple(layer.self_attn.layer_idx for layer in layers),
        )
        self.__dict__["_decode_plan"] = plan
        return plan

    def _ready(self, plan: _Plan, step: gemv.Step, cache) -> list[bool] | None:
        """Which layers this step's compiled calls take: those whose both halves serve and that no
        hook watches, their cache at the step's position with room (buffers that moved, after rows
        dropped or room grown, are read again); None where none is."""
        held_layers, ready = cache.layers, []
        for whole, parts, index, entry in zip(plan.whole, plan.parts, plan.indices, plan.entries):
            held = held_layers[index]
            if not whole or _hooked(*parts):
                ready.append(False)
                continue
            if held.length != step.at or held.length >= held.capacity:
                return None
            if held._k.data_ptr() != entry.k or held._v.data_ptr() != entry.v:
                if not kvcache.writable(held, step.rows, step.kv_heads, step.d):
                    return None
                entry.k, entry.v = held._k.data_ptr(), held._v.data_ptr()
                entry.kb, entry.kh, entry.vb, entry.vh = *held._k.stride()[:2], *held._v.stride()[:2]
            ready.append(True)
        return ready if any(ready) else None


def _step(
    first: LeanLlamaLayer, hidden_states, cache, position_embeddings, attention_mask
) -> gemv.Step | None:
    """What every layer of a decode step shares, for the compiled call (`gemv.Step`), with `first`
    the first layer it runs; None where the call does not serve: no kernel here, not one fp32 token
    a row on the engine's preallocated cache, rotary tables or a mask the kernels do not read, a
    norm width whose PyTorch sum order the compiled norm does not follow here."""
    lib = gemv.library()
    if lib is None or not isinstance(cache, kvcache.PreallocatedCache) or cache.offloading:
        return None
    rows, width = hidden_states.shape[0], hidden_states.shape[-1]
    heads, kv_heads, d = first.heads
    cos, sin = position_embeddings
    if (
        hidden_states.shape[1:] != (1, width)
        or hidden_states.dtype != torch.float32
        or hidden_states.device.type != "cpu"
        or not hidden_states.is_contiguous()
        or not kvcache.rotary_readable(cos, sin, rows, d)
    ):
        return None
    at = cache.layers[first.self_attn.layer_idx].length
    lanes, mask = (
        _norm_lanes(width, float(first.input_layernorm.variance_epsilon)),
        kvcache.keep_rows(attention_mask, at + 1),
    )
    if not lanes or mask is None:
        return None
    keep, mask_stride = mask
    return gemv.Step(
        rows=rows, width=width, heads=heads, kv_heads=kv_heads, d=d, lanes=lanes,
        inter=first.mlp.down_proj.in_features, silu_block=_silu_block(),
        cos=cos.data_ptr(), sin=sin.data_ptr(), cs=cos.stride(0) if cos.shape[0] > 1 else 0, at=at,
        keep=_ptr(keep), mb=mask_stride, threads=torch.get_num_threads(),
    )  # fmt: skip


def _norm_ready(norm: nn.Module, step: gemv.Step) -> bool:
    """Whether the compiled norm gives this norm's bits with the step's summing width."""
    w = norm.weight
    return (
        w.dtype == torch.float32
        and w.is_contiguous()
        and w.shape == (step.width,)
        and _norm_lanes(step.width, float(norm.variance_epsilon)) == step.lanes
    )


def _run(
    step: gemv.Step, entries, hidden: torch.Tensor, out: torch.Tensor, final=None, first: int = 0, count=None
) -> None:
    """`feedback_decoder_stack`: `count` layers of `entries` (`gemv.Layer`s, listed or in an array;
    None: all) from the `first` in turn, from `hidden` to `out`, then the model's final norm
    `final` (or none)."""
    lib = gemv.library()
    array = entries if isinstance(entries, ctypes.Array) else (gemv.Layer * len(entries))(*entries)
    count = len(array) - first if count is None else count
    layers = ctypes.addressof(array) + first * ctypes.sizeof(gemv.Layer)
    scratch = torch.empty(lib.feedback_stack_scratch(step))
    final_w, final_eps = (None, 0.0) if final is None else (final.weight.data_ptr(), final.variance_epsilon)
    lib.feedback_decoder_stack(
        step, layers, count, hidden.data_ptr(), out.data_ptr(), final_w, final_eps, scratch.data_ptr()
    )


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


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


def lean_stack(model: nn.Module) -> bool:
    """`model`'s Llama body (itself, or its `.model`) as a `LeanLlamaModel` in place, where it is
    exactly transformers' `LlamaModel` and every decoder layer is lean (`lean_layers` first);
    whether it now is one."""
    body = model if isinstance(model, llama.LlamaModel) else getattr(model, "model", None)
    if type(body) is LeanLlamaModel:
        return True
    if (
        _RECORDABLE is None
        or type(body) is not llama.LlamaModel
        or not all(type(layer) is LeanLlamaLayer for layer in body.layers)
    ):
        return False
    recordable = _RECORDABLE.get(body)  # the new class must record what the old one did
    body.__class__ = LeanLlamaModel
    if recordable:
        _RECORDABLE[body] = recordable
    return True
