"""Operating a fleet: provisioning a broker, status, export, reports."""
