# The README's commands. Each installs what it needs into ./.venv first.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: demo test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml ops/install.sh
	bash ops/install.sh
	touch $@

demo: install
	$(VENV)/bin/gyre run learning

test: install
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
