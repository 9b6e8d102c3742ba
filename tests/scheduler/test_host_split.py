"""Split policies: each returns host-page targets within each row's full pages, by its rule."""

from __future__ import annotations

import pytest

from kvjax.scheduler.host_split import HOST_SPLITS, RowPlacement, make_host_split

ROWS = [RowPlacement("a", 100, 6, 0), RowPlacement("b", 40, 2, 2), RowPlacement("c", 9, 0, 0)]


def test_registry_names_and_simple_rules():
    assert set(HOST_SPLITS) == {"never", "when_full", "always", "random", "neo"}
    assert make_host_split("never").targets(ROWS, 0, 99) == {}
    assert not make_host_split("never").uses_host
    assert make_host_split("when_full").offloads_when_full
    assert make_host_split("always").targets(ROWS, 0, 99) == {"a": 6, "b": 2, "c": 0}


def test_random_split_is_seeded_and_within_full_pages():
    first = [make_host_split("random", seed=5).targets(ROWS, 0, 99) for _ in range(2)]
    assert first[0] == first[1]
    policy = make_host_split("random", seed=5)
    for _ in range(20):
        targets = policy.targets(ROWS, 0, 99)
        assert all(0 <= targets[r.seq_id] <= r.num_full_pages for r in ROWS)


def test_neo_moves_rows_while_host_time_fits_the_device_step():
    # Host: 1000 tokens/s; device step 0.1 s + tokens at 1e4/s. Row a (100 tokens) costs
    # 0.1 s on the host against a device step of 0.1 + 149/1e4 - 0.01 s: it fits; then row b
    # (40 tokens, 0.04 s) would bring the host to 0.14 s, past the device's 0.1109 s.
    policy = make_host_split("neo", host_tokens_per_s=1e3, device_tokens_per_s=1e4,
                             device_step_s=0.1)
    assert policy.targets(ROWS, 10, 99) == {"a": 6, "b": 0, "c": 0}
    assert policy.targets(ROWS, 10, 3)["a"] == 0  # no host room for its 6 pages
    with pytest.raises(ValueError, match="host_tokens_per_s"):
        make_host_split("neo", host_tokens_per_s=0)
    with pytest.raises(ValueError, match="when_full split: device_step_s must be a number"):
        make_host_split("when_full", device_step_s="fast")
    with pytest.raises(ValueError, match="unknown host split policy"):
        make_host_split("sometimes")
