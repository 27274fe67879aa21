"""The round engine: one round from cohort to aggregate, and the device-message intake."""
