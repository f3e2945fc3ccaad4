"""Where the pool keeps objects: Mooncake's own replica descriptors, asked from a host of the cluster.

moorage's restore path does not record which segment served a read (`PoolClient.get_into` gets bytes, not
their origin), but Mooncake can say where each object lives: `batch_get_replica_desc` gives, per key, its
replicas with the transport endpoint ("ip:port") of the segment holding it. moorage puts one replica per
object and never moves one, so the segment that holds an object is the one a read of it was served from.

Run inside a namespace of the cluster (a pure client that contributes no memory):

    ip netns exec NS python -m tests.cluster.replicas --master 10.66.0.1:50051 --hostname 10.66.0.254 KEY...

prints {"key": [{"endpoint": "10.66.0.3:16491", "size": 1048704}], ...} as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    key: str
    address: str   # the IP of the host whose segment holds the object
    size: int      # bytes of the object (header included), what a read of it moves


def ask(prefix: list[str], master: str, hostname: str, keys: list[str]) -> list[Placement]:
    """Every key's placement, asked from inside the namespace `prefix` runs in; a key without a memory replica
    (missing, evicted) is left out."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([*prefix, sys.executable, "-m", "tests.cluster.replicas", "--master", master,
                        "--hostname", hostname, *keys], capture_output=True, text=True, timeout=120, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)})
    if r.returncode != 0:
        raise RuntimeError(f"replica query failed ({r.returncode}): {r.stderr[-2000:]}")
    found = json.loads(r.stdout.strip().splitlines()[-1])
    return [Placement(k, reps[0]["endpoint"].rpartition(":")[0], reps[0]["size"])
            for k, reps in found.items() if reps]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", required=True)
    p.add_argument("--hostname", required=True, help="this client's address (where the master reaches it)")
    p.add_argument("keys", nargs="+")
    args = p.parse_args(argv)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(args.hostname, "P2PHANDSHAKE", 0, 0, "tcp", "", args.master)
    if rc != 0:
        print(f"setup against {args.master} failed: {rc}", file=sys.stderr)
        return 1
    try:
        found = store.batch_get_replica_desc(args.keys)
        out = {}
        for key in args.keys:
            reps = [r.get_memory_descriptor().buffer_descriptor for r in found.get(key, []) if r.is_memory_replica()]
            out[key] = [{"endpoint": d.transport_endpoint, "size": d.size} for d in reps]
    finally:
        store.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
