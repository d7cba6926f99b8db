# One image for workers, the demo trainer and the CLI. CPU torch by default; for a GPU image,
# build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (see README).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The in-process real engines, e.g. --build-arg ENGINES="vllm==0.30.0 vllm-omni==0.30.0" (GPU images).
ARG ENGINES=""
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY broker ./broker
COPY workers ./workers
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" "torch==2.13.0" \
 && pip install --no-cache-dir ".[reference]" \
 && if [ -n "${ENGINES}" ]; then pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" ${ENGINES}; fi
ENTRYPOINT ["rollout-fleet"]
