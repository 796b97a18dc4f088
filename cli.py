"""The ``oncekit`` command line: ``run`` (a user's job), ``services up|down|status``, ``demo``,
``produce``, ``verify``, ``pipeline run``, ``savepoint create|list|restore|delete``, ``doctor``
and ``status``.

Every command parses its flags here and makes one call into the module that does it:
:mod:`oncekit.runner` (``run``), :mod:`oncekit.savepoints`, :mod:`oncekit.doctor`,
:mod:`oncekit.reference` (``demo``, ``produce``, ``pipeline``), :mod:`oncekit.verify`,
:mod:`oncekit.status`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import oncekit
from oncekit.connectors.services import BACKENDS
from oncekit.core.errors import ConfigError, OncekitError


SECURED_HELP = ("local backend: Kafka with SASL_SSL (SCRAM-SHA-256) only, PostgreSQL with TLS and "
                "scram-sha-256 only, certificates of a CA made for them")


def _run(args: argparse.Namespace) -> int:
    from oncekit import runner

    return runner.run_job(args.job, args.restart, args.standby, args.app_name, args.ui, args.host)


def _services(args: argparse.Namespace) -> int:
    from oncekit.connectors import services

    return services.command(args.action, args.backend, args.show_dsn, args.brokers, args.secured)


def _demo(args: argparse.Namespace) -> int:
    from oncekit.reference import demo

    return demo.main(args.backend, args.records, args.config, args.seed, crash=not args.no_crash, ui_port=args.ui)


def _verify(args: argparse.Namespace) -> int:
    from oncekit.verify import command

    if args.lifecycle:
        return command.lifecycle(args.backend, args.json)
    if args.soak:
        return command.soak(args.pipeline or "fan-out-postgres-kafka-wal", args.soak, args.seed, args.backend,
                            args.rate, args.fault_every, args.sample_every, args.json, args.periodic_faults)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # module:function from where the command runs, as python -m finds it
    return command.main(args.pipeline or "postgres-two-phase-commit", args.faults, args.seed, args.guarantee,
                        args.backend, args.duplicates, args.malformed, args.late, args.json, args.brokers,
                        args.secured, args.service_faults, args.input)


def _produce(args: argparse.Namespace) -> int:
    from oncekit.reference import commands
    from oncekit.reference.generator import Workload

    workload = Workload(count=args.count, accounts=args.accounts, duplicates=args.duplicates, late=args.late,
                        malformed=args.malformed, seed=args.seed)
    return commands.produce(args.bootstrap, args.topic, args.partitions, workload, args.rate)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags as dotted config keys (flags not given are None, which keeps the file's)."""
    return {"services.kafka_bootstrap": args.bootstrap, "services.postgres_dsn": args.dsn,
            "pipeline.checkpoint": args.checkpoint_root}


def _pipeline(args: argparse.Namespace) -> int:
    from oncekit.reference import commands

    return commands.run_pipeline(args.config, _overrides(args), args.from_savepoint, ui_port=args.ui,
                                 state_partitions=args.state_partitions, standby=args.standby)


SAVEPOINTS_FOLDER = "_savepoints"
"""Where a job's savepoints live unless ``--dir`` says, inside its checkpoint root: every host that
runs or asks for the job reaches the root, so the driver that writes a savepoint and the command
that asked for it agree on the place (Spark and the kit skip the folder: it holds no checkpoint)."""


def _savepoint(args: argparse.Namespace) -> int:
    from oncekit import savepoints

    if args.dir is None and args.checkpoint_root is None:
        raise ConfigError(f"savepoint {args.action}: give --checkpoint-root (the job's checkpoint root, whose savepoints "
                          f"live in ROOT/{SAVEPOINTS_FOLDER}) or --dir (where the savepoints live)")
    into = args.dir or f"{args.checkpoint_root.rstrip('/')}/{SAVEPOINTS_FOLDER}"
    # Each action has only its own flags (create: name, --timeout; restore: name, --into, --state-partitions).
    return savepoints.main(args.action, getattr(args, "name", None), into, args.checkpoint_root,
                           getattr(args, "timeout", 300.0), getattr(args, "state_partitions", None),
                           getattr(args, "into", None))


def _status(args: argparse.Namespace) -> int:
    from oncekit.status import command
    from oncekit.status.snapshot import Thresholds

    thresholds = Thresholds(transaction_timeout_s=args.transaction_timeout,
                            uncommitted_triggers=args.uncommitted_triggers)
    return command.main(args.checkpoint, args.port, args.host, args.bootstrap, args.dsn, thresholds, once=args.once)


def _doctor(args: argparse.Namespace) -> int:
    from oncekit import doctor

    if args.config:
        from oncekit.reference.config import load_with_services

        if args.topic or args.checkpoint:
            raise ConfigError("doctor: --config takes the topic and checkpoint from the pipeline's config; "
                              "give --topic and --checkpoint without it")
        flags = {"services.kafka_bootstrap": args.bootstrap, "services.postgres_dsn": args.dsn}
        return doctor.main(doctor.target_from_config(load_with_services(args.config, flags)))
    return doctor.main(doctor.target_from_flags(args.bootstrap, args.dsn, args.topic, args.checkpoint,
                                                args.two_phase_targets))


STATE_PARTITIONS_HELP = ("rescale the restored state to N partitions through Spark's offline repartitioning "
                         "(default: the savepoint's)")


def _add_pipeline_commands(commands: Any) -> None:
    """``pipeline run``, ``savepoint create|list|restore|delete``, ``doctor`` and ``status``."""
    def config_flags(command: argparse.ArgumentParser) -> None:
        command.add_argument("--config", help="pipeline config file (TOML); flags override it")
        command.add_argument("--bootstrap", help="Kafka bootstrap servers")
        command.add_argument("--dsn", help="PostgreSQL connection string (prefer ONCEKIT_POSTGRES_DSN: flags show in ps)")
        command.add_argument("--checkpoint-root", metavar="ROOT",
                             help="the pipeline's checkpoint root, whose subfolders are its queries' checkpoints")

    run = commands.add_parser("pipeline", help="run the reference pipeline under its restart strategy")
    run.add_argument("action", choices=["run"])
    run.add_argument("--from-savepoint", help="a savepoint folder to start from (the checkpoint location must be new)")
    run.add_argument("--state-partitions", type=int, metavar="N", help=STATE_PARTITIONS_HELP)
    run.add_argument("--ui", type=int, metavar="PORT", help="serve the status page and /metrics on this port while it runs")
    run.add_argument("--standby", action="store_true", help="start Spark and the pipeline's queries' plans now, then "
                     "wait until no other driver holds the checkpoints (its process gone, or its lease lapsed) and "
                     "take over")
    config_flags(run)
    run.set_defaults(run=_pipeline)

    saving = commands.add_parser("savepoint", help="create, list, restore or delete savepoints of any job's queries")
    actions = saving.add_subparsers(dest="action", required=True)
    helps = {"create": "stop the job running from --checkpoint-root with a savepoint, wherever its driver runs (or "
                       "copy a stopped job's checkpoints)",
             "list": "the job's savepoints", "restore": "copy a savepoint of the job into a new checkpoint root (--into)",
             "delete": "delete a savepoint of the job"}
    for action, text in helps.items():
        each = actions.add_parser(action, help=text)
        if action == "create":
            each.add_argument("name", nargs="?", help="savepoint name (default: a timestamp)")
            each.add_argument("--timeout", type=float, default=300.0,
                              help="seconds to wait for the running job to stop with it (default %(default)s)")
        elif action in ("restore", "delete"):
            each.add_argument("name", help="savepoint name (oncekit savepoint list shows them)")
        each.add_argument("--checkpoint-root", required=action == "create", metavar="ROOT",
                          help="the job's checkpoint root, whose subfolders are its queries' checkpoints (a path or a "
                               f"URI, which every host of the job reaches); its savepoints live in ROOT/{SAVEPOINTS_FOLDER}")
        each.add_argument("--dir", help=f"where the savepoints live instead of ROOT/{SAVEPOINTS_FOLDER} (a path or a URI)")
        if action == "restore":
            each.add_argument("--into", required=True, metavar="NEW_ROOT",
                              help="the new, empty checkpoint root to restore into; start the job from there")
            each.add_argument("--state-partitions", type=int, metavar="N", help=STATE_PARTITIONS_HELP)
        each.set_defaults(run=_savepoint)

    doctor = commands.add_parser("doctor", help="preflight checks of Java, Spark, Kafka and PostgreSQL for a job")
    doctor.add_argument("--bootstrap", help="Kafka bootstrap servers (default: ONCEKIT_KAFKA_BOOTSTRAP, or 'oncekit "
                                            "services up'; client settings from ONCEKIT_KAFKA_CLIENT_CONFIG)")
    doctor.add_argument("--dsn", help="PostgreSQL connection string (prefer ONCEKIT_POSTGRES_DSN: flags show in ps)")
    doctor.add_argument("--topic", action="append", default=[], help="a topic the job reads; repeat for several")
    doctor.add_argument("--checkpoint", action="append", default=[], metavar="LOCATION",
                        help="a query's checkpoint: its state partitions size the prepared transactions; repeat")
    doctor.add_argument("--two-phase-targets", type=int, default=1, metavar="N",
                        help="how many two-phase-commit sinks the job writes at once (default %(default)s)")
    doctor.add_argument("--config", help="the reference pipeline's config file (TOML): its addresses, topic, checkpoint "
                                         "and sinks instead of --topic, --checkpoint and --two-phase-targets")
    doctor.set_defaults(run=_doctor)

    status = commands.add_parser("status", help="status page and Prometheus /metrics for running or stopped queries")
    status.add_argument("--checkpoint", action="append", default=[], metavar="[NAME=]LOCATION",
                        help="a query's checkpoint location (local, hdfs://, s3a://); repeat for several")
    status.add_argument("--port", type=int, default=8765, help="port to serve on (default %(default)s)")
    status.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    status.add_argument("--bootstrap", help="Kafka bootstrap servers (default: ONCEKIT_KAFKA_BOOTSTRAP, or 'oncekit services up')")
    status.add_argument("--dsn", help="PostgreSQL connection string (prefer ONCEKIT_POSTGRES_DSN: flags show in ps)")
    status.add_argument("--transaction-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a prepared or open transaction older than this is red (the sinks' transaction timeout)")
    status.add_argument("--uncommitted-triggers", type=int, default=3, metavar="N",
                        help="a journaled batch still not committed N batches later is red")
    status.add_argument("--once", action="store_true", help="print the metrics once and exit instead of serving")
    status.set_defaults(run=_status)


def parser() -> argparse.ArgumentParser:
    """The whole command line: every command, subcommand and flag (the docs' CLI reference is
    made from it)."""
    root = argparse.ArgumentParser(prog="oncekit", description="Exactly-once Spark pipelines from Kafka into Kafka and PostgreSQL")
    root.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    root.add_argument("--version", action="version", version=f"oncekit {oncekit.__version__}",
                        help="print the version and exit")
    commands = root.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run your job (a function that starts its queries with start_query) under "
                                          "a restart strategy")
    run.add_argument("job", help="path/to/job.py[:function] or package.module:function (function default: start); "
                                 "it takes the Spark session and returns the queries it started")
    run.add_argument("--restart", default="fixed-delay:attempts=3,delay_s=1", metavar="TYPE:KEY=VALUE,...",
                     help="restart strategy: none, fixed-delay (attempts, delay_s), failure-rate (max_failures, "
                          "interval_s, delay_s) or exponential-backoff (initial_s, max_s, multiplier, attempts); "
                          "default %(default)s")
    run.add_argument("--standby", action="append", default=[], metavar="CHECKPOINT",
                     help="start as a warm standby of the driver running the job's queries on this checkpoint (repeat "
                          "for each): warm up, wait, and take over once that driver is gone")
    run.add_argument("--app-name", default="oncekit-job", help="the Spark application's name (default %(default)s)")
    run.add_argument("--ui", type=int, metavar="PORT", help="serve the status page and /metrics of the job's queries "
                                                             "on this port while it runs (the [status] extra)")
    run.add_argument("--host", default="127.0.0.1", help="the address --ui serves on (default %(default)s; 0.0.0.0: "
                                                          "every interface, for a Prometheus on another host)")
    run.set_defaults(run=_run)

    services = commands.add_parser("services", help="start, stop or check Kafka and PostgreSQL")
    services.add_argument("action", choices=["up", "down", "status"])
    services.add_argument("--backend", choices=BACKENDS, default="auto",
                          help="containers (testcontainers), local (local processes), external (ONCEKIT_KAFKA_BOOTSTRAP, ONCEKIT_POSTGRES_DSN), or auto")
    services.add_argument("--show-dsn", action="store_true", help="print the DSN with its password")
    services.add_argument("--brokers", type=int, default=1,
                          help="Kafka brokers: 1, or a KRaft cluster of 3 (replication 3, min.insync.replicas 2)")
    services.add_argument("--secured", action="store_true", help=SECURED_HELP)
    services.set_defaults(run=_services)

    demo = commands.add_parser("demo", help="the main job: the reference pipeline end to end, with a crash and a restart")
    demo.add_argument("--backend", choices=BACKENDS, help="services backend (default: the config's, auto)")
    demo.add_argument("--records", type=int, default=200_000, help="payment records to produce")
    demo.add_argument("--config", help="pipeline config file (TOML; default: the packaged pipeline.toml)")
    demo.add_argument("--seed", type=int, default=7, help="random seed of the generated events (default %(default)s)")
    demo.add_argument("--no-crash", action="store_true", help="do not crash the pipeline mid-run")
    demo.add_argument("--ui", type=int, metavar="PORT", help="serve the status page and /metrics on this port while it runs")
    demo.set_defaults(run=_demo)

    from oncekit.verify import EXAMPLES, GUARANTEES

    generate = commands.add_parser("produce", help="send payment events (with upstream faults) to Kafka")
    generate.add_argument("--bootstrap", help="Kafka bootstrap servers (default: the services oncekit started)")
    generate.add_argument("--topic", default="payments", help="the topic (created if missing; default %(default)s)")
    generate.add_argument("--partitions", type=int, default=2, help="partitions of a topic it creates (default %(default)s)")
    generate.add_argument("--count", type=int, default=10_000, help="events to send (default %(default)s)")
    generate.add_argument("--rate", type=float, help="events per second (default: as fast as possible)")
    generate.add_argument("--accounts", type=int, default=100, help="accounts the payments are spread over")
    generate.add_argument("--duplicates", type=float, default=0.01, help="fraction sent twice")
    generate.add_argument("--late", type=float, default=0.01, help="fraction an hour late in event time")
    generate.add_argument("--malformed", type=float, default=0.005, help="fraction of malformed records")
    generate.add_argument("--seed", type=int, default=1, help="random seed: the same seed sends the same events")
    generate.set_defaults(run=_produce)

    check = commands.add_parser("verify", help="inject faults into a pipeline and check its output")
    check.add_argument("--pipeline", help=f"one of the kit's examples ({', '.join(EXAMPLES)}) or module:function "
                       "(default postgres-two-phase-commit; for --soak fan-out-postgres-kafka-wal)")
    check.add_argument("--input", metavar="FILE", help="your job's input, one record value per line: feeds a job "
                       "as written, start(spark), which is judged against its own run without faults")
    check.add_argument("--guarantee", choices=GUARANTEES,
                       help="what to check (default: what the example promises; exactly-once for yours)")
    kinds = check.add_mutually_exclusive_group()
    kinds.add_argument("--faults", type=int, default=5, help="faults injected one after another (default %(default)s)")
    check.add_argument("--service-faults", action="store_true",
                       help="draw only service faults (Kafka and PostgreSQL stopped, killed -9, cut off; one broker "
                       "of a cluster), the ones that hit a running batch, instead of crash points and driver kills too")
    check.add_argument("--duplicates", type=float, default=0.0, help="fraction of input records sent twice upstream")
    check.add_argument("--malformed", type=float, default=0.0, help="fraction of malformed input records")
    check.add_argument("--late", type=float, default=0.0, help="fraction of input records an hour late")
    check.add_argument("--seed", type=int, default=1, help="random seed of the fault schedule and the input")
    check.add_argument("--backend", choices=BACKENDS, default="auto", help="services backend (default %(default)s)")
    check.add_argument("--json", help="write the results to this file")
    check.add_argument("--brokers", type=int, default=1,
                       help="Kafka brokers: 1, or 3 (a replicated cluster; the faults then include one broker's)")
    check.add_argument("--secured", action="store_true", help=SECURED_HELP)
    kinds.add_argument("--soak", metavar="DURATION", help="instead of --faults: run this long (30m, 2h) at a steady "
                       "input rate with a fault every --fault-every seconds, printing what must stay bounded")
    kinds.add_argument("--lifecycle", action="store_true", help="instead of --faults: the lifecycle cases (markers "
                       "past offsets retention, speculation, a replay with another partitioning, slow upstream input, "
                       "savepoints of a running query), each exactly-once or refused, on a broker of its own")
    check.add_argument("--rate", type=float, default=10.0, help="--soak: input records per second")
    check.add_argument("--fault-every", type=float, default=60.0, help="--soak: seconds between faults")
    check.add_argument("--sample-every", type=float, default=180.0, help="--soak: seconds between table rows")
    check.add_argument("--periodic-faults", default="", metavar="KIND=SECONDS,...",
                       help="--soak: instead of a drawn fault every --fault-every seconds, these service faults "
                       "(3 s down) at these intervals, as kafka-restart=120,postgres-restart=300")
    check.set_defaults(run=_verify)

    _add_pipeline_commands(commands)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except OncekitError as exc:
        print(f"oncekit: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
