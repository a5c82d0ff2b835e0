//! `ep`: expert-parallel (MoE) dispatch and combine.
//!
//! Owns the user API: buffers, configuration, rank bootstrap, dispatch layout, dispatch/combine
//! (intranode and low-latency), handles and events, and the choice of real or emulated NIC.
