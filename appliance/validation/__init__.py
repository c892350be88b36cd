"""Structured output: JSON Schema to grammar for constrained decoding, and output validation."""
