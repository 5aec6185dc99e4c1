"""Which Redis versions lmqueue runs on: a hard floor, and the releases with the ACL fixes.

**Refused: anything older than 7.0** (`MINIMUM`). Every test of this project runs on Redis
7.0.15 (Debian's), the oldest version anything here was seen working on; nothing was run on
6.2. Older ones lack what the design stands on: tenants' users are built from ACL selectors
and ``%R~``/``%W~`` key permissions (7.0), and XAUTOCLAIM, the workers' reclaim path, appeared
in 6.2 and took its present reply (with the deleted entries it cleared from the pending list,
which lmqueue's XDELs can leave there) in 7.0; Redis 6.0 has no XAUTOCLAIM at all. A worker on
such a Redis would start and fail later, somewhere less clear.

**Warned about: a release without the 2026 ACL fixes** (`ACL_FIXED`, docs/SECURITY.md:
``XREAD``/``XREADGROUP`` key checks, fixed in 7.2.16, 7.4.11, 8.2.9, 8.4.6, 8.6.6, 8.8.2;
no 7.0 release has them). A warning, not a refusal: the bypass lets one ACL user read
another's streams, which matters only where tenants do not trust each other; a single-user
deployment, and this project's development machines and CI (7.0.15), are unaffected, and a
refusal would stop all of them for no gain. Versions of a line newer than any listed
(8.10, 9.x) are taken to carry the fixes.

The version comes from ``INFO server`` (``redis_version``), which every lmqueue ACL user may
run (`shared.tenants`); on a Redis Cluster each node answers and the oldest counts. A Redis
that cannot be reached at that moment is not checked (the worker starts and retries as it
always did: refusing would turn a Redis restart into a crash loop), nor one whose user may
not run INFO (a warning says so).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from redis.exceptions import NoPermissionError

from .connections import bounded, is_cluster
from .errors import SettingsError
from .redis_errors import REDIS_DOWN
from .settings import mask_url

__all__ = ["MINIMUM", "ACL_FIXED", "parse_version", "acl_fixed", "check_redis_version"]

logger = logging.getLogger(__name__)

#: The oldest Redis a worker starts on (see the module docstring).
MINIMUM = (7, 0, 0)
#: Per release line, the first patch release with the 2026 ACL key-check fixes.
ACL_FIXED = {(7, 2): 16, (7, 4): 11, (8, 2): 9, (8, 4): 6, (8, 6): 6, (8, 8): 2}
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"7.0.15"`` -> ``(7, 0, 15)``; a missing patch number is 0.

    Raises:
        ValueError: if `text` does not start with a version number.
    """
    match = _VERSION.match(text.strip())
    if match is None:
        raise ValueError(f"not a Redis version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def acl_fixed(version: tuple[int, int, int]) -> bool:
    """Whether `version` carries the 2026 ACL key-check fixes (`ACL_FIXED`)."""
    line = version[:2]
    if line in ACL_FIXED:
        return version[2] >= ACL_FIXED[line]
    return line > max(ACL_FIXED)


def _text(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def _versions(info: Any) -> list[str]:
    """``redis_version`` of an INFO reply: one instance's, or each node's of a cluster."""
    if "redis_version" in info:
        return [str(info["redis_version"])]
    return [str(node["redis_version"]) for node in info.values() if "redis_version" in node]


async def check_redis_version(
    client: Any, url: str, role: str = "queue", timeout_s: float = 10.0
) -> tuple[int, int, int] | None:
    """Refuse a Redis older than `MINIMUM`, warn about one without the ACL fixes.

    Returns:
        The version (the oldest node's, on a cluster); None where it could not be read.

    Raises:
        SettingsError: the Redis at `url` is older than `MINIMUM` (the version named).
    """
    try:
        every = {"target_nodes": client.ALL_NODES} if is_cluster(client) else {}
        info = await bounded(client.info("server", **every), timeout_s + 1, "INFO server")
    except NoPermissionError:
        logger.warning("cannot check the %s Redis's version: its user may not run INFO", role)
        return None
    except REDIS_DOWN as exc:
        logger.info("the %s Redis's version is not checked: unreachable now (%s)", role, exc)
        return None
    found = _versions(info)
    if not found:
        raise SettingsError(f"the {role} Redis at {mask_url(url)} did not report its version")
    version = min(parse_version(text) for text in found)
    if version < MINIMUM:
        raise SettingsError(
            f"the {role} Redis at {mask_url(url)} is Redis {_text(version)}; lmqueue needs "
            f"Redis {_text(MINIMUM)} or later (ACL selectors, XAUTOCLAIM as 7.0 answers it)",
            remedy="upgrade Redis: 7.2.16, 7.4.11 or a patched 8.x release "
            "(docs/SECURITY.md, Redis versions)",
        )
    if not acl_fixed(version):
        logger.warning(
            "the %s Redis at %s is Redis %s, which lacks the 2026 ACL fixes of XREAD and "
            "XREADGROUP key checks (7.2.16, 7.4.11, 8.2.9, 8.4.6, 8.6.6, 8.8.2): fine for one "
            "user, not for tenants who must not read each other's streams (docs/SECURITY.md)",
            role, mask_url(url), _text(version),
        )  # fmt: skip
    return version
