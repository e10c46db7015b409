"""kiln.passes."""
