"""A request's KV namespace: the deployment's namespace (model, layout, engine.tenant_salt) salted with the
request's tenant, so tenants never share cached KV while requests of one tenant do.

Every place that names KV by content derives it from here, bit for bit the same: the device prefix
cache (block hash chain seed), pool object keys and headers, and the router's routing index. The
empty tenant is the deployment's own namespace, unchanged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shared.hashing import namespace_seed

MAX_TENANT_CHARS = 256  # a tenant is a name (router.api_key_tenants), not data


def tenant_namespace(namespace: str, tenant: str = "") -> str:
    """The namespace a tenant's KV lives in (fits kv_object's 64-byte header field)."""
    if not tenant:
        return namespace
    salt = hashlib.blake2b(f"{namespace}\x1f{tenant}".encode(), digest_size=8).hexdigest()
    return f"{namespace}-t{salt}"


@dataclass(frozen=True)
class KVNamespace:
    """A request's namespace and the seed of its hash chains."""
    name: str
    seed: bytes

    @classmethod
    def of(cls, namespace: str, tenant: str = "") -> "KVNamespace":
        name = tenant_namespace(namespace, tenant)
        return cls(name, namespace_seed(name))
