"""kiln.dsl."""
