"""Which Redis an ``lmq`` command talks to, said aloud when it is only the default."""

from __future__ import annotations

import sys

from lmqueue.shared.settings import mask_url, redis_url_source

__all__ = ["admin_url", "say_default_url"]


def admin_url(flag: str | None, prog: str) -> str:
    """The URL `prog` uses: ``--redis-url``, else ``$LMQ_REDIS_URL``/``$REDIS_URL``, else
    the default, with a note on stderr that nothing named one (never silently 6379)."""
    url, source = redis_url_source(flag)
    say_default_url(url, source, prog)
    return url


def say_default_url(url: str, source: str, prog: str) -> None:
    """Note on stderr that `url` is only the default (`source` from `redis_url_source`)."""
    if source == "default":
        print(
            f"{prog}: no --redis-url, LMQ_REDIS_URL or REDIS_URL given: using {mask_url(url)}",
            file=sys.stderr,
        )
