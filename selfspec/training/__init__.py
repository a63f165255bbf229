"""Self-distillation: the target model answers prompts itself (``data``), and draft heads learn its distributions."""
