//! Token + learned positional embeddings for character models.
