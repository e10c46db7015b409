"""kiln: a compiler-driven LLM serving framework."""
