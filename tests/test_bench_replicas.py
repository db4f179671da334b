"""`gdnspec bench replicas`: the batch sizes a runtime compiles when it serves a share of the rows beside others."""

import doctest

from bench import replicas


def test_a_replica_compiles_its_own_row_count_and_the_powers_of_4_below():
    assert replicas.replica_buckets(8) == (1, 4, 8)
    assert replicas.replica_buckets(16) == (1, 4, 16)
    assert replicas.replica_buckets(5) == (1, 4, 5)
    assert doctest.testmod(replicas).failed == 0
