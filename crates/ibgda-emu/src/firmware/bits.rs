//! Big-endian bit fields, the way the PRM draws its structures: bit 0 is the most significant
//! bit of the first big-endian dword, and a field is an (offset, width) pair.
//!
//! The emulator's own reader and writer, independent of `ibgda-verbs`' command builders, so a
//! wrong offset on one side shows up as a refused command or a wrong value on the other.

/// One field of a PRM structure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bits {
    /// `struct.field`, for messages.
    pub name: &'static str,
    /// Offset in bits from the start of the enclosing structure.
    pub at: u32,
    /// Width in bits (at most 64; wider fields are read as bytes).
    pub width: u32,
}

impl Bits {
    pub(crate) const fn new(name: &'static str, at: u32, width: u32) -> Self {
        Self { name, at, width }
    }

    /// The same field inside a structure that starts `base` bits into an enclosing one.
    pub(crate) const fn within(self, base: u32) -> Self {
        Self {
            name: self.name,
            at: base + self.at,
            width: self.width,
        }
    }
}

/// The value of `f` in `buf` (bits beyond the buffer read as zero).
pub(crate) fn get(buf: &[u8], f: Bits) -> u64 {
    debug_assert!(f.width <= 64, "{} is wider than 64 bits", f.name);
    let mut v = 0u64;
    for i in 0..f.width {
        let bit = (f.at + i) as usize;
        let set = buf
            .get(bit / 8)
            .is_some_and(|byte| byte & (0x80 >> (bit % 8)) != 0);
        v = (v << 1) | u64::from(set);
    }
    v
}

/// Whether the one-bit field `f` is set.
pub(crate) fn flag(buf: &[u8], f: Bits) -> bool {
    get(buf, f) != 0
}

/// Writes `value` (truncated to the field's width) into `f` of `buf`.
///
/// # Panics
/// If the field lies outside `buf` (the output layouts are fixed; a miss is a table bug).
pub(crate) fn put(buf: &mut [u8], f: Bits, value: u64) {
    debug_assert!(f.width <= 64, "{} is wider than 64 bits", f.name);
    for i in 0..f.width {
        let bit = (f.at + i) as usize;
        let mask = 0x80u8 >> (bit % 8);
        let on = (value >> (f.width - 1 - i)) & 1 == 1;
        let byte = &mut buf[bit / 8];
        if on {
            *byte |= mask;
        } else {
            *byte &= !mask;
        }
    }
}

/// The `len` bytes at byte-aligned bit offset `at`.
pub(crate) fn bytes(buf: &[u8], at: u32, len: usize) -> Vec<u8> {
    let start = at as usize / 8;
    (start..start + len)
        .map(|i| buf.get(i).copied().unwrap_or(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_count_from_the_most_significant_bit() {
        let buf = [0x12, 0x34, 0x56, 0x78, 0x9a];
        assert_eq!(get(&buf, Bits::new("a", 0, 8)), 0x12);
        assert_eq!(get(&buf, Bits::new("b", 4, 8)), 0x23);
        assert_eq!(get(&buf, Bits::new("c", 8, 24)), 0x34_5678);
        assert_eq!(
            get(&buf, Bits::new("d", 0x20, 16)),
            0x9a00,
            "past the end reads zero"
        );
        assert!(flag(&buf, Bits::new("e", 3, 1)));
        let mut out = [0u8; 4];
        put(&mut out, Bits::new("f", 0x1c, 4), 0xf5);
        assert_eq!(out, [0, 0, 0, 0x05]);
        put(&mut out, Bits::new("g", 1, 3), 0b101);
        assert_eq!(out, [0x50, 0, 0, 0x05]);
        assert_eq!(bytes(&[1, 2, 3, 4], 8, 2), vec![2, 3]);
    }
}
