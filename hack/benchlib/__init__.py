"""Benchmark pieces for `hack/bench.py`: the plugin under test, a bare gRPC echo, /proc
readings, the measurements and the report. Nothing here is imported by the product."""
