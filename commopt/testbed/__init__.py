"""An emulated cluster on one machine: hosts as network namespaces, links shaped with tc.

    >>> from commopt.testbed import emulated_cluster, measure_link, format_rate
    >>> with emulated_cluster(2, rate="1gbit") as cluster:  # doctest: +SKIP
    ...     print(format_rate(measure_link(cluster, 0, 1)))
    955 Mbit/s

``commopt launch -n N --link RATE -- COMMAND`` is the command-line face of this package;
docs/testbed.md describes the layout. Modules: netns (namespaces and their clean-up),
shaping (rates and tbf), agent (mpirun's way in), mpi and torch_dist (command lines and
environments of ranks), jobs (running them), link (measuring a link).
"""

from commopt.testbed.link import measure_link
from commopt.testbed.netns import (
    EmulatedCluster,
    Host,
    TestbedUnavailable,
    cleanup_stale,
    emulated_cluster,
    unavailable_reason,
)
from commopt.testbed.shaping import format_rate, parse_rate

__all__ = [
    "EmulatedCluster",
    "Host",
    "TestbedUnavailable",
    "cleanup_stale",
    "emulated_cluster",
    "format_rate",
    "measure_link",
    "parse_rate",
    "unavailable_reason",
]
