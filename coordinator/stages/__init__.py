"""Round stages behind seams with null objects: privacy, secure aggregation, guard, relay."""
