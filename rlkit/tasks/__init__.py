"""Tasks: prompts, reference answers and rewards, one task per file."""
