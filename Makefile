# The two commands of the README, and the steps they are made of. Each does its own set-up.
#   make demo   the main job: services, Spark, Kafka in, PostgreSQL out
#   make test   type check and the whole test suite on real Kafka and PostgreSQL (testcontainers)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test install broker engine typecheck pytest clean

demo: install broker
	$(VENV)/bin/oncekit demo

test: install broker engine typecheck pytest

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

broker:
	docker/fetch-kafka.sh

# A container engine for testcontainers: Docker if one answers, else Podman with locally built images.
engine:
	docker/podman/setup.sh

# mypy sees the repository root as the package through a link named oncekit.
typecheck: install
	mkdir -p .oncekit/typecheck && ln -sfn "$(CURDIR)" .oncekit/typecheck/oncekit
	cd .oncekit/typecheck && "$(CURDIR)/$(PY)" -m mypy --config-file "$(CURDIR)/pyproject.toml" -p oncekit

pytest: install
	. .oncekit/engine.env && ONCEKIT_TEST_BACKEND=$${ONCEKIT_TEST_BACKEND:-containers} $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .oncekit build *.egg-info docker/kafka/target
