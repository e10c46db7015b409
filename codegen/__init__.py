"""kiln.codegen."""
