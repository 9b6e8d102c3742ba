"""/kv_state's affinity keys are keyed digests: a router holding the secret computes them from a
request, while hashing guessed API keys, tenants or salts without it recovers none of them."""

from __future__ import annotations

import pytest
from affinity_reference import unkeyed_digest

from kvjax.server.kv_state import DEFAULT_AFFINITY, affinity_key, read_affinity_secret

SECRET = "replica-secret"
# What a reader of /kv_state would try: every key of a small key space, the real one among them.
GUESSES = [f"Bearer sk-{i:04d}" for i in range(3000)]
REAL = "Bearer sk-1234"


def test_hashing_guessed_headers_without_the_secret_finds_no_reported_key():
    reported = affinity_key(REAL, None, None, secret=SECRET)
    # Unkeyed, the guess that hashes to the reported digest is the header itself.
    leaked = unkeyed_digest(REAL, None, None)
    found = [g for g in GUESSES if unkeyed_digest(g, None, None) == leaked]
    assert found == [REAL]
    # Keyed, no guess matches: not unkeyed, not under another secret or this process's key.
    for guess_key in (lambda g: unkeyed_digest(g, None, None),
                      lambda g: affinity_key(g, None, None, secret="another-secret"),
                      lambda g: affinity_key(g, None, None)):
        assert reported not in {guess_key(g) for g in GUESSES}
    # A router configured with the secret computes the replica's key from the request.
    assert affinity_key(REAL, None, None, secret=SECRET) == reported


def test_keys_tell_headers_tenants_and_salts_apart_and_the_default_is_fixed():
    keys = {affinity_key(*parts, secret=SECRET) for parts in (
        (REAL, None, None), (None, REAL, None), (None, None, REAL), (REAL, "", None),
        (REAL, "a", None), (REAL, None, "a"))}
    assert len(keys) == 6
    assert affinity_key(None, None, None, secret=SECRET) == DEFAULT_AFFINITY == \
        affinity_key(None, None, None)
    with pytest.raises(ValueError, match="affinity_secret"):
        affinity_key(REAL, None, None, secret="")


def test_a_secret_file_gives_router_and_replica_one_key(tmp_path):
    (tmp_path / "secret").write_text(f"  {SECRET}\n")
    secret = read_affinity_secret(str(tmp_path / "secret"))
    assert affinity_key(REAL, "t", None, secret=secret) == \
        affinity_key(REAL, "t", None, secret=SECRET)
    assert read_affinity_secret(None) is None
