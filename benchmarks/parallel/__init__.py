"""Work spread over workers and threads: stages, replicas, a lone request's rows, a lone call's
tokens (sequence) and blocks (tensor), thread counts, and the planner's counted costs that choose
among them against the clock."""
