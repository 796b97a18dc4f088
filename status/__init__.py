"""The status page and Prometheus metrics: ``oncekit status``, and ``--ui PORT`` of ``oncekit
pipeline run`` and ``oncekit demo``.

- ``collector``: :class:`~oncekit.status.collector.StatusCollector` reads checkpoints and
  journals (through core's storage layer) and asks the services, into one immutable snapshot
  with its red states; ``snapshot``: that snapshot's frozen data classes, which the page and the
  metrics read;
- ``services``: the real questions to Kafka and PostgreSQL; ``kafka_transactions``: open Kafka
  transactions from the broker's own tool;
- ``metrics``: ``/metrics`` (prometheus_client); ``app``: the Starlette app and its uvicorn
  server; ``static/``: the page, its script and the vendored uPlot (MIT, its LICENSE beside it);
- ``command``: what the command line and the pipeline runners call.

May import core, connectors, prometheus_client, Starlette and uvicorn; never sinks, sources,
reference or Spark, so the page runs on any machine that reaches the checkpoints and services.
"""
