"""kiln.compiler."""
