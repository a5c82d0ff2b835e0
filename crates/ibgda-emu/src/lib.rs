//! `ibgda-emu`: a software mlx5 NIC.
//!
//! Owns: reading send rings at the indices the doorbells announce, executing the WQEs against
//! registered memory with the checks a NIC makes, writing CQEs (collapsed or ring), fault
//! injection and bandwidth/latency shaping, and the "fabric" that wires several ranks' NICs.
//!
//! Must not know about: who wrote the WQEs (device code must not tell a real NIC from this one),
//! experts or tokens.
