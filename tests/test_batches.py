"""Which methods share a job: quality (the reference first, in the first job) and system (the
baseline in every job); sizes as configured."""

from kvbench.batches import batches


def test_one_job_by_default_with_the_reference_first_even_if_unlisted():
    assert batches(["kivi2", "full", "snapkv"], "full", None) == [["full", "kivi2", "snapkv"]]
    assert batches(["kivi2", "snapkv"], "full", None) == [["full", "kivi2", "snapkv"]]


def test_jobs_of_a_given_size_keep_the_configured_order():
    assert batches(["full", "a", "b", "c"], "full", 1) == [["full"], ["a"], ["b"], ["c"]]
    assert batches(["full", "a", "b", "c", "d"], "full", 2) == [["full", "a"], ["b", "c"], ["d"]]


def test_system_jobs_each_start_with_the_baseline_so_every_method_is_paired_in_its_own_process():
    from kvbench.batches import paired_batches

    assert paired_batches(["full", "a", "b", "c"], "full", None) == [["full", "a", "b", "c"]]
    assert paired_batches(["a", "b", "c"], "full", 1) == [["full", "a"], ["full", "b"], ["full", "c"]]
    assert paired_batches(["a", "full", "b", "c"], "full", 2) == [["full", "a", "b"], ["full", "c"]]
    assert paired_batches(["full"], "full", None) == [["full"]]
