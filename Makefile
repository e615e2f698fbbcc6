# feast-edge: set-up from a fresh machine in one command.
#
#   make demo    system packages + .venv + the package, then `feast-edge demo`
#   make test    system packages + .venv + the package + a broker on 127.0.0.1:1883, then pytest (every test)
#   make test-fast  the same set-up, then pytest -m "not slow" (the loop while developing; docs/development.md)
#   Both run pytest-xdist on every core (-n auto --dist loadgroup); WORKERS=N changes that, WORKERS=0 runs in one process.
#   make docs    .venv + the package, the benchmark tables from bench/results/, then the site into site/ (strict)
#
# Every step is idempotent: a second run only checks and goes straight to the command.
# Variables (make VAR=value):
#   VENV=.venv        where the virtual environment lives
#   PYTHON=python3    the interpreter that creates it (Python >= 3.10)
#   TORCH=...         what `pip install` gets when the venv cannot import torch and torchvision;
#                     empty (TORCH=) never installs PyTorch (keep the one the system has)
#   PYTEST_ARGS=...   extra pytest arguments (e.g. PYTEST_ARGS="tests/core -x", PYTEST_ARGS='-m "not broker"')
#   WORKERS=auto      pytest-xdist workers: auto (one per core), a number, or 0 (no xdist: one process)
#   DEMO_ARGS=...     extra `feast-edge demo` options (e.g. DEMO_ARGS="--rounds 5")

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1 torchvision==0.29.1
PYTEST_ARGS ?=
DEMO_ARGS ?=
WORKERS ?= auto
# pytest-xdist: one worker per core; loadgroup keeps the tests of one @pytest.mark.xdist_group (those sharing an
# expensive module or session fixture: the wheel, a finished federation) on one worker, so it is made once.
XDIST := $(if $(filter 0,$(WORKERS)),-p no:xdist,-n $(WORKERS) --dist loadgroup)

APT_PACKAGES := dataset-fashion-mnist mosquitto openssl
FASHION_MNIST := /usr/share/datasets/fashion-mnist
BROKER_HOST := 127.0.0.1
BROKER_PORT := 1883

VENV_DIR := $(abspath $(VENV))
VPY := $(VENV_DIR)/bin/python
STAMP := $(VENV_DIR)/.feast-edge-installed
# amqtt (the demo's fallback broker, extra [amqtt]) cannot share the dev venv with flwr (pyproject.toml: typer pins);
# it goes into a directory beside it, with the versions amqtt 0.11 pins, and the amqtt test puts it on PYTHONPATH.
AMQTT_SIDE := $(VENV_DIR)/amqtt-side
AMQTT_PACKAGES := amqtt>=0.11,<0.12 typer==0.15.4 websockets==15.0.1 transitions==0.9.2 passlib==1.7.4 dacite>=1.9.2
# Console scripts of the venv first (the demo and the tests start feast-server/feast-agent),
# /usr/sbin for mosquitto when a normal user's PATH lacks it.
RUN_ENV := PATH="$(VENV_DIR)/bin:$$PATH:/usr/sbin"

export PIP_DISABLE_PIP_VERSION_CHECK ?= 1

.PHONY: help setup system-packages venv broker test test-fast demo docs clean

help:
	@echo "feast-edge set-up (Debian/Ubuntu, Python >= 3.10, root or sudo for apt-get)"
	@echo
	@echo "  make demo             set everything up, then run 'feast-edge demo' (DEMO_ARGS=...)"
	@echo "  make test             set everything up, start a broker if needed, then run every test (PYTEST_ARGS=...)"
	@echo "  make test-fast        the same, but only the tests not marked slow: pytest -m 'not slow'"
	@echo "  make docs             the benchmark tables from bench/results/, then the site into site/ (mkdocs build --strict)"
	@echo "  both run on every core (pytest-xdist -n auto); WORKERS=N sets the number, WORKERS=0 runs in one process"
	@echo "  costs on 2 cores and how to run a marker or a file: docs/development.md"
	@echo
	@echo "  test markers (pyproject.toml), selected with -m, e.g. make test PYTEST_ARGS='-m \"not broker and not browser\"':"
	@echo "    slow     more than a few seconds: subprocess federations, demos, chaos, the wheel, real simulations"
	@echo "    broker   needs Mosquitto: the broker on $(BROKER_HOST):$(BROKER_PORT), or the mosquitto program for a private one"
	@echo "    browser  drives the dashboard in headless Chromium (Selenium)"
	@echo "    gpu      needs a CUDA GPU (skips with its reason without one)"
	@echo
	@echo "  make setup            system-packages + venv"
	@echo "  make system-packages  apt-get install $(APT_PACKAGES) (only what is missing)"
	@echo "  make venv             $(VENV) (--system-site-packages), PyTorch if it cannot be imported, pip install -e '.[dev]', amqtt in $(AMQTT_SIDE)"
	@echo "  make broker           make sure an MQTT broker listens on $(BROKER_HOST):$(BROKER_PORT) (starts mosquitto)"
	@echo "  make clean            remove $(VENV), build/, dist/ and site/"
	@echo
	@echo "  VENV=$(VENV)  PYTHON=$(PYTHON)  TORCH=$(TORCH)  WORKERS=$(WORKERS)"
	@echo "  CPU-only PyTorch:  make demo TORCH=\"torch torchvision --index-url https://download.pytorch.org/whl/cpu\""
	@echo "  keep the system's: make demo TORCH="

setup: system-packages venv

# apt-get only for what is missing; sudo only when not root; without either, say what to run.
system-packages:
	@missing=(); \
	ls $(FASHION_MNIST)/train-images-idx3-ubyte* >/dev/null 2>&1 || missing+=(dataset-fashion-mnist); \
	{ command -v mosquitto || test -x /usr/sbin/mosquitto; } >/dev/null 2>&1 || missing+=(mosquitto); \
	command -v openssl >/dev/null 2>&1 || missing+=(openssl); \
	if [ -n "$(BROWSER)" ]; then test -x /usr/bin/chromium || missing+=(chromium); test -x /usr/bin/chromedriver || missing+=(chromium-driver); fi; \
	if [ ! -x "$(VPY)" ] && ! $(PYTHON) -m ensurepip --version >/dev/null 2>&1; then \
	  missing+=(python$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv); fi; \
	if [ $${#missing[@]} -eq 0 ]; then echo "system-packages: $(APT_PACKAGES)$(if $(BROWSER), chromium chromium-driver) present"; exit 0; fi; \
	line="apt-get update && apt-get install -y $${missing[*]}"; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "error: missing $${missing[*]} and this system has no apt-get; install the equivalent packages (Fashion-MNIST IDX files in $(FASHION_MNIST), mosquitto, openssl) and run make again" >&2; exit 1; \
	fi; \
	if [ "$$(id -u)" -eq 0 ]; then sudo=(); \
	elif command -v sudo >/dev/null 2>&1; then sudo=(sudo); \
	else echo "error: missing $${missing[*]}; installing them needs root and sudo is not available. As root, run:" >&2; \
	     echo "    $$line" >&2; echo "then run make again." >&2; exit 1; \
	fi; \
	echo "system-packages: installing $${missing[*]}$${sudo:+ (with sudo)}"; \
	"$${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq; \
	"$${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$${missing[@]}"

$(VPY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: feast-edge needs Python >= 3.10, $(PYTHON) is " + sys.version.split()[0] + "; give another one with make PYTHON=python3.X")'
	$(PYTHON) -m venv --system-site-packages "$(VENV_DIR)" || { rm -rf "$(VENV_DIR)"; \
	  echo "error: '$(PYTHON) -m venv' failed; on Debian/Ubuntu install python3-venv (make system-packages does) and run make again" >&2; exit 1; }

# Re-run when pyproject.toml changes (dependencies, entry points, package mapping).
$(STAMP): pyproject.toml | $(VPY)
	@if $(VPY) -c 'import torch, torchvision' >/dev/null 2>&1; then \
	  echo "venv: using $$($(VPY) -c 'import torch; print("torch", torch.__version__, "from", torch.__file__.rsplit("/", 2)[0])')"; \
	elif [ -n "$(strip $(TORCH))" ]; then \
	  echo "venv: installing PyTorch: pip install $(TORCH)"; \
	  $(VPY) -m pip install $(TORCH); \
	else \
	  echo "venv: TORCH is empty and torch/torchvision cannot be imported; pip install -e will fetch them from PyPI"; \
	fi
	$(VPY) -m pip install -e '.[dev]'
	rm -rf "$(AMQTT_SIDE)" && $(VPY) -m pip install -q --no-deps --target "$(AMQTT_SIDE)" $(foreach p,$(AMQTT_PACKAGES),'$(p)')
	@# The venv must import this checkout (not an older install in the system or user site-packages); checked outside the checkout.
	@cd / && $(VPY) -c 'import sys, pathlib, feast_edge, feast_edge.server, feast_edge.agent; \
	root = pathlib.Path(sys.argv[1]).resolve(); \
	bad = [m.__name__ + " from " + m.__file__ for m in (feast_edge, feast_edge.server, feast_edge.agent) if root not in pathlib.Path(m.__file__).resolve().parents]; \
	bad and sys.exit("error: the venv imports " + "; ".join(bad) + ", not this checkout (" + str(root) + "); uninstall that copy (pip uninstall feast-edge) and run make again"); \
	print("venv: feast_edge from", pathlib.Path(feast_edge.__file__).parent)' "$(CURDIR)"
	@touch "$@"

venv: $(STAMP)

broker: system-packages
	@if (exec 3<>/dev/tcp/$(BROKER_HOST)/$(BROKER_PORT)) 2>/dev/null; then echo "broker: $(BROKER_HOST):$(BROKER_PORT) is listening"; exit 0; fi; \
	mosquitto=$$(command -v mosquitto || echo /usr/sbin/mosquitto); \
	if [ "$$(id -u)" -eq 0 ] && [ -f /etc/mosquitto/mosquitto.conf ]; then \
	  echo "broker: starting $$mosquitto -d -c /etc/mosquitto/mosquitto.conf"; "$$mosquitto" -d -c /etc/mosquitto/mosquitto.conf; \
	else \
	  echo "broker: starting $$mosquitto -d -p $(BROKER_PORT)"; "$$mosquitto" -d -p $(BROKER_PORT); \
	fi; \
	for _ in $$(seq 50); do (exec 3<>/dev/tcp/$(BROKER_HOST)/$(BROKER_PORT)) 2>/dev/null && exit 0; sleep 0.1; done; \
	echo "error: mosquitto did not start listening on $(BROKER_HOST):$(BROKER_PORT) within 5 s; start a broker there (e.g. 'sudo systemctl start mosquitto') and run make again" >&2; exit 1

# The tests also drive the dashboard in headless Chromium (Debian's chromium + chromium-driver); the demo does not need it.
# make test runs every test (CI: .ci/run); make test-fast leaves out those marked slow (pyproject.toml lists the markers).
test test-fast: BROWSER := 1
# PYTHONDONTWRITEBYTECODE is emptied for pytest (some machines set it): pytest then keeps its assertion-rewritten test
# modules in __pycache__ (git-ignored), and a second run collects the suite in 2 s instead of 7 s per worker.
TEST_ENV := $(RUN_ENV) PYTHONDONTWRITEBYTECODE=
test: setup broker
	cd "$(CURDIR)" && $(TEST_ENV) $(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: setup broker
	cd "$(CURDIR)" && $(TEST_ENV) $(VPY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

demo: setup
	$(RUN_ENV) $(VENV_DIR)/bin/feast-edge demo $(DEMO_ARGS)

# The documentation site (mkdocs.yml; docs/development.md, "Documentation"): strict, so a broken link, a missing
# anchor or a page left out of the nav fails it. The command-line reference is generated from the programs, so the
# package must be importable: the venv, not the system packages. Open site/index.html, or serve it with
# `$(VENV)/bin/python -m mkdocs serve`. The benchmark tables between bench-table markers are first rewritten from
# the records in bench/results/ (docs/development.md, "Benchmark records"); commit what that changes.
docs: venv
	cd "$(CURDIR)" && $(VPY) -m docs_hooks.bench_tables
	cd "$(CURDIR)" && NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf "$(VENV_DIR)" build dist site
