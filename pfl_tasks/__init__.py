"""Built-in tasks: models, offline data generators and non-IID partitioners."""
