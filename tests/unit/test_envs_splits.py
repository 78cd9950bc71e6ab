"""The split rule and `SplitTasks`: distinct tasks of a split in generator order, a small space wrapping round."""

import pytest

from tidal.envs.splits import SplitTasks, check_split, in_split, is_heldout


def test_the_rule_is_one_bucket_in_ten_of_a_stable_hash():
    keys = [f"task {i}" for i in range(10_000)]
    held = [key for key in keys if is_heldout(key)]
    assert 0.09 < len(held) / len(keys) < 0.11
    assert all(in_split(key, "heldout") != in_split(key, "train") for key in keys[:100])
    assert is_heldout("crane") == is_heldout("crane")  # crc32: the same on every machine and run
    with pytest.raises(ValueError, match="split must be one of train, heldout"):
        check_split("test", "env")


def test_split_tasks_are_distinct_in_order_and_wrap_round_a_small_space():
    space = [f"word {i}" for i in range(300)]
    heldout = [key for key in space if is_heldout(key)]
    tasks = SplitTasks(lambda number: space[(number * 7) % 300], lambda key: key, "heldout", max_misses=2000)
    first = [tasks[i] for i in range(len(heldout))]
    assert sorted(first) == sorted(heldout)  # every held-out key once, nothing else
    assert tasks[len(heldout) + 3] == first[3] and tasks.exhausted  # then it starts over
    again = SplitTasks(lambda number: space[(number * 7) % 300], lambda key: key, "heldout", max_misses=2000)
    assert again[5] == first[5]  # the same item whatever was asked for before
    nothing = SplitTasks(lambda number: "always the same", lambda key: key, "heldout", max_misses=50)
    if not is_heldout("always the same"):
        with pytest.raises(ValueError, match="no task of the heldout split"):
            nothing[0]
