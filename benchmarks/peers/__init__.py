"""Standalone runs of one federated workload in each framework: pfl-edge's peers, side by side.

Each module here but `edge` imports only numpy, torch, the framework it runs and `common`, so it
runs in that framework's own virtual environment (`benchmarks.peers_harness` builds them).
"""
