# One image for workers, the supervisor, the gateway, the demo trainer and the CLI. CPU torch by
# default; for a GPU image, build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (see README, Deployment).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The extras of pyproject.toml the image's commands need: reference (CPU engines, torch), gateway
# (fastapi, uvicorn), http (httpx: the vllm-http and vllm-omni-http engines).
ARG EXTRAS=reference,gateway,http
# The in-process real engines, e.g. --build-arg ENGINES="vllm==0.30.0 vllm-omni==0.30.0" (GPU images).
ARG ENGINES=""
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY broker ./broker
COPY workers ./workers
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" "torch==2.13.0" \
 && pip install --no-cache-dir ".[${EXTRAS}]" \
 && if [ -n "${ENGINES}" ]; then pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" ${ENGINES}; fi
# Not root: a process escaping a bug in an engine gets no more than this user may do.
RUN useradd --create-home --uid 10001 fleet
USER fleet
ENTRYPOINT ["rollout-fleet"]
