# Two commands do all set-up on a fresh machine:
#   make demo   -- create .venv if missing, install, run the main job on the default example
#   make test   -- same install, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_JOB ?= examples/counting_grpo.yaml
# The torch this project is built and tested with here (a CPU wheel); pyproject.toml keeps a range
# so that a cluster's vLLM can bring its own.
TORCH_VERSION ?= 2.13.0
RUN_DIR  ?= runs/demo

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test,bench]' torch==$(TORCH_VERSION)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nereus-launch local $(DEMO_JOB) --run-dir $(RUN_DIR) --overwrite
	$(VENV)/bin/nereus-launch report $(RUN_DIR)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
