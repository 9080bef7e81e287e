"""Base models: the built-in tiny Llama, and loading any HF model/tokenizer folder or hub id."""
