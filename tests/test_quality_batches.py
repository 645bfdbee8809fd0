"""Which methods share a quality job: the reference first, in the first job; sizes as configured."""

from kvbench.quality.batches import batches


def test_one_job_by_default_with_the_reference_first_even_if_unlisted():
    assert batches(["kivi2", "full", "snapkv"], "full", None) == [["full", "kivi2", "snapkv"]]
    assert batches(["kivi2", "snapkv"], "full", None) == [["full", "kivi2", "snapkv"]]


def test_jobs_of_a_given_size_keep_the_configured_order():
    assert batches(["full", "a", "b", "c"], "full", 1) == [["full"], ["a"], ["b"], ["c"]]
    assert batches(["full", "a", "b", "c", "d"], "full", 2) == [["full", "a"], ["b", "c"], ["d"]]
