"""Shared fixtures: the real embedded model (behaviour) and a tiny random Llama (mechanics)."""

from __future__ import annotations

import contextlib
import os

import pytest

# first: the package sets the CPU wait policy before torch loads
from feedback.core import lean, linear
from feedback.core.model import LoadedModel, load_model

import torch  # noqa: E402  (isort: skip)

# pytest-xdist: each worker process gets its share of the cores, so two workers on two cores do not
# oversubscribe them (torch would otherwise start one thread per core in every worker).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


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
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")  # as load_model does on CPU: batch-invariant
    lean.lean_layers(model.model.layers)  # as load_model does on CPU: fused projections, exact
    lean.lean_stack(model)
    if linear.wanted(torch.device("cpu")):
        linear.use_kernels(model, linear.setting())  # as load_model does on CPU
    return LoadedModel(
        model=model,
        tokenizer=tok,
        name="tiny",
        dtype="float32",
        device=torch.device("cpu"),
        eos_token_ids=[tok.eos_token_id],
    )


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="session")
def hook_count():
    """Counts forward hooks and pre-hooks registered anywhere in a model (none may outlive a run)."""
    return _hook_count


@contextlib.contextmanager
def _launched(pool, settings, page_budget=None):
    """The real app on `pool`, launched in-process on a free local port, its API with `settings`
    (keys, budgets) and its page with `page_budget` (None: the served defaults): its URL, its model
    pool and the app object; every job stopped on the way out."""
    import socket
    from types import SimpleNamespace

    from ui.layout import FeedbackLensApp
    from ui.page.server import KEY_LOGIN_MESSAGE, app_kwargs, page_auth
    from ui.page.theme import launch_kwargs

    app = FeedbackLensApp(pool, budget=page_budget)
    demo = app.build()
    demo.queue(max_size=pool.gate.max_waiting, default_concurrency_limit=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, url, _ = demo.launch(
        server_name="127.0.0.1",
        server_port=port,
        prevent_thread_lock=True,
        quiet=True,
        auth=page_auth(settings, None),
        auth_message=KEY_LOGIN_MESSAGE if settings.gradio_keys else None,
        app_kwargs=app_kwargs(pool, settings),
        **launch_kwargs(),
    )
    try:
        yield SimpleNamespace(url=url, pool=pool, app=app)
    finally:
        app.runner.jobs.stop_all()  # no model work may still run when the interpreter exits
        demo.close()


@pytest.fixture(scope="session")
def launch_app():
    """`launch_app(pool, settings, page_budget)`: a context manager serving the real app, for tests
    that need their own settings (keys, small budgets)."""
    return _launched


@pytest.fixture(scope="session")
def app_server(embedded_lm):
    """The real app on the embedded model with default settings: its URL, its model pool (tests
    may hold the model line) and the app object."""
    from feedback.serve.api import ApiSettings
    from feedback.serve.pool import ModelPool

    with _launched(ModelPool.serving(embedded_lm), ApiSettings()) as server:  # reuse the session's model
        yield server


@pytest.fixture(scope="session")
def app_url(app_server):
    return app_server.url
