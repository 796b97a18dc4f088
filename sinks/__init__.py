"""Sinks for Kafka and PostgreSQL: idempotent, write-ahead-log and two-phase-commit protocols."""
