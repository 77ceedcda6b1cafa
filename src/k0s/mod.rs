//! The k0s compatibility layer (work in progress).
