"""One router per resource: generation, voices, openai, ops."""
