# cyclebox — `make help` lists the targets. `make demo` and `make test` do all
# set-up on a fresh Debian machine (as root: Docker engine, debootstrap, venv).
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CYCLEBOX := $(BIN)/cyclebox
STAMP := $(VENV)/.installed
PIP_VERSION := 26.3
# Every env installs with -c constraints/<env>.txt: all it installs, pinned (make lock).
export BASE_IMAGE

help: ## List the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-zA-Z_-]+:.*## /{printf "  \033[36m%-14s\033[0m %s\n",$$1,$$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints/host.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)
	$(BIN)/pip install -q -c constraints/host.txt -e '.[dev]'
	@touch $@

setup: $(STAMP) ## Create .venv with cyclebox and dev tools; install debootstrap when root
	@if [ -z "$$BASE_IMAGE" ] && ! command -v debootstrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing debootstrap (Debian package) for the base image"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; \
	  else echo "debootstrap missing: install it (apt-get install debootstrap) or set BASE_IMAGE=python:3.11-slim"; exit 1; fi; \
	fi

docker: ## Make sure a Docker engine answers; as root on Debian, install docker.io and start dockerd
	@if docker info >/dev/null 2>&1; then echo "docker engine: $$(docker version -f '{{.Server.Version}}')"; exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "No Docker engine answers. Install one (Debian: apt-get install docker.io) and start it,"; \
	  echo "or set DOCKER_HOST. Then run make again."; exit 1; fi; \
	if ! command -v dockerd >/dev/null; then \
	  echo "installing Debian's docker.io"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null; fi; \
	mkdir -p build; echo "starting dockerd (log: build/dockerd.log)"; \
	setsid dockerd >build/dockerd.log 2>&1 </dev/null & \
	for i in $$(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done; \
	docker info >/dev/null 2>&1 || { tail -n 20 build/dockerd.log; echo "dockerd did not come up"; exit 1; }; \
	echo "docker engine: $$(docker version -f '{{.Server.Version}}')"

chromium: ## Make sure headless Chromium exists (the HTML report test renders in it); as root on Debian, install it
	@if command -v chromium >/dev/null; then echo "chromium: $$(chromium --version 2>/dev/null)"; exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "chromium missing: install it (Debian: apt-get install chromium) and run make again."; exit 1; fi; \
	echo "installing Debian's chromium (headless HTML report test)"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	command -v chromium >/dev/null || { echo "chromium did not install"; exit 1; }; \
	echo "chromium: $$(chromium --version 2>/dev/null)"

gvisor: docker ## Make runtime runsc (gVisor) usable: install runsc, merge it into daemon.json, reload dockerd (HUP)
	$(PY) images/gvisor_setup.py

images: setup docker ## Build the base and role images offline (unchanged inputs: no-op)
	$(CYCLEBOX) images build

check: setup ## Lint (ruff), type-check (mypy strict), import contracts (import-linter), lint the CI example (actionlint)
	$(BIN)/ruff check runner sandbox tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/actionlint examples/ci/*.yml

VERL_VENV := build/verl-venv
VERL_STAMP := $(VERL_VENV)/.installed

$(VERL_STAMP): tests/verl-env.txt constraints/verl.txt
	rm -rf $(VERL_VENV)
	$(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	$(VERL_VENV)/bin/pip install -q -c constraints/verl.txt -r tests/verl-env.txt
	$(VERL_VENV)/bin/pip install -q --no-deps verl==0.9.1
	$(VERL_VENV)/bin/python -c "from verl.utils.dataset.rl_dataset import RLHFDataset; \
	  from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset; import peft"
	@touch $@

MOCK_VENV := build/mock-venv
MOCK_STAMP := $(MOCK_VENV)/.installed

$(MOCK_STAMP): constraints/mock.txt
	rm -rf $(MOCK_VENV)
	$(PY) -m venv $(MOCK_VENV)
	$(MOCK_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	$(MOCK_VENV)/bin/pip install -q -c constraints/mock.txt --only-binary=:all: mock-ai-api==0.1.1
	@touch $@

ATTEST_VENV := build/attest-venv
ATTEST_STAMP := $(ATTEST_VENV)/.installed

$(ATTEST_STAMP): tests/attest-env.txt constraints/attest.txt
	rm -rf $(ATTEST_VENV)
	$(PY) -m venv $(ATTEST_VENV)
	$(ATTEST_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	$(ATTEST_VENV)/bin/pip install -q -c constraints/attest.txt --only-binary=:all: -r tests/attest-env.txt
	$(ATTEST_VENV)/bin/python -c "from securesystemslib.dsse import Envelope; \
	  from securesystemslib.signer import SSlibKey; \
	  from in_toto_attestation.v1.statement import Statement; import jsonschema"
	@touch $@

attest-env: $(ATTEST_STAMP) ## securesystemslib + in-toto-attestation + jsonschema (PyPI) in build/attest-venv: third-party verifiers of attestations, for tests

mock-env: $(MOCK_STAMP) ## mock-ai-api 0.1.1 (PyPI) in build/mock-venv: the third-party upstream for every API family, for tests

verl-env: $(VERL_STAMP) ## verl 0.9.1 + CPU torch in build/verl-venv: the export's real consumer, for tests

test: setup docker gvisor chromium images check verl-env mock-env attest-env ## Everything: set-up (engine, gVisor, Chromium, images, verl, mock and attest envs), lint, then unit, integration, security, faults and e2e tests
	$(BIN)/pytest tests/unit tests/integration tests/security tests/faults tests/e2e

faults: setup docker images ## Fault tier: signals at each stage, engine cut, disk full, bad inputs (root, real engine)
	$(BIN)/pytest tests/faults

unit: setup ## Unit tests only (no Docker)
	$(BIN)/pytest tests/unit

STAMP_NOW = $(shell date -u +%Y%m%dT%H%M%SZ)

demo: setup docker images ## The main job: doctor, then the bundled cycle offline to a verified receipt
	$(CYCLEBOX) doctor
	$(CYCLEBOX) cycle run examples/shop-analyst/cycle.yaml --out build/demo/$(STAMP_NOW)
	$(CYCLEBOX) receipt verify build/demo/$(STAMP_NOW)

demo-negative: setup docker images ## Negative control: the candidate drops a mandatory rule; must end reject (exit 1)
	$(CYCLEBOX) cycle run examples/shop-analyst/cycle-negative.yaml --out build/demo/negative-$(STAMP_NOW); \
	  code=$$?; [ $$code -eq 1 ] || { echo "expected reject (exit 1), got $$code"; exit 1; }

receipt: setup docker images ## Record the demo cycle, replay it byte-exactly, show equal input/outcome hashes
	$(CYCLEBOX) cycle run examples/shop-analyst/cycle.yaml --out build/receipt/$(STAMP_NOW)/recorded
	$(CYCLEBOX) cycle run examples/shop-analyst/cycle.yaml --replay build/receipt/$(STAMP_NOW)/recorded \
	  --out build/receipt/$(STAMP_NOW)/replayed
	$(CYCLEBOX) receipt verify build/receipt/$(STAMP_NOW)/replayed
	$(CYCLEBOX) receipt compare build/receipt/$(STAMP_NOW)/recorded build/receipt/$(STAMP_NOW)/replayed

MATRIX := tests/e2e/agents/log_triage

matrix: setup docker images ## Framework matrix in full (11 incidents x 8 agent variants, one derived image): record, replay, compare, print the table
	$(CYCLEBOX) cycle run $(MATRIX)/cycle.yaml --out build/matrix/$(STAMP_NOW)/recorded
	$(CYCLEBOX) cycle run $(MATRIX)/cycle.yaml --replay build/matrix/$(STAMP_NOW)/recorded \
	  --out build/matrix/$(STAMP_NOW)/replayed
	$(CYCLEBOX) receipt compare build/matrix/$(STAMP_NOW)/recorded build/matrix/$(STAMP_NOW)/replayed
	$(BIN)/python $(MATRIX)/table.py build/matrix/$(STAMP_NOW)/recorded build/matrix/$(STAMP_NOW)/replayed

dream: setup docker images ## Paired dream off/on run of the example; one receipt with held-out delta and cost
	$(CYCLEBOX) dream compare examples/shop-analyst/cycle-dream.yaml --out build/dream/$(STAMP_NOW)

smoke: setup docker images ## One sandboxed smoke run of each role image
	@for role in analyst worker evaluator apply; do \
	  echo "== $$role: sandbox probe"; \
	  $(CYCLEBOX) sandbox exec --role $$role -- python -m sandbox.probe --role $$role || exit 1; \
	done
	@echo "== trainer: torch/transformers/peft inside the sandbox"
	$(CYCLEBOX) sandbox exec --role trainer -- python -c \
	  "import torch, transformers, peft, json; print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, 'peft': peft.__version__, 'cuda': torch.cuda.is_available()}))"

bench: setup docker gvisor images ## Run the benchmarks (JSON into build/bench/)
	@mkdir -p build/bench
	$(BIN)/python -m bench.overhead --out build/bench/overhead.json
	$(BIN)/python -m bench.runtimes --out build/bench/runtimes.json
	$(BIN)/python -m bench.images --out build/bench/images.json
	$(BIN)/python -m bench.gateway --out build/bench/gateway.json
	$(BIN)/python -m bench.cycle --out build/bench/cycle.json
	$(BIN)/python -m bench.train --out build/bench/train.json

bench-throughput: setup docker images ## Cases/s, peak memory and CPU s per case at concurrency 1..32 and auto, upstream answering after 2 s (200 cases/side; build/bench/throughput.json)
	@mkdir -p build/bench
	$(BIN)/python -m bench.throughput --out build/bench/throughput.json

bench-scale: setup docker images ## Demo grown to ~100 and ~400 cases/side, local vs a local Ray cluster (~25 min; build/bench/scale.json)
	@mkdir -p build/bench
	$(BIN)/python -m bench.scale --cases 100,400 --out build/bench/scale.json

lock: ## Refresh constraints/*.txt (every env's pins) from fresh unconstrained venvs (run make test afterwards)
	$(PY) constraints/refresh.py $(PIP_VERSION) host verl mock attest

gc: setup ## Remove cyclebox containers whose controller is gone, and stale gateway socket and input staging directories
	$(CYCLEBOX) gc

clean: ## Remove orphaned cyclebox containers and build/ (images are kept)
	-@[ -x $(CYCLEBOX) ] && $(CYCLEBOX) gc || true
	rm -rf build .pytest_cache .mypy_cache .ruff_cache

.PHONY: help setup docker chromium gvisor images check test faults unit verl-env lock demo demo-negative receipt matrix mock-env dream smoke bench bench-scale gc clean
