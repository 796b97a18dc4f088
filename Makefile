# The two commands of the README, and the steps they are made of. Each does its own set-up.
#   make demo   the main job: services, Spark, Kafka in, PostgreSQL out
#   make test   type check and the whole test suite on real Kafka and PostgreSQL (testcontainers)
#   make test-long  every fault campaign at full size (100 faults each, a 30-minute soak)
#   make bench  the benchmarks: the kit beside its peers in one run (BENCH_ARGS="--records 200000");
#               its report, .oncekit/bench/report.md, goes to docs/bench/last-run.md to publish the run
#   make docs   the documentation site, strictly (a warning or an unresolved reference fails it), into .oncekit/docs

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-long bench docs wheel install broker connector engine browser typecheck compiled pytest clean

demo: install broker
	$(VENV)/bin/oncekit demo

# make test: the simulation of overlapping drivers (tests/sim) explores SIM_SCHEDULES schedules
# of each protocol and of a fan-out in a pytest run of its own, started first and run beside the
# set-up and the suite, in two processes at the lowest priority: it takes the CPU they leave idle
# while they wait on builds, services, restarts and recoveries, so it adds to the wall time only
# what is left of it when the suite ends (printed last). Both runs draw their faults from one
# ONCEKIT_VERIFY_SEED.
SIM_SCHEDULES ?= 10000
SIM_LOG := .oncekit/simulation.log
# The suite's make, named without $(MAKE) in the recipe: make -n would run a recipe line that
# names it, and so start the simulation, instead of printing it.
SUBMAKE := $(MAKE)

test: install compiled
	mkdir -p .oncekit; \
	export ONCEKIT_VERIFY_SEED=$${ONCEKIT_VERIFY_SEED:-$$(( $$(od -An -N4 -tu4 /dev/urandom) % 999999 + 1 ))}; \
	ONCEKIT_SIM_SCHEDULES=$(SIM_SCHEDULES) ONCEKIT_SIM_PROCESSES=2 nice -n 19 \
		$(PY) -m pytest -p no:cacheprovider tests/sim/test_simulation.py > $(SIM_LOG) 2>&1 & simulation=$$!; \
	$(SUBMAKE) --no-print-directory broker connector engine browser typecheck pytest \
		PYTEST_IGNORE=--ignore=tests/sim/test_simulation.py; suite=$$?; \
	ended=$$(date +%s); wait $$simulation; simulated=$$?; \
	if [ $$simulated -eq 0 ]; then tail -n 14 $(SIM_LOG); else cat $(SIM_LOG); fi; \
	echo "simulation: exit $$simulated, ended $$(( $$(date +%s) - ended )) s after the suite"; \
	[ $$suite -eq 0 ] && [ $$simulated -eq 0 ]

install: $(STAMP)

# The repository root is the package, so setuptools warns that a folder named like the package
# may shadow it; that is the layout, on purpose (PYTHONWARNINGS reaches the build backend).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install -q -e '.[dev]'
	touch $@

broker:
	docker/fetch-kafka.sh
	docker/kafka-tools/fetch.sh

# The kit's wheel, into dist/: oncekit is on no package index yet, and the getting-started page
# installs this file (the suite builds it the same way, tests/conftest.py).
wheel:
	PYTHONWARNINGS=ignore::UserWarning $(PYTHON) -m pip wheel --no-deps -q -w dist .

# The test suite builds the site as well (tests/docs/test_site.py) and opens it in chromium.
docs: install
	$(PY) -m sphinx -b html -W --keep-going -n -q docs .oncekit/docs
	@echo "the site: .oncekit/docs/index.html"

# Debian's chromium, which the status page's browser test drives through Playwright.
browser:
	docker/chromium/setup.sh

# A container engine for testcontainers: Docker if one answers, else Podman with locally built images.
# Spark's own Kafka connector (spark-sql-kafka-0-10) for the installed pyspark, from Maven
# Central: the crash-point tests and the benchmarks read through it as well as the kit's source.
connector: install
	docker/spark-kafka/fetch.sh "$$($(PY) -c 'import pyspark; print(pyspark.__version__)')" >/dev/null

engine:
	docker/podman/setup.sh

# mypy sees the repository root as the package through a link named oncekit.
typecheck: install
	mkdir -p .oncekit/typecheck && ln -sfn "$(CURDIR)" .oncekit/typecheck/oncekit
	cd .oncekit/typecheck && "$(CURDIR)/$(PY)" -m mypy --config-file "$(CURDIR)/pyproject.toml" -p oncekit

# The kit's modules compiled once, here: a machine with PYTHONDONTWRITEBYTECODE set (CI's) would
# otherwise compile them again in every Python process the suite starts (each Spark worker,
# planner and driver imports the kit: about 0.2 s of CPU each). Only edited modules compile again.
compiled: install
	$(PY) -m compileall -q -x '(^|/)(\.venv|\.oncekit|build|dist)/' . >/dev/null

# Two pytest-xdist workers, each with its own Kafka, PostgreSQL and Spark: much of the suite waits
# on restarts and recoveries, so two share the two cores well (tests/conftest.py keeps the tests
# of a module-scoped fixture in one worker). The 30 slowest tests are listed at the end, so CI's
# log shows where its 45 minutes go.
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=30

pytest: install compiled
	. .oncekit/engine.env && ONCEKIT_TEST_BACKEND=$${ONCEKIT_TEST_BACKEND:-containers} $(PY) -m pytest $(PYTEST_ARGS) \
		$(PYTEST_IGNORE)

# Every campaign at full size, beside the suite (not in CI): the randomized campaigns on both
# their pipelines with 100 faults each (the suite draws one, with 3), a 30-minute soak, the
# standby campaigns for all three of their pipelines (the suite draws one each), the parts of a
# campaign marked full_size and the larger fault lists of the others (tests/sizes.py), every
# crash-point case with each source connector (the suite draws one per case), and the simulation of
# overlapping drivers with 200,000 schedules per protocol and fan-out (1,200,000 in all), and a
# user's job on each older PySpark of the compatibility table (tests/eos/test_compat.py). The seed
# is drawn and printed as in make test (ONCEKIT_VERIFY_SEED to repeat a run).
CAMPAIGNS := tests/eos/test_verify_campaign.py tests/eos/test_verify_as_written.py tests/eos/test_soak.py tests/eos/test_standby.py tests/eos/test_kafka_cluster.py \
	tests/eos/test_kafka_sinks.py tests/eos/test_postgres_sinks.py tests/sim/test_simulation.py tests/eos/test_compat.py

test-long: install broker connector engine compiled
	. .oncekit/engine.env && ONCEKIT_TEST_BACKEND=$${ONCEKIT_TEST_BACKEND:-containers} ONCEKIT_VERIFY_FAULTS=100 \
		ONCEKIT_SOAK_S=1800 ONCEKIT_STANDBY_RUNS=3 ONCEKIT_TWO_STANDBY_RUNS=3 ONCEKIT_RANDOMIZED_RUNS=2 \
		ONCEKIT_CRASH_CONNECTORS=both ONCEKIT_FULL_SIZE=1 \
		ONCEKIT_SIM_SCHEDULES=200000 $(PY) -m pytest $(PYTEST_ARGS) $(CAMPAIGNS)

# Quix Streams, a peer in the benchmarks (the bench extra), runs in a venv of its own: it pins
# confluent-kafka below the version the kit's sinks need. Spark's Kafka connector, another peer,
# comes from Maven Central for the installed pyspark's version; Kafka Streams and Flink, two more,
# are built with Maven from benchmarks/jvm/.
QUIX_VENV  := .oncekit/quix-venv
QUIX_STAMP := $(QUIX_VENV)/.installed-stamp
BENCH_EXTRA = $(PY) -c 'import sys; toml = __import__("tomllib" if sys.version_info >= (3, 11) else "tomli"); \
	print(" ".join(toml.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench"]))'

bench: install broker connector engine $(QUIX_STAMP)
	benchmarks/jvm/build.sh kafka-streams
	benchmarks/jvm/build.sh flink
	. .oncekit/engine.env && $(PY) -m benchmarks --quix-python $(QUIX_VENV)/bin/python $(BENCH_ARGS)

$(QUIX_STAMP): pyproject.toml | install
	$(PYTHON) -m venv $(QUIX_VENV)
	$(QUIX_VENV)/bin/python -m pip install -q --upgrade pip
	$(QUIX_VENV)/bin/python -m pip install -q $$($(BENCH_EXTRA))
	touch $@

clean:
	rm -rf $(VENV) .oncekit build *.egg-info docker/kafka/target docker/kafka-tools/target benchmarks/jvm/*/target
