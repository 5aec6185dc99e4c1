"""Which Redis an ``lmq`` command talks to, said aloud when it is only the default."""

from __future__ import annotations

import sys

from shared.settings import mask_url, redis_url_source

__all__ = ["admin_url"]


def admin_url(flag: str | None, prog: str) -> str:
    """The URL `prog` uses: ``--redis-url``, else ``$LMQ_REDIS_URL``/``$REDIS_URL``, else
    the default, with a note on stderr that nothing named one (never silently 6379)."""
    url, source = redis_url_source(flag)
    if source == "default":
        print(
            f"{prog}: no --redis-url, LMQ_REDIS_URL or REDIS_URL given: using {mask_url(url)}",
            file=sys.stderr,
        )
    return url
