PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
STAMP_TEST := $(VENV)/.installed-test
STAMP_RUN := $(VENV)/.installed

.PHONY: test serve install loadtest bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(STAMP_TEST): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(STAMP_RUN)

install: $(STAMP_RUN)

test: $(STAMP_TEST)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

serve: $(STAMP_RUN)
	$(BIN)/kvserve fetch --model $(MODEL)
	$(BIN)/kvserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) build *.egg-info
