# Two commands on a fresh machine: `make run` (the main job) and `make test` (the tests).
# Each sets up .venv itself; see scripts/setup-env.sh for how torch is chosen.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lint check backends bench fuzz gpu-check clean

# make run's extras: the model (hf) and the PNG timelines of --timeline and plan --plot (plot).
$(VENV)/.installed-run: pyproject.toml scripts/setup-env.sh
	TIGHTFIT_VENV=$(VENV) scripts/setup-env.sh hf,plot
	touch $@

$(VENV)/.installed-test: pyproject.toml scripts/setup-env.sh
	TIGHTFIT_VENV=$(VENV) scripts/setup-env.sh test
	touch $@ $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(VENV)/bin/tightfit run

# Two workers at most: the CI machine has 2 cores, and each worker holds its own models.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n auto --maxprocesses=2

# The linter and formatter (settings in pyproject.toml); CI runs this before the tests.
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

check: $(VENV)/.installed-run
	$(VENV)/bin/tightfit check

backends: $(VENV)/.installed-run
	$(VENV)/bin/tightfit backends

bench: $(VENV)/.installed-test
	$(PY) benchmarks/casts.py
	$(PY) benchmarks/quant.py
	$(PY) benchmarks/casting.py
	$(PY) benchmarks/schedules.py
	$(PY) benchmarks/memory_plan.py

# Longer hostile-input campaigns than the tests run, in worker processes: 10,000 generated raw-op
# calls, 10,000 corrupted checkpoints and 2,000 hostile model folders (safetensors headers, shard
# indexes, config.json, tightfit-plan.json, quantization_config) through tightfit.load; all run,
# and the target fails if any finds something.
fuzz: $(VENV)/.installed-test
	$(PY) -m tightfit.ops.fuzz --count 10000 --seed $${SEED:-0}; ops=$$?; \
	$(PY) -m tightfit.quant.fuzz --count 10000 --seed $${SEED:-0}; quant=$$?; \
	$(PY) -m tightfit.loading.fuzz --count 2000 --seed $${SEED:-0}; loading=$$?; \
	[ $$ops -eq 0 ] && [ $$quant -eq 0 ] && [ $$loading -eq 0 ]

# The GPU check (scripts/gpu_check.py): the tests that skip without a GPU, then the per-op and decode
# benchmarks on the device, every figure as JSON and markdown into OUT. It runs on the machine's own
# Python, which keeps its own torch (a GPU machine may have no network: `scripts/gpu_bundle.py` gathers
# the rest into gpu-bundle/); DEVICE=cpu proves it end to end on the CPU at small sizes.
OUT ?= gpu-check-results
DEVICE ?= cuda
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --out $(OUT) --device $(DEVICE)

clean:
	rm -rf $(VENV)
