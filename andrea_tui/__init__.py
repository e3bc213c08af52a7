"""ANDREA terminal app: launches, watches and steers training runs."""
