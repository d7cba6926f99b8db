# Two commands a user needs: `make demo` (a local fleet on the embedded Redis) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-cluster test-faults test-engines test-verl test-rlinf test-areal test-slurm images test-compose test-ray lint docs soak clean

$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing rollout-fleet[reference,dev] (CPU torch; a few minutes the first time)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 resolves to the CPU wheel on this project's machines; never a CUDA build.
	$(PY) -m pip install --progress-bar on -e ".[reference,dev]"
	@echo "make: $(VENV) is ready"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollout-fleet demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest -q -m slow

# Every component against a local Redis Cluster (tests/cluster; needs redis-server and redis-cli).
test-cluster: $(STAMP)
	$(PY) -m pytest -q -m cluster

# Half-open network partitions between namespaces, each component cut off Redis (tests/faults; root).
test-faults: $(STAMP)
	PYTHON=$(PY) bash scripts/run_fault_tests.sh

# verl's own agent loops through the fleet: builds (once, cached outside the repo) the verl venv.
test-verl:
	bash scripts/run_verl_tests.sh

# RLinf 0.3's own world-model env base class through the fleet: builds (once, cached) the RLinf venv.
test-rlinf:
	bash scripts/run_rlinf_tests.sh

# AReaL's own rollout workflows through the fleet: builds (once, cached outside the repo) the AReaL venv.
test-areal:
	bash scripts/run_areal_tests.sh

# docs/deploy/slurm.md's batch script on a real one-node Slurm that the tests start (tests/slurm);
# installs Debian's slurmd, slurmctld and slurm-client when missing (needs root, as CI runs).
SLURM_BINARIES := slurmctld slurmd sbatch scancel scontrol sinfo squeue
test-slurm: $(STAMP)
	@for b in $(SLURM_BINARIES); do command -v $$b >/dev/null 2>&1 || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  echo "make: installing Debian's slurmd, slurmctld and slurm-client"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    slurmd slurmctld slurm-client >/dev/null; \
	fi
	$(PY) -m pytest -q -m slurm tests/slurm

# The Ray launcher (rollout-fleet ray) on a local multi-node Ray cluster: builds (once, cached outside the repo) the Ray venv.
test-ray:
	bash scripts/run_ray_tests.sh

# Real vLLM / vLLM-Omni on CPU: builds (once, cached outside the repo) the engines venv.
test-engines:
	bash scripts/run_engine_tests.sh

# Every image docker-compose.yml needs, with no registry: rollout-fleet:latest on a base made from
# Debian packages, and the Redis and Prometheus stand-ins (cached outside the repo; docs/deploy/compose.md).
images:
	bash scripts/build_images.sh

# docker-compose.yml run for real: installs Docker if missing, starts dockerd, builds the images.
test-compose: $(STAMP)
	bash scripts/run_compose_tests.sh

# The manual (mkdocs.yml, docs/): strict, so a broken link or a page missing from the nav fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The soak benchmark by hand (bench/soak.py, docs/soak.md): a steady load for SOAK_MINUTES, sampled.
SOAK_MINUTES ?= 45
soak: $(STAMP)
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) --plot bench/results/soak.png

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
