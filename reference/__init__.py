"""The reference pipeline (payments from Kafka into PostgreSQL and Kafka), its config and its demo.
May import all of oncekit but verify/; pyspark only lazily, except in the processor Spark's workers run."""
