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


class _Pools:
    """Page counts of a device and a host pool, moved as the KV cache manager moves them."""

    def __init__(self, free_device: int, host: dict[str, int]):
        self.free_device, self.host = free_device, dict(host)
        self.allocator = self

    def num_free_pages(self) -> int:
        return self.free_device

    def num_free_host_pages(self) -> int:
        return 99

    def num_host_pages(self, seq_id: str) -> int:
        return self.host.get(seq_id, 0)

    def cached_len(self, seq_id: str, num_computed: int) -> int:
        return num_computed

    def to_host(self, seq_id: str, num: int) -> bool:
        self.host[seq_id] = self.host.get(seq_id, 0) + num
        self.free_device += num
        return True

    def to_device(self, seq_id: str, num: int) -> bool:
        if num > self.free_device:
            return False
        self.host[seq_id] -= num
        self.free_device -= num
        return True


def test_a_row_the_controller_holds_on_the_host_comes_back_only_beyond_its_reserve():
    """`neo` at a host rate no row fits wants rows "a" and "b" (5 full pages each) on the
    device. "b" is the policy's own and comes back as soon as the device has room; "a", moved
    out by the controller (`hold`), stays on the host while bringing it back would leave
    fewer free pages than the controller's reserve, then comes back and is the policy's."""
    from kvjax import SamplingParams
    from kvjax.scheduler.placement import HostPlacement
    from kvjax.scheduler.request import SeqStatus, Sequence

    def running(seq_id):  # 21 tokens cached (5 full pages of 4), decoding its 22nd
        return Sequence(seq_id=seq_id, request_id=seq_id, tokens=[1] * 22,
                        num_prompt_tokens=21, sampling=SamplingParams(), seed=0,
                        arrival_time=0.0, order=0, status=SeqStatus.RUNNING, num_computed=21)

    a, b = running("a"), running("b")
    pools = _Pools(free_device=2, host={"b": 5})
    placement = HostPlacement(make_host_split("neo", host_tokens_per_s=1.0), pools, 4,
                              dict(host_offloads=0))
    assert placement.hold(a) and pools.host["a"] == 5 and pools.free_device == 7
    placement.place_rows([a, b], reserve=6)  # 7 - 5 < 6: "a" stays; "b" is not held
    assert pools.host == {"a": 5, "b": 0} and pools.free_device == 2
    pools.free_device = 10
    placement.place_rows([a, b], reserve=6)  # 10 - 5 < 6
    assert pools.host["a"] == 5
    pools.free_device = 11
    placement.place_rows([a, b], reserve=6)  # 11 - 5 >= 6: back, and the policy's again
    assert pools.host["a"] == 0 and pools.free_device == 6 and not placement.held
