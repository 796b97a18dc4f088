"""The only part of the engine that imports pyspark: the stream writer that runs any sink under the
engine (``writer``), ``start_query`` and its checkpoint-complete listener (``query``), and the
session defaults (``session``). May import the rest of core; never sinks, sources or clients.
"""
