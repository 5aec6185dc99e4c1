"""The lmqueue application: command line, demo, local Redis, benchmarks."""

__all__: list[str] = []
