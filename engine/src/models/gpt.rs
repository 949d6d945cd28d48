//! The `gpt-tiny` character-level causal transformer.
