# One image for workers, the supervisor, the gateway, the demo trainer and the CLI. CPU torch by
# default; for a GPU image, build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (see docs/deploy/compose.md).
#
# Two ways to build it, one file:
#   docker build -t rollout-fleet:latest .      # an official Python base, wheels from the package index
#   make images                                 # a base made from Debian packages and a wheelhouse built
#                                               # on the host: no registry, no network inside the build
# `make images` (scripts/build_images.sh) passes BASE=<its Debian base> and WHEELS=/tmp/wheels, and
# links the wheelhouse into deploy/images/wheels/ (git ignores it); with the defaults that folder is
# absent or empty and pip reads the package index.
ARG BASE=python:3.11-slim

# ---- build: a virtual environment at /opt/fleet, copied whole into the final image, so neither
# the wheels nor pip's cache end up in a layer of the image.
FROM ${BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The extras of pyproject.toml the image's commands need: reference (CPU engines, torch), gateway
# (fastapi, uvicorn), http (httpx: the vllm-http and vllm-omni-http engines).
ARG EXTRAS=reference,gateway,http
# The in-process real engines, e.g. --build-arg ENGINES="vllm==0.30.0 vllm-omni==0.30.0" (GPU images).
ARG ENGINES=""
# Empty: pip reads the package index. A folder (make images: /tmp/wheels): pip reads only it.
ARG WHEELS=""
WORKDIR /src
# The glob (beside a file that is always there) keeps COPY valid without the wheelhouse folder.
COPY deploy/images/.gitignore deploy/images/wheel[s] /tmp/wheels/
# torch first, in a layer of its own: a change to the fleet's code does not reinstall it.
RUN set -eu; \
    if [ -n "${WHEELS}" ]; then pip_from="--no-index --find-links ${WHEELS}"; \
    else pip_from="--extra-index-url ${TORCH_INDEX}"; fi; \
    python3 -m venv /opt/fleet; \
    /opt/fleet/bin/pip install --no-cache-dir --disable-pip-version-check ${pip_from} "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY broker ./broker
COPY workers ./workers
COPY cli ./cli
RUN set -eu; \
    if [ -n "${WHEELS}" ]; then pip_from="--no-index --find-links ${WHEELS}"; \
    else pip_from="--extra-index-url ${TORCH_INDEX}"; fi; \
    /opt/fleet/bin/pip install --no-cache-dir --disable-pip-version-check ${pip_from} ".[${EXTRAS}]"; \
    if [ -n "${ENGINES}" ]; then \
      /opt/fleet/bin/pip install --no-cache-dir --disable-pip-version-check ${pip_from} ${ENGINES}; fi

# ---- the image: the base, the environment, a user.
FROM ${BASE}
COPY --from=build /opt/fleet /opt/fleet
ENV PATH=/opt/fleet/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Not root: a process escaping a bug in an engine gets no more than this user may do.
RUN useradd --create-home --uid 10001 fleet
USER fleet
WORKDIR /home/fleet
ENTRYPOINT ["rollout-fleet"]
