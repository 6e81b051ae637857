"""Model loading and architecture discovery (feedback/core/model.py); tiny models are built locally."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from feedback.core.model import (
    CPU_AUTO_DTYPE,
    DTYPES,
    LoadedModel,
    decoder_layers,
    load_model,
    resolve_dtype,
    resolve_source,
)
from feedback.errors import FeedbackError

N_LAYERS = 3  # not a default of any config below, so a match means the config was honoured
_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=N_LAYERS,
    num_attention_heads=4,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def _build(arch: str) -> tuple[nn.Module, str]:
    """A tiny random model of one family, and the attribute path of its decoder-layer list."""
    import transformers as tf

    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON, num_key_value_heads=2)), "model.layers"
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**_COMMON, num_key_value_heads=2)), "model.layers"
    if arch == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_COMMON, num_key_value_heads=2)), "model.layers"
    if arch == "gemma":
        cfg = tf.GemmaConfig(**_COMMON, num_key_value_heads=1, head_dim=8)
        return tf.GemmaForCausalLM(cfg), "model.layers"
    if arch == "phi":
        return tf.PhiForCausalLM(tf.PhiConfig(**_COMMON)), "model.layers"
    if arch == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(**_COMMON)), "model.layers"
    if arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=128,
            n_embd=32,
            n_layer=N_LAYERS,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
        return tf.GPT2LMHeadModel(cfg), "transformer.h"
    if arch == "gpt_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**_COMMON)), "gpt_neox.layers"
    if arch == "opt":
        cfg = tf.OPTConfig(
            vocab_size=128,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=1,
        )
        return tf.OPTForCausalLM(cfg), "model.decoder.layers"
    raise AssertionError(arch)


def _attr(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    "arch", ["llama", "mistral", "qwen2", "gemma", "phi", "phi3", "gpt2", "gpt_neox", "opt"]
)
def test_decoder_layers_per_architecture(arch):
    torch.manual_seed(0)
    model, path = _build(arch)
    model.eval()
    layers = decoder_layers(model)
    assert isinstance(layers, nn.ModuleList)
    assert layers is _attr(model, path)
    assert len(layers) == N_LAYERS == model.config.get_text_config().num_hidden_layers

    # the list found is the one the forward pass runs through, once per layer, in order
    seen: list[int] = []
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: seen.append(i)) for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    finally:
        for h in handles:
            h.remove()
    assert seen == list(range(N_LAYERS))


def test_decoder_layers_multimodal_wrapper_layout():
    class LanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = LanguageModel()

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

    w = Wrapper()
    assert decoder_layers(w) is w.model.language_model.layers


class MyStrangeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])  # top level: not a known layout


class EmptyLayersNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()


class PlainListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.blocks = nn.ModuleList([nn.Linear(4, 4)])


@pytest.mark.parametrize(
    "module",
    [nn.Linear(3, 3), MyStrangeNet(), EmptyLayersNet(), PlainListNet()],
    ids=lambda m: type(m).__name__,
)
def test_decoder_layers_unknown_architecture(module):
    with pytest.raises(FeedbackError) as info:
        decoder_layers(module)
    msg = str(info.value)
    assert type(module).__name__ in msg
    assert "\n" not in msg


# ---------------------------------------------------------------- LoadedModel


def test_loaded_model_properties(tiny_lm):
    assert tiny_lm.num_layers == 4
    assert tiny_lm.layers is tiny_lm.model.model.layers
    assert tiny_lm.hidden_size == 64
    assert tiny_lm.context_length == 512


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_encode_with_chat_template(embedded_lm):
    tok = embedded_lm.tokenizer
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = embedded_lm.encode("What is 2+2?")
    assert ids.count(im_start) == 3  # default system turn, user turn, assistant header
    assert im_end in ids
    header = _ids(tok, "<|im_start|>assistant\n")
    assert header[0] == im_start
    assert ids[-len(header) :] == header
    assert _ids(tok, "What is 2+2?") == ids[ids.index(im_start, 1) + 3 :][: len(_ids(tok, "What is 2+2?"))]
    text = tok.decode(ids)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text


def test_encode_with_system_prompt(embedded_lm):
    tok = embedded_lm.tokenizer
    ids = embedded_lm.encode("Hi", system="Answer in French.")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")
    assert "SmolLM" not in text  # the template's default system prompt is replaced


def test_encode_without_chat_template(embedded_lm):
    tok = embedded_lm.tokenizer
    prompt = "What is 2+2?"
    ids = embedded_lm.encode(prompt, chat_template=False)
    assert ids == list(tok(prompt)["input_ids"])
    assert not set(ids) & set(tok.all_special_ids)
    assert tok.decode(ids) == prompt


def test_encode_falls_back_when_tokenizer_has_no_template(embedded_lm):
    tok = copy.deepcopy(embedded_lm.tokenizer)
    tok.chat_template = None
    lm = LoadedModel(
        model=embedded_lm.model, tokenizer=tok, name="x", dtype="float32", device=torch.device("cpu")
    )
    assert lm.encode("Hello there") == list(tok("Hello there")["input_ids"])


# ---------------------------------------------------------------- resolve_dtype / resolve_source


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == CPU_AUTO_DTYPE
    assert CPU_AUTO_DTYPE in DTYPES
    for name in DTYPES:
        assert resolve_dtype(name, cpu) == name
    for bad in ("fp8", "float64", "int8", "", "Float32"):
        with pytest.raises(FeedbackError, match="unknown dtype"):
            resolve_dtype(bad, cpu)


def test_resolve_source_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FeedbackError, match="GGUF"):
        resolve_source(str(tmp_path / "missing.gguf"))
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(FeedbackError):
        resolve_source(str(tmp_path / "dir.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeedbackError, match="config.json"):
        resolve_source(str(tmp_path / "empty"))
    for spec in ("./nope", "../nope-xyz", "/definitely/not/here", "~/not-here-xyz-123"):
        with pytest.raises(FeedbackError):
            resolve_source(spec)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(FeedbackError):
        resolve_source(str(tmp_path / "weights.bin"))


def test_resolve_source_local_and_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_source(str(model_dir)) == ("local", str(model_dir))
    assert resolve_source("org/model") == ("hub", "org/model")
    assert resolve_source("gpt2") == ("hub", "gpt2")


def test_resolve_source_embedded_uses_prepared_cache():
    from feedback.core import embedded

    kind, location = resolve_source("embedded")
    assert kind == "embedded"
    assert location == str(embedded.cached_model_dir())
    assert resolve_source(None) == (kind, location)


# ---------------------------------------------------------------- load_model


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_quantised_weights_on_cpu_need_fp32_and_bitsandbytes_needs_cuda():
    for bits in (8, 4):  # refused before any download
        with pytest.raises(FeedbackError, match=f"{bits}-bit weights on CPU compute in float32"):
            load_model("org/whatever", dtype="bfloat16", **{f"load_in_{bits}bit": True})
    with pytest.raises(FeedbackError, match="no CUDA GPU"):
        load_model("org/whatever", device="cuda", load_in_4bit=True)


def test_quantised_loading_rejects_both_flags():
    with pytest.raises(FeedbackError):
        load_model("org/whatever", load_in_4bit=True, load_in_8bit=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error path")
def test_cuda_device_without_gpu():
    with pytest.raises(FeedbackError, match="CUDA"):
        load_model("org/whatever", device="cuda")


def test_load_local_folder_round_trip(tiny_lm, tmp_path):
    tiny_lm.model.save_pretrained(tmp_path)
    tiny_lm.tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    assert lm.name == str(tmp_path)
    assert lm.dtype == CPU_AUTO_DTYPE
    assert lm.device == torch.device("cpu")
    assert lm.num_layers == tiny_lm.num_layers == 4
    assert lm.hidden_size == 64
    assert not lm.model.training
    assert tiny_lm.tokenizer.eos_token_id in lm.eos_token_ids
    assert len(set(lm.eos_token_ids)) == len(lm.eos_token_ids)
    assert lm.load_seconds > 0

    ids = torch.tensor([lm.encode("The capital of France is", chat_template=False)])
    assert ids.tolist() == [tiny_lm.encode("The capital of France is", chat_template=False)]
    with torch.no_grad():
        a = tiny_lm.model(ids).logits[:, -1].float()
        b = lm.model(ids).logits[:, -1].float()
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert a.argmax().item() == b.argmax().item()


def test_eos_ids_merge_generation_config_and_tokenizer(tiny_lm, tmp_path):
    model = tiny_lm.model
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [7, 5, 7]
    try:
        model.save_pretrained(tmp_path)
    finally:
        model.generation_config.eos_token_id = saved
    tiny_lm.tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    # generation-config ids first, in order, then the tokenizer's; no duplicates
    assert lm.eos_token_ids == [7, 5, tiny_lm.tokenizer.eos_token_id]


def test_load_local_folder_with_dtype(tiny_lm, tmp_path):
    tiny_lm.model.save_pretrained(tmp_path)
    tiny_lm.tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="bfloat16")
    assert lm.dtype == "bfloat16"
    assert next(lm.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("config", ['{"model_type": "not-a-real-arch"}', "{}", "not json"])
def test_load_unusable_config_is_user_error(tiny_lm, tmp_path, config):
    tiny_lm.tokenizer.save_pretrained(tmp_path)  # so that the config, not the tokenizer, is what fails
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(FeedbackError):
        load_model(str(tmp_path))


def test_load_missing_hub_model_fails_fast(monkeypatch):
    import time

    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import (already done by the session fixtures)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "10")  # load_model may set it; restore afterwards
    started = time.perf_counter()
    with pytest.raises(FeedbackError) as info:
        load_model("org/does-not-exist-xyz")
    assert "org/does-not-exist-xyz" in str(info.value)
    assert time.perf_counter() - started < 30


def test_embedded_eos_ids(embedded_lm):
    tok = embedded_lm.tokenizer
    assert tok.eos_token_id in embedded_lm.eos_token_ids
    assert all(isinstance(i, int) for i in embedded_lm.eos_token_ids)
    assert embedded_lm.dtype == "float32"
    assert embedded_lm.num_layers == embedded_lm.model.config.num_hidden_layers == 30


def _folder_with_tokenizer(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_load_invalid_config_values_is_user_error(tiny_lm, tmp_path):
    folder = _folder_with_tokenizer(tmp_path, tiny_lm.tokenizer)
    (folder / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 30, '
        '"num_attention_heads": 4}'
    )
    with pytest.raises(FeedbackError):
        load_model(str(folder))


def test_load_corrupt_weights_is_user_error(tiny_lm, tmp_path):
    tiny_lm.model.config.save_pretrained(tmp_path)
    folder = _folder_with_tokenizer(tmp_path, tiny_lm.tokenizer)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(FeedbackError):
        load_model(str(folder))


def test_load_folder_without_weights_is_user_error(tiny_lm, tmp_path):
    tiny_lm.model.config.save_pretrained(tmp_path)
    folder = _folder_with_tokenizer(tmp_path, tiny_lm.tokenizer)
    with pytest.raises(FeedbackError):
        load_model(str(folder))


def test_unreachable_hub_fails_fast_with_hint(monkeypatch):
    import time

    import feedback.core.model as fm

    monkeypatch.setattr(fm, "_hub_reachable", lambda timeout=3.0: False)
    t = time.perf_counter()
    with pytest.raises(FeedbackError, match="hub is unreachable and it is not in the local cache"):
        load_model("org/does-not-exist-xyz")
    assert time.perf_counter() - t < 10


def test_fast_matmul_is_opt_in_and_said_in_every_result(tiny_lm):
    from feedback.core.engine import run_to_end
    from feedback.core.model import set_fast_matmul
    from feedback.core.records import RowSpec, RunConfig
    from ui.compare.view import done_text

    assert tiny_lm.precision == "exact: fp32"
    set_fast_matmul(True)
    try:
        assert tiny_lm.precision == "fast, not bit-exact: bf16 matmuls on fp32 weights"
        res = run_to_end(tiny_lm, RunConfig(prompt="hi", model="tiny", max_new_tokens=2, rows=[RowSpec("a")]))
        assert res.config["precision"] == tiny_lm.precision and "fast, not bit-exact" in done_text(res)
    finally:
        set_fast_matmul(False)
    assert tiny_lm.precision == "exact: fp32"


def test_threads_and_wait_policy_are_chosen_at_start(monkeypatch):
    import subprocess
    import sys

    from feedback.core.model import set_threads

    code = (
        "import os; os.environ.pop('OMP_WAIT_POLICY', None); import feedback; "
        "print(os.environ['OMP_WAIT_POLICY'])"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
        == "PASSIVE"
    )
    before = torch.get_num_threads()
    monkeypatch.setenv("FEEDBACK_THREADS", "1")
    try:
        assert set_threads() == 1
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("FEEDBACK_THREADS", "many")
    with pytest.raises(FeedbackError, match="FEEDBACK_THREADS must be a positive whole number"):
        set_threads()


def test_a_random_model_has_the_architecture_and_tokenizer_without_the_weights(tmp_path, embedded_lm):
    """random:<spec> builds the model of that configuration with seeded random weights, from a folder
    holding only config.json and the tokenizer's files (what a machine without the network can be
    given): same shapes, same tokenizer, different weights, the same on every load."""
    import shutil

    from feedback.core import embedded

    source = embedded.prepare()
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    assert resolve_source(f"random:{tmp_path}") == ("random", str(tmp_path))
    a, b = load_model(f"random:{tmp_path}"), load_model(f"random:{tmp_path}")
    assert a.name == f"random:{tmp_path}" and a.num_layers == embedded_lm.num_layers
    assert a.encode("Hello there") == embedded_lm.encode("Hello there")
    head = a.model.get_output_embeddings().weight
    assert head.shape == embedded_lm.model.get_output_embeddings().weight.shape
    assert torch.equal(head, b.model.get_output_embeddings().weight)
    assert not torch.equal(head, embedded_lm.model.get_output_embeddings().weight)
    with pytest.raises(FeedbackError, match="one random: is enough"):
        resolve_source("random:random:embedded")


def test_a_model_whose_layers_keep_a_recurrent_state_is_refused_at_load(embedded_lm, tmp_path):
    """Qwen3-Next's linear-attention layers keep a state the engine cannot pad or cut by row: refused
    by name when it loads, not an AttributeError when a row leaves the batch mid-run."""
    from tests.tiny_families import write_folder

    folder = write_folder("qwen3_next", embedded_lm.tokenizer, tmp_path / "qwen3_next")
    with pytest.raises(
        FeedbackError,
        match=r"Qwen3NextForCausalLM: some of its layers keep a recurrent state "
        r"\(LinearAttentionLayer\)",
    ):
        load_model(f"random:{folder}")


def test_the_forward_lock_goes_to_the_thread_that_waited_longest():
    """Forwards take turns: a thread that releases and at once asks again goes behind the waiter
    (a request scoring chunk after chunk cannot starve the shared decode loop's step)."""
    from feedback.core.model import TurnLock

    lock, order = TurnLock(), []
    lock.acquire()
    waiters = []
    for i in range(4):
        waiters.append(threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release())))
        waiters[-1].start()
        deadline = time.monotonic() + 5
        while len(lock._line) < i + 1 and time.monotonic() < deadline:  # each in line before the next
            time.sleep(0.001)
    lock.release()
    for t in waiters:
        t.join(5)
    assert order == [0, 1, 2, 3] and not lock.locked()

    seq: list[str] = []
    asked = threading.Event()

    def hog() -> None:
        for _ in range(3):
            with lock:
                seq.append("hog")
                asked.wait(5)  # the other thread is in line before this turn ends

    def other() -> None:
        while not lock.locked():
            time.sleep(0.001)
        threading.Timer(0.05, asked.set).start()
        with lock:
            seq.append("other")

    threads = [threading.Thread(target=hog), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seq == ["hog", "other", "hog", "hog"]
    with pytest.raises(RuntimeError):
        lock.release()
