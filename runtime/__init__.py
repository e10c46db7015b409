"""kiln.runtime."""
