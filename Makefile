# The two set-up commands: `make demo` and `make test`. Both create .venv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv venv-sglang demo test lint pytest test-sglang molecule test-gpu clean

$(STAMP): requirements/dev.txt pyproject.toml requirements.yml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements/dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/ansible-galaxy collection install -r requirements.yml -p .collections
	touch $@

venv: $(STAMP)

# SGLang's real wheel, without its CUDA dependencies, for the contract tests (tests/sglang).
venv-sglang: venv
	tests/sglang/make_venv.sh

# The main job on the embedded default: free the GPUs, start the capture server (reference
# engine, tiny model, CPU), extract the demo conversations, stop the server (also on failure),
# free the GPUs again and train the drafter on the extracted states.
DEMO_PLAY := $(BIN)/ansible-playbook -i inventory/local.yml
demo: venv
	$(DEMO_PLAY) playbooks/gpu_reset.yml -e gpu_reset_report_dir=$(CURDIR)/output/demo/gpu_reset
	$(DEMO_PLAY) playbooks/sglang_server.yml
	$(DEMO_PLAY) playbooks/extract.yml || { $(DEMO_PLAY) playbooks/sglang_server.yml -e sglang_server_state=stopped; exit 1; }
	$(DEMO_PLAY) playbooks/sglang_server.yml -e sglang_server_state=stopped
	$(DEMO_PLAY) playbooks/train.yml
	@echo "GPU report: output/demo/gpu_reset/localhost.json; dataset: output/demo/data (data_config.json)"
	@echo "drafter: output/demo/drafter-run/drafter (charts/, metrics.jsonl, training.json beside it)"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint

pytest: venv
	$(BIN)/pytest tests --ignore=tests/gpu --ignore=tests/sglang

test-sglang: venv-sglang
	.venv-sglang/bin/python -m pytest tests/sglang

molecule: venv
	$(BIN)/molecule test --all

test: lint pytest test-sglang molecule

# On a machine with an NVIDIA GPU: the python3 found there (no venv: it may reach no registry).
test-gpu:
	python3 -m pytest tests/gpu -v -s

clean:
	rm -rf $(VENV) .venv-sglang .collections output .cache .pytest_cache .ruff_cache
