"""The Redis ACL rules a tenant needs to use experiments, and nothing of anyone else's.

A tenant's experiment keys all start with ``<prefix>:<tenant>:exp:`` (see `shared.keys`);
the scheduler's own bookkeeping is under ``<prefix>:_sched:`` and arq's under ``arq:``, which
no tenant pattern covers. The scheduler itself runs as a user with access to both (for
example the operator's, or one granted ``~arq:* ~<prefix>:*``); with a separate control plane
(`scheduler.planes`), ``~<prefix>:*`` on the data Redis and ``~arq:* ~<prefix>:_sched:*`` on
the control instance.
"""

from __future__ import annotations

from lmqueue.shared.keys import KeySpace
from lmqueue.shared.tenants import EXPERIMENT_COMMANDS as _GRANTED

__all__ = ["experiment_acl_rules", "EXPERIMENT_COMMANDS"]

#: Commands `producer.Experiments` sends (granted by name: see FACTS.md on command categories);
#: the tenant ACL generator (`shared.tenants.tenant_acl_rules`) grants the same ones.
EXPERIMENT_COMMANDS = (*(command.removeprefix("+") for command in _GRANTED), "ping")


def experiment_acl_rules(tenant: str, prefix: str = "lmq") -> list[str]:
    """The ``ACL SETUSER`` rules that let `tenant` submit, watch, cancel and read its experiments.

    To be merged with the tenant's other rules (request streams, registry reads).
    """
    keys = KeySpace(prefix, tenant)
    pattern = keys.experiment_inbox().rsplit(":", 1)[0] + ":*"  # <prefix>:<tenant>:exp:*
    return [f"~{pattern}", *(f"+{command}" for command in EXPERIMENT_COMMANDS)]
