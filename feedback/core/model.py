"""Load a causal LM (embedded default, hub id, local folder or GGUF file) and find its decoder layers."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from feedback.core import embedded, lean, linear, threads
from feedback.errors import FeedbackError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Measured with `python -m feedback bench --dtypes` on the 2-core dev CPU (README, Performance): bf16
# decodes ~1.8x faster with sane greedy text, but its CPU matmuls round differently by batch size, so
# a row batched with others drifts from the same row alone (a greedy token flipped within 11 steps).
# fp32 keeps every exactness guarantee, so it is the CPU default; bf16 is opt-in (--dtype bfloat16).
CPU_AUTO_DTYPE = "float32"

# Attribute paths to the decoder-layer list, per architecture family.
_LAYER_PATHS = {
    "model.layers": "Llama, Mistral, Qwen2/3, Gemma, Phi, Phi-3, SmolLM, OLMo",
    "model.language_model.layers": "multimodal wrappers (Gemma 3, Llava-style)",
    "transformer.h": "GPT-2, GPT-J, Falcon, BLOOM",
    "gpt_neox.layers": "GPT-NeoX, Pythia",
    "model.decoder.layers": "OPT",
}


def _get_path(obj: object, path: str) -> object | None:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks, in order, or a clear error for an unknown architecture."""
    for path in _LAYER_PATHS:
        layers = _get_path(model, path)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    families = "; ".join(f"{p} ({f})" for p, f in _LAYER_PATHS.items())
    raise FeedbackError(
        f"unsupported architecture {type(model).__name__}: no decoder-layer list found; "
        f"supported layouts: {families}"
    )


def check_layer_state(model: nn.Module) -> None:
    """Refuse a model whose layers keep state other than attention keys and values (linear
    attention, state-space or convolution layers): the engine left-pads prompts into one batch and
    drops finished rows from its cache, which it does exactly only for key/value layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    kinds = sorted(
        {
            type(layer).__name__
            for layer in DynamicCache(config=model.config).layers
            if not isinstance(layer, DynamicLayer) or isinstance(layer, LinearAttentionCacheLayerMixin)
        }
    )
    if kinds:
        raise FeedbackError(
            f"unsupported architecture {type(model).__name__}: some of its layers keep a recurrent "
            f"state ({', '.join(kinds)}), not only attention keys and values; the engine batches "
            "and pads rows exactly only for attention layers"
        )


class TurnLock:
    """A lock handed over in arrival order: the thread that waited longest gets it next. Forwards on
    one model take turns at it, so a request scoring its answer chunk after chunk cannot keep the
    shared decode loop's step waiting for more than one of its chunks (a plain lock may go back to
    the thread that just released it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._line: deque[object] = deque()

    def acquire(self) -> bool:
        with self._cond:
            if not self._held and not self._line:
                self._held = True
                return True
            me = object()
            self._line.append(me)
            while self._held or self._line[0] is not me:
                self._cond.wait()
            self._line.popleft()
            self._held = True
            return True

    def release(self) -> None:
        with self._cond:
            if not self._held:
                raise RuntimeError("TurnLock.release of a lock that is not held")
            self._held = False
            self._cond.notify_all()

    def locked(self) -> bool:
        return self._held

    def __enter__(self) -> TurnLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class LoadedModel:
    """A model ready for the engine, with what the engine needs to know about it."""

    model: nn.Module
    tokenizer: object
    name: str
    dtype: str
    device: torch.device
    load_seconds: float = 0.0
    eos_token_ids: list[int] = field(default_factory=list)
    quantization: str | None = None  # how the weights are stored when not in `dtype` (8-bit, 4-bit)
    # the kernels chosen here, if any: the rows the compiled products take per linear shape
    # (`linear.use_kernels`) and for the decoder (`linear.use_step_kernels`), and how far ahead they
    # ask for weights (`linear.choose_ahead`)
    kernels: dict | None = None
    # the fp32 linear kernel it was loaded with (`linear.setting`), for `kernel_summary`
    linear_kernel: str = ""
    decode_threads: int | None = None  # threads for decode steps, measured fastest (`core.threads`)
    # Held for each forward pass: runs sharing this model interleave step by step, never overlap.
    forward_lock: TurnLock = field(default_factory=TurnLock, repr=False, compare=False)
    decoder: Any = field(default=None, repr=False, compare=False)  # its shared decode loop (core.sharing)

    @property
    def layers(self) -> nn.ModuleList:
        return decoder_layers(self.model)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def precision(self) -> str:
        """What the numbers are computed in, said where it trades exactness for speed."""
        if self.quantization:
            return f"fast, not bit-exact: {self.quantization}"
        if self.dtype in ("bfloat16", "float16"):
            return f"fast, not bit-exact: {self.dtype} weights"
        if self.device.type == "cpu" and torch.backends.mkldnn.matmul.fp32_precision == "bf16":
            return "fast, not bit-exact: bf16 matmuls on fp32 weights"
        return "exact: fp32"

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.get_text_config().hidden_size)

    @property
    def context_length(self) -> int:
        cfg = self.model.config.get_text_config()
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            if getattr(cfg, key, None):
                return int(getattr(cfg, key))
        return 2048

    def encode(
        self,
        prompt: str,
        chat_template: bool = True,
        system: str | None = None,
        messages: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a prompt — the newest user turn after `messages` (earlier turns) — through
        the model's chat template when asked and available."""
        return self.encode_with_span(prompt, None, chat_template, system, messages)[0]

    def encode_with_span(
        self,
        prompt: str,
        find: str | None,
        chat_template: bool = True,
        system: str | None = None,
        messages: list[dict] | None = None,
    ) -> tuple[list[int], tuple[int, int] | None]:
        """`encode`'s ids, and the token range [start, end) of the text `find` inside the newest user
        turn (its last occurrence there; tokens that overlap it count), or None where `find` is
        empty, not found (a template that rewrites content) or the tokenizer gives no offsets."""
        tok = self.tokenizer
        text, turns, special = self._render(prompt, chat_template, system, messages)
        needle = (find or "").strip()
        if needle:
            # the user turn ends where the assistant's header starts: the text is looked for before it
            turn_end = (
                len(tok.apply_chat_template(turns, add_generation_prompt=False, tokenize=False))
                if turns
                else len(text)
            )
            try:
                enc = tok(text, add_special_tokens=special, return_offsets_mapping=True)
            except (NotImplementedError, ValueError):  # a slow tokenizer has no offsets
                enc = None
            if enc is not None:
                span = _token_span(enc["offset_mapping"], text.rfind(needle, 0, turn_end), len(needle))
                return list(enc["input_ids"]), span
        return list(tok(text, add_special_tokens=special)["input_ids"]), None

    def _render(
        self, prompt: str, chat_template: bool, system: str | None, messages: list[dict] | None
    ) -> tuple[str, list[dict] | None, bool]:
        """The text the model reads, the chat turns it was rendered from (None without a template),
        and whether the tokenizer adds its special tokens (only without a template)."""
        tok = self.tokenizer
        if chat_template and getattr(tok, "chat_template", None):
            history = list(messages or [])
            head = (
                [{"role": "system", "content": system}]
                if system and not (history and history[0]["role"] == "system")
                else []
            )
            turns = head + history + [{"role": "user", "content": prompt}]
            return tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False), turns, False
        if messages:
            raise FeedbackError("a conversation (messages) needs the chat template; turn it on")
        return prompt, None, True

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().out_features)


def _token_span(offsets, start: int, length: int) -> tuple[int, int] | None:
    """The tokens whose characters overlap [start, start + length) (special tokens have empty offsets)."""
    if start < 0:
        return None
    end = start + length
    hits = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
    return (hits[0], hits[-1] + 1) if hits else None


def resolve_dtype(dtype: str, device: torch.device) -> str:
    if dtype == "auto":
        if device.type == "cuda":
            # a T4 "supports" bf16 only through emulation: fp16 is its native half type
            return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
        return CPU_AUTO_DTYPE
    if dtype not in DTYPES:
        raise FeedbackError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return dtype


RANDOM_PREFIX = "random:"


def resolve_source(spec: str | None) -> tuple[str, str]:
    """(kind, location) for a model spec: embedded, gguf file, local folder or hub id; or
    `random:<any of those>`: that model's configuration and tokenizer with random weights (seeded),
    for speed and exactness checks where its weights cannot be brought (a machine lent for minutes,
    without the network: a folder of config.json and the tokenizer's files is enough)."""
    if spec and spec.startswith(RANDOM_PREFIX):
        inner = spec[len(RANDOM_PREFIX) :] or embedded.EMBEDDED_NAME
        if inner.startswith(RANDOM_PREFIX):
            raise FeedbackError(f"model spec {spec!r}: one random: is enough")
        return "random", resolve_source(inner)[1]
    if spec in (None, "", embedded.EMBEDDED_NAME):
        return "embedded", str(embedded.prepare())
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise FeedbackError(f"GGUF file not found: {spec}")
        return "gguf", str(embedded.prepare(gguf=path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FeedbackError(f"{spec} is a folder but has no config.json; not a transformers model")
        return "local", str(path)
    if path.exists() or spec.startswith((".", "/", "~")):
        raise FeedbackError(f"model path not usable: {spec}")
    return "hub", spec


def _random_model(location: str, kwargs: dict) -> nn.Module:
    """The model of `location`'s configuration with random weights, the same on every machine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(location, trust_remote_code=kwargs.get("trust_remote_code", False))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, **{k: v for k, v in kwargs.items() if k != "local_files_only"}
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connect quickly (False when offline mode is set)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


# Model types whose eager attention is the plain one (no soft-capping, sinks or extra terms), so the
# grouped form in feedback/core/kvcache.py computes the same thing without copying key/value heads.
GROUPED_ATTENTION_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})


THREADS_ENV = "FEEDBACK_THREADS"
ATTENTION_ENV = "FEEDBACK_ATTENTION"  # e.g. eager or sdpa: overrides the automatic choice (for comparisons)
FAST_ENV = "FEEDBACK_FAST_MATMUL"


def set_fast_matmul(on: bool) -> None:
    """oneDNN bf16 matmuls for fp32 weights on CPU: faster, not bit-exact (opt-in, process-wide)."""
    torch.backends.mkldnn.matmul.fp32_precision = "bf16" if on else "none"


def set_threads() -> int:
    """torch's CPU threads: FEEDBACK_THREADS where set, else torch's default (one per physical
    core). Returns the count in use."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise FeedbackError(f"{THREADS_ENV} must be a positive whole number, got {raw!r}")
        torch.set_num_threads(int(raw))
    return torch.get_num_threads()


CHOICE_STEPS = 4  # decode steps a timing of the decoder kernels' choice takes


def _engine_step_seconds(model: nn.Module) -> Callable[[int], float]:
    """CPU seconds of a bare decode step of the given rows on the engine's cache (after 8 prompt
    tokens), as `linear.use_step_kernels` compares its kernels by."""
    ids = torch.arange(1, 9)[None]
    return lambda rows: threads.bare_step_seconds(
        model, ids, rows, CHOICE_STEPS, None, time.process_time, True
    )


def load_model(
    spec: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "auto",
    fast_matmul: bool | None = None,
    linear_kernel: str | None = None,
    lean_layers: bool | None = None,
) -> LoadedModel:
    """Load a model and tokenizer for the engine; user mistakes raise `FeedbackError`.
    `fast_matmul` (None: FEEDBACK_FAST_MATMUL): bf16 matmuls on fp32 weights, process-wide.
    `linear_kernel` (None: FEEDBACK_LINEAR, by default auto): fp32 linear layers on CPU through the
    kernels measured fastest here per shape, each exact for the rows it takes ("auto"), the compiled
    few-row kernel ("gemv"), oneDNN's ("onednn"), or PyTorch's own ("aten"); see
    `feedback.core.linear`. `lean_layers` (None: FEEDBACK_LEAN, by default on):
    Llama layers on CPU with fused projections, bit-identical (`feedback.core.lean`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would swamp CLI and test output
    set_threads()
    if fast_matmul is None:
        fast_matmul = os.environ.get(FAST_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    set_fast_matmul(fast_matmul)
    started = time.perf_counter()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FeedbackError("device 'cuda' requested but no CUDA GPU is available")
    dtype_name = resolve_dtype(dtype, dev)
    kwargs: dict = {"dtype": DTYPES[dtype_name], "trust_remote_code": trust_remote_code}
    attn_implementation = os.environ.get(ATTENTION_ENV, "").strip() or attn_implementation
    auto_attention = attn_implementation == "auto"
    if auto_attention:
        # On CPU, SDPA rounds differently per batch position (two identical rows drift ~3e-5 apart);
        # eager attention is batch-invariant at the same measured speed for this model size. It is
        # then replaced by its grouped form where the model's attention is the plain one (below).
        attn_implementation = "eager" if dev.type == "cpu" else None
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if load_in_4bit and load_in_8bit:
        raise FeedbackError("choose one of 4-bit and 8-bit loading, not both")
    cpu_bits = (8 if load_in_8bit else 4 if load_in_4bit else 0) if dev.type == "cpu" else 0
    if cpu_bits and dtype_name != "float32":
        raise FeedbackError(
            f"{cpu_bits}-bit weights on CPU compute in float32 around bf16 products: "
            "use dtype float32 or auto"
        )
    if (load_in_4bit or load_in_8bit) and not cpu_bits:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=load_in_4bit,
            load_in_8bit=load_in_8bit,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=DTYPES[dtype_name],
        )
        device_map = device_map or "auto"
    if device_map is not None:
        kwargs["device_map"] = device_map
        if max_memory:
            kwargs["max_memory"] = max_memory

    kind, location = resolve_source(spec)
    local_only = kind == "hub" and not _hub_reachable()
    if local_only:
        # huggingface_hub retries an unreachable hub for ~45 s; use the local cache or fail now.
        kwargs["local_files_only"] = True
    if kind == "random" and (device_map is not None or "quantization_config" in kwargs):
        raise FeedbackError("a random: model is built in place: no --device-map, no bitsandbytes weights")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            location, trust_remote_code=trust_remote_code, local_files_only=local_only
        )
        if kind == "random":
            model = _random_model(location, kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except Exception as exc:  # config, weights and tokenizer errors come in many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = " (the model hub is unreachable and it is not in the local cache)" if local_only else ""
        raise FeedbackError(f"could not load model {spec or 'embedded'!r}{hint}: {first}") from exc
    if device_map is None:
        model.to(dev)
    model.eval()
    decoder_layers(model)  # fail now, not mid-run, on an unsupported architecture
    check_layer_state(model)
    if auto_attention and dev.type == "cpu" and model.config.model_type in GROUPED_ATTENTION_MODELS:
        from feedback.core.kvcache import GROUPED

        model.set_attn_implementation(GROUPED)

    if dev.type == "cpu" and device_map is None and lean.wanted(lean_layers):
        # fused projections and inline norms, exact; parts dropped where quantised next
        lean.lean_layers(decoder_layers(model), keep_parts=not cpu_bits)
        lean.lean_stack(model)  # a Llama's decode steps: every layer in one compiled call
    quantization = kernels = None
    if cpu_bits:
        linear.quantize(model, cpu_bits)
        quantization = linear.INT8_LABEL if cpu_bits == 8 else linear.INT4_LABEL
    elif load_in_4bit or load_in_8bit:
        quantization = "bitsandbytes 4-bit NF4 weights" if load_in_4bit else "bitsandbytes 8-bit weights"
    kernel = linear.setting(linear_kernel)
    decoder = list(decoder_layers(model).modules())
    if linear.wanted(dev, kernel) and device_map is None:
        # the fp32 linear layers left (none in the int8 and int4 modes: they quantise the head too);
        # bf16 matmuls asked for are oneDNN's, which gemv (fp32 arithmetic) would bypass
        kernel = "onednn" if fast_matmul else kernel
        # first, as the timings below run with it
        ahead = linear.choose_ahead(decoder) if kernel in ("auto", "gemv") else None
        kernels = linear.use_kernels(model, kernel, stepped=decoder)
        kernels = (kernels or {}) | ({"weights ahead": ahead} if ahead else {}) or None
    if dev.type == "cpu" and device_map is None and (cpu_bits or kernel == "auto"):
        # the decoder's products: compiled up to the rows where the whole step is faster for them
        step = linear.use_step_kernels(decoder, _engine_step_seconds(model))
        kernels = (kernels or {}) | (step or {}) or None
    decode_threads = threads.chosen(model) if dev.type == "cpu" and device_map is None else None

    eos: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for tid in source if isinstance(source, (list, tuple)) else [source]:
            if tid is not None and int(tid) not in eos:
                eos.append(int(tid))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=spec or embedded.EMBEDDED_NAME,
        dtype=dtype_name,
        device=next(model.parameters()).device,
        load_seconds=time.perf_counter() - started,
        eos_token_ids=eos,
        quantization=quantization,
        kernels=kernels,
        linear_kernel=kernel,
        decode_threads=decode_threads,
    )
