"""Redis's own cost of moving log-probability vectors: redis-benchmark (C client) SET and GET of
values the size of one vector, on a private redis-server on a free port, with the server's CPU
time per operation read from ``INFO cpu`` before and after each run. CPU per operation is what
bounds one Redis node (one core serves commands); requests per second depend on what else the
machine runs.

    python scripts/redis_vector_cost.py [--total-gb 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
from typing import Any

import redis

from lmqueue.devstack import LocalRedis

SIZES = {"49,152": 49152, "128k (131,072)": 131072, "151,936": 151936}
BYTES = {"float32": 4, "float16": 2}


def _cpu_s(client: redis.Redis) -> float:
    info: dict[str, Any] = client.info("cpu")  # type: ignore[assignment]
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-gb", type=float, default=3.0, help="bytes moved per run")
    args = parser.parse_args()
    print("| vocabulary | dtype | value bytes | op | requests/s | Redis CPU us/op "
          "| ops/s per core |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    with LocalRedis() as server:
        client = redis.Redis(host="127.0.0.1", port=server.port)
        for vocab, size in SIZES.items():
            for dtype, width in BYTES.items():
                value = size * width
                count = max(1000, int(args.total_gb * 1e9 / value))
                for op in ("set", "get"):
                    before = _cpu_s(client)
                    out = subprocess.run(
                        ["redis-benchmark", "-p", str(server.port), "-d", str(value), "-t", op,
                         "-P", "8", "-c", "4", "-n", str(count), "-q"],
                        capture_output=True, text=True, check=True,
                    ).stdout  # fmt: skip
                    used_us = (_cpu_s(client) - before) * 1e6 / count
                    rate = float(re.findall(r"([\d.]+) requests per second", out)[-1])
                    print(f"| {vocab} | {dtype} | {value:,} | {op.upper()} | {rate:,.0f} | "
                          f"{used_us:.0f} | {1e6 / used_us:,.0f} |", flush=True)  # fmt: skip
        client.close()


if __name__ == "__main__":
    main()
