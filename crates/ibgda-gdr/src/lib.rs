//! A CPU view of GPU memory: GDRCopy (`libgdrapi.so.2`, loaded at run time) and a host-pinned
//! fallback with the same interface.
//!
//! Owns: opening GDRCopy, pinning and mapping GPU buffers, copies through the mapping, and the
//! clear errors when the library or `/dev/gdrdrv` is missing.
//!
//! Must not know about: NICs, queue pairs or the protocol that uses the mapping.
