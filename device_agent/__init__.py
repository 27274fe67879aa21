"""The device side of pfl-edge: the agent loop, local updates, personal state and memory plan."""
