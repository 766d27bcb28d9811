"""Benchmarks behind ``kvstore bench``: each returns a ``BenchReport`` (``kvstore.bench.report``)
that ``write_report`` prints as a table and stores as JSON."""
