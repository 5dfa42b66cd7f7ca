"""The benchmark suites of spark_jax: ``python -m benchmarks <suite> [--tiny]`` (see __main__)."""
