"""The aggregator tier: aggregators serve device groups and send partial aggregates upstream."""
