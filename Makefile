# Two commands a user needs: `make demo` (a local fleet on the embedded Redis) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-cluster test-engines test-verl test-rlinf test-areal lint docs soak clean

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

# verl's own agent loops through the fleet: builds (once, cached outside the repo) the verl venv.
test-verl:
	bash scripts/run_verl_tests.sh

# RLinf 0.3's own world-model env base class through the fleet: builds (once, cached) the RLinf venv.
test-rlinf:
	bash scripts/run_rlinf_tests.sh

# AReaL's own rollout workflows through the fleet: builds (once, cached outside the repo) the AReaL venv.
test-areal:
	bash scripts/run_areal_tests.sh

# Real vLLM / vLLM-Omni on CPU: builds (once, cached outside the repo) the engines venv.
test-engines:
	bash scripts/run_engine_tests.sh

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
