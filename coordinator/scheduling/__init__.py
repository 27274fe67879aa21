"""When and whom: synchronous rounds, buffered asynchronous aggregation, the simulated clock."""
