# The README's two commands: `make demo` (quickstart) and `make test` (the suite).
# Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast bench lock clean

# constraints.txt pins every package the suite last passed with (`make lock` writes it), so a
# release made since does not change what `make test` tests.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/pip install -q --no-deps "tinker-cookbook==0.6.1"  # its tml-renderers pin is not on PyPI (pyproject.toml)
	touch $(STAMP)

# The quickstart: a tiny model, an SFT warm start, then GRPO that raises held-out accuracy.
demo: $(STAMP)
	test -f runs/quickstart/model/config.json || $(BIN)/slimish make-tiny-model runs/quickstart/model --arch llama --size tiny
	rm -rf runs/quickstart/run
	$(BIN)/slimish train --config configs/quickstart.yaml
	$(BIN)/slimish plot runs/quickstart/run

# Two pytest-xdist workers, a test file each at a time: the end-to-end runs leave a core idle for
# much of their time (process start-up, one-thread engines, waits on each other). Files sharing a
# session build go to one worker, the longest first (tests/conftest.py). TEST_WORKERS=0 runs the
# suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

# Everything but the minutes-long end-to-end runs and the runs that must learn (markers in pyproject.toml).
test-fast: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not learning"

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py
	$(BIN)/python benchmarks/rollout_throughput.py
	$(BIN)/python benchmarks/weight_sync.py
	$(BIN)/python benchmarks/vs_trl.py

# After upgrading a package in .venv and a green `make test`: pin what is installed now.
lock:
	echo "# make lock: the versions make test last passed with (torch: the Makefile's pin)" > constraints.txt
	$(BIN)/pip freeze --exclude-editable | grep -v '^torch==' >> constraints.txt

clean:
	rm -rf $(VENV) runs .pytest_cache
