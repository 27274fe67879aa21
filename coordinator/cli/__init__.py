"""`pfl-coord`: the coordinator's command line."""
