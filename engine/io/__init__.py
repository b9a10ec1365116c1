"""Reading and writing what the engine is given: checkpoints in the official layout, the tokenizer, LoRA adapters,
reference audio, and random-weight checkpoints of each family (tests, benchmarks, the demo service)."""
