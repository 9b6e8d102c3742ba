import numpy as np
import pytest

from kvjax import shapes


def test_next_power_of_2_and_bucket():
    assert [shapes.next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]
    assert shapes.bucket(3, 8, 64) == 8 and shapes.bucket(100, 8, 64) == 64
    assert shapes.powers_of_2_up_to(5) == [1, 2, 4, 8]
    assert shapes.geometric_buckets(16, 256, 4) == [16, 64, 256]
    assert shapes.geometric_buckets(16, 100, 4) == [16, 64, 100]


def test_pad_repeat_last():
    np.testing.assert_array_equal(shapes.pad_repeat_last([3, 5, 7]), [3, 5, 7, 7])
    np.testing.assert_array_equal(shapes.pad_repeat_last([2], 4), [2, 2, 2, 2])
    assert shapes.pad_repeat_last([1, 2]).dtype == np.int32
    with pytest.raises(ValueError):
        shapes.pad_repeat_last([])


def test_floor_power_of_2():
    got = [shapes.floor_power_of_2(n) for n in (1, 2, 3, 4, 5, 1023, 1024)]
    assert got == [1, 2, 2, 4, 4, 512, 1024]
    with pytest.raises(ValueError, match="n >= 1"):
        shapes.floor_power_of_2(0)
