//! Staleness-weighted averaging of layer deltas (polynomial and hinge).
