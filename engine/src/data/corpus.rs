//! Character corpus (tinyshakespeare) with a vocabulary and train/validation split.
