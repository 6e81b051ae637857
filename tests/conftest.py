"""Shared fixtures: the real embedded model (behaviour) and a tiny random Llama (mechanics)."""
from __future__ import annotations

import pytest
import torch

from feedback.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def embedded_lm() -> LoadedModel:
    """SmolLM2-135M-Instruct from the embedded GGUF (converted once into the cache)."""
    return load_model("embedded", dtype="float32")


@pytest.fixture(scope="session")
def tiny_lm(embedded_lm: LoadedModel) -> LoadedModel:
    """A 4-layer random Llama sharing the embedded tokenizer: fast, for mechanics only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = embedded_lm.tokenizer
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")  # as load_model does on CPU: batch-invariant
    return LoadedModel(model=model, tokenizer=tok, name="tiny", dtype="float32",
                       device=torch.device("cpu"), eos_token_ids=[tok.eos_token_id])


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="session")
def hook_count():
    """Counts forward hooks and pre-hooks registered anywhere in a model (none may outlive a run)."""
    return _hook_count


@pytest.fixture(scope="session")
def app_server(embedded_lm):
    """The real app on the embedded model, launched in-process on a free local port: its URL, its
    model pool (tests may hold the model line) and the app object."""
    import socket
    from types import SimpleNamespace

    from feedback.api import ApiSettings
    from feedback.model import ModelPool
    from ui.app import FeedbackLensApp
    from ui.server import app_kwargs
    from ui.theme import launch_kwargs

    pool = ModelPool.serving(embedded_lm)  # reuse the session's loaded model
    app = FeedbackLensApp(pool)
    demo = app.build()
    demo.queue(max_size=16, default_concurrency_limit=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                            app_kwargs=app_kwargs(pool, ApiSettings()), **launch_kwargs())
    yield SimpleNamespace(url=url, pool=pool, app=app)
    app.runner.jobs.stop_all()  # no model work may still run when the interpreter exits
    demo.close()


@pytest.fixture(scope="session")
def app_url(app_server):
    return app_server.url
