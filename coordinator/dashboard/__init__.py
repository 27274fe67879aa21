"""The read-only web dashboard: a board of what a fleet does, its feeds, and its server."""
