"""Fault injection: real worker processes, a real redis-server (docs/RELIABILITY.md)."""
