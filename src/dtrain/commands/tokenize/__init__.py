"""tokenize."""
