"""The deterministic simulation of overlapping drivers: the kit's real protocol code against
models of PostgreSQL, Kafka and the checkpoint storage, under a seeded scheduler (issue 46)."""
