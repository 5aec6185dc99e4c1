"""Worker processes: drain a model's request stream in batches through one backend."""

__all__: list[str] = []
