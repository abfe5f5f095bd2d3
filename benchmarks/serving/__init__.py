"""A real server over HTTP (`tests.support.live`): throughput, soaks, memory, admission and
fairness, first requests; the clients and the probes they share."""
