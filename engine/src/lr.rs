//! Learning-rate schedules: linear warmup then cosine decay.
