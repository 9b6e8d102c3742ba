"""What a reader of /kv_state without the affinity secret can compute: the unkeyed digest of a
request's Authorization header, tenant and cache_salt (the key /kv_state reported them under
before its digests were keyed), to test guesses against the keys it reports."""

from __future__ import annotations

import hashlib

from kvjax.server.kv_state import HASH_PREFIX_BYTES


def unkeyed_digest(authorization: str | None, tenant: str | None, salt: str | None) -> str:
    digest = hashlib.blake2b(digest_size=HASH_PREFIX_BYTES, person=b"kvjax-affinity")
    for part in (authorization, tenant, salt):
        data = b"" if part is None else part.encode()
        digest.update(bytes([part is not None]) + len(data).to_bytes(4, "little") + data)
    return digest.hexdigest()
