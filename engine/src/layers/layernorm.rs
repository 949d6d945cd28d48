//! Layer normalization over the last dimension with learned scale and shift.
