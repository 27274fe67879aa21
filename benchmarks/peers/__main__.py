"""`python -m benchmarks.peers`: the peer comparison's one command (`benchmarks.peers_harness`)."""

from benchmarks.peers_harness import main

main()
