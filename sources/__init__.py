"""Replayable sources for Spark Structured Streaming, with offsets kept in Spark's checkpoint."""
