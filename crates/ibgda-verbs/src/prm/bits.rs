//! Big-endian bit fields as the PRM lays them out.
//!
//! `mlx5_ifc.h` describes every firmware structure as a sequence of `u8 name[width]` bit arrays:
//! a field's offset is the sum of the widths before it, counted from bit 0 = the most significant
//! bit of the first big-endian dword. [`Field`] records that (offset, width) pair under the
//! field's name, [`BitWriter`] sets fields into a zeroed command image, and [`BitReader`] reads
//! them back (for command outputs and for tests).

use std::fmt;

/// One named field of a PRM structure.
///
/// `bit` counts from the most significant bit of the structure's first big-endian dword, exactly
/// as the `reserved_at_<hex>` names of `mlx5_ifc.h` do. A field of up to 32 bits lies inside one
/// dword; a 64-bit field starts on a dword boundary; a byte-array field (`width` a multiple of 8,
/// more than 64 bits) starts on a byte boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// The PRM name, `struct.field` (used in error messages).
    pub name: &'static str,
    /// Offset in bits from the start of the enclosing structure.
    pub bit: u32,
    /// Width in bits.
    pub width: u32,
}

impl Field {
    /// A field at `bit` of width `width`.
    pub const fn new(name: &'static str, bit: u32, width: u32) -> Self {
        Self { name, bit, width }
    }

    /// The same field inside a structure that starts `base` bits into an enclosing one
    /// (e.g. a `qpc` field inside `create_qp_in`, whose `qpc` starts at bit 0xc0).
    pub const fn at(self, base: u32) -> Self {
        Self {
            name: self.name,
            bit: base + self.bit,
            width: self.width,
        }
    }

    /// First bit past the field.
    pub const fn end(&self) -> u32 {
        self.bit + self.width
    }

    /// Whether the field obeys the placement rules above (checked by tests for every constant).
    pub const fn is_well_placed(&self) -> bool {
        if self.width == 0 {
            return false;
        }
        if self.width <= 32 {
            self.bit / 32 == (self.bit + self.width - 1) / 32
        } else if self.width == 64 {
            self.bit % 32 == 0
        } else {
            self.bit % 8 == 0 && self.width % 8 == 0
        }
    }
}

/// Why a field could not be written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrmError {
    /// The value has bits above the field's width.
    #[error("value {value:#x} does not fit in {field} ({width} bits)")]
    Overflow {
        /// The field's PRM name.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The field's width in bits.
        width: u32,
    },
    /// A byte-array field was given the wrong number of bytes.
    #[error("{field} takes {expected} bytes, got {got}")]
    Length {
        /// The field's PRM name.
        field: &'static str,
        /// Bytes the field holds.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// The field lies outside the buffer or breaks the placement rules (a bug in a layout table).
    #[error("{field} (bit {bit:#x}, width {width}) does not fit a {len}-byte structure")]
    Placement {
        /// The field's PRM name.
        field: &'static str,
        /// Its offset in bits.
        bit: u32,
        /// Its width in bits.
        width: u32,
        /// The buffer length in bytes.
        len: usize,
    },
}

fn check_placement(field: Field, len: usize) -> Result<(), PrmError> {
    if !field.is_well_placed() || field.end() as usize > len * 8 {
        return Err(PrmError::Placement {
            field: field.name,
            bit: field.bit,
            width: field.width,
            len,
        });
    }
    Ok(())
}

fn read_dword(buf: &[u8], index: usize) -> u32 {
    let b = &buf[index * 4..index * 4 + 4];
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn write_dword(buf: &mut [u8], index: usize, v: u32) {
    buf[index * 4..index * 4 + 4].copy_from_slice(&v.to_be_bytes());
}

/// Mask and shift of a field of at most 32 bits inside its dword.
fn dword_mask_shift(field: Field) -> (u32, u32) {
    let shift = 32 - (field.bit % 32) - field.width;
    let mask = if field.width == 32 {
        u32::MAX
    } else {
        ((1u32 << field.width) - 1) << shift
    };
    (mask, shift)
}

/// Builds a command image: a zeroed buffer of a fixed length into which fields are set.
///
/// ```
/// use ibgda_verbs::prm::{BitReader, BitWriter, Field};
/// const OPCODE: Field = Field::new("create_cq_in.opcode", 0x00, 16);
/// const LOG_CQ_SIZE: Field = Field::new("cqc.log_cq_size", 0x63, 5);
/// let mut w = BitWriter::new(16);
/// w.put(OPCODE, 0x400)?.put(LOG_CQ_SIZE, 7)?;
/// let image = w.finish();
/// assert_eq!(&image[0..2], &[0x04, 0x00]);
/// assert_eq!(image[12], 7); // bits 0x63..0x68 = the low 5 bits of byte 12
/// assert_eq!(BitReader::new(&image).get(LOG_CQ_SIZE), 7);
/// # Ok::<(), ibgda_verbs::prm::PrmError>(())
/// ```
#[derive(Clone, Debug)]
pub struct BitWriter {
    buf: Vec<u8>,
}

impl BitWriter {
    /// A zeroed image of `len` bytes (a multiple of 4, as every PRM structure is).
    pub fn new(len: usize) -> Self {
        debug_assert!(len % 4 == 0, "PRM structures are whole dwords");
        Self { buf: vec![0; len] }
    }

    /// Sets `field` to `value` (up to 64 bits), big-endian, leaving every other bit unchanged.
    pub fn put(&mut self, field: Field, value: u64) -> Result<&mut Self, PrmError> {
        check_placement(field, self.buf.len())?;
        if field.width < 64 && value >> field.width != 0 {
            return Err(PrmError::Overflow {
                field: field.name,
                value,
                width: field.width,
            });
        }
        if field.width == 64 {
            let dw = field.bit as usize / 32;
            write_dword(&mut self.buf, dw, (value >> 32) as u32);
            write_dword(&mut self.buf, dw + 1, value as u32);
        } else if field.width <= 32 {
            let (mask, shift) = dword_mask_shift(field);
            let dw = field.bit as usize / 32;
            let old = read_dword(&self.buf, dw);
            write_dword(
                &mut self.buf,
                dw,
                (old & !mask) | (((value as u32) << shift) & mask),
            );
        } else {
            return Err(PrmError::Placement {
                field: field.name,
                bit: field.bit,
                width: field.width,
                len: self.buf.len(),
            });
        }
        Ok(self)
    }

    /// Sets `field` to `true`/`false` (a one-bit flag).
    pub fn flag(&mut self, field: Field, on: bool) -> Result<&mut Self, PrmError> {
        self.put(field, u64::from(on))
    }

    /// Copies `bytes` into a byte-array field (a GID, for instance), first byte first.
    pub fn put_bytes(&mut self, field: Field, bytes: &[u8]) -> Result<&mut Self, PrmError> {
        check_placement(field, self.buf.len())?;
        let expected = field.width as usize / 8;
        if field.bit % 8 != 0 || field.width % 8 != 0 {
            return Err(PrmError::Placement {
                field: field.name,
                bit: field.bit,
                width: field.width,
                len: self.buf.len(),
            });
        }
        if bytes.len() != expected {
            return Err(PrmError::Length {
                field: field.name,
                expected,
                got: bytes.len(),
            });
        }
        let start = field.bit as usize / 8;
        self.buf[start..start + expected].copy_from_slice(bytes);
        Ok(self)
    }

    /// The image so far.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The finished image.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads fields of a PRM structure (a command output, or an image in tests).
#[derive(Clone, Copy)]
pub struct BitReader<'a> {
    buf: &'a [u8],
}

impl fmt::Debug for BitReader<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BitReader")
            .field("len", &self.buf.len())
            .finish()
    }
}

impl<'a> BitReader<'a> {
    /// A reader over `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    /// The value of `field` (up to 64 bits).
    ///
    /// # Panics
    /// If the field lies outside the buffer or is a byte array: layout tables are constants,
    /// so this is a bug in the table, caught by the crate's tests.
    pub fn get(&self, field: Field) -> u64 {
        if let Err(e) = check_placement(field, self.buf.len()) {
            panic!("{e}");
        }
        match field.width {
            64 => {
                let dw = field.bit as usize / 32;
                (u64::from(read_dword(self.buf, dw)) << 32)
                    | u64::from(read_dword(self.buf, dw + 1))
            }
            w if w <= 32 => {
                let (mask, shift) = dword_mask_shift(field);
                u64::from((read_dword(self.buf, field.bit as usize / 32) & mask) >> shift)
            }
            _ => panic!("{} is a byte array: use BitReader::bytes", field.name),
        }
    }

    /// Whether a one-bit flag is set.
    pub fn flag(&self, field: Field) -> bool {
        self.get(field) != 0
    }

    /// The bytes of a byte-array field.
    ///
    /// # Panics
    /// As [`BitReader::get`].
    pub fn bytes(&self, field: Field) -> &'a [u8] {
        if let Err(e) = check_placement(field, self.buf.len()) {
            panic!("{e}");
        }
        let start = field.bit as usize / 8;
        &self.buf[start..start + field.width as usize / 8]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn msb_first_within_big_endian_dwords() {
        let mut w = BitWriter::new(8);
        // Bit 0 is the MSB of byte 0.
        w.put(Field::new("a", 0, 1), 1).unwrap();
        assert_eq!(w.as_bytes(), &[0x80, 0, 0, 0, 0, 0, 0, 0]);
        // A 24-bit field at bit 8 fills bytes 1..4 big-endian.
        w.put(Field::new("b", 8, 24), 0x123456).unwrap();
        assert_eq!(w.as_bytes(), &[0x80, 0x12, 0x34, 0x56, 0, 0, 0, 0]);
        // The last bit of dword 1 is bit 63 = the LSB of byte 7.
        w.put(Field::new("c", 63, 1), 1).unwrap();
        assert_eq!(w.as_bytes()[7], 1);
    }

    #[test]
    fn sixty_four_bit_fields_are_two_big_endian_dwords() {
        let mut w = BitWriter::new(8);
        w.put(Field::new("addr", 0, 64), 0x0102_0304_0506_0708)
            .unwrap();
        assert_eq!(w.as_bytes(), &[1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn overflow_is_an_error_naming_the_field() {
        let mut w = BitWriter::new(4);
        let e = w
            .put(Field::new("qpc.log_sq_size", 0x11, 4), 16)
            .unwrap_err();
        assert_eq!(
            e,
            PrmError::Overflow {
                field: "qpc.log_sq_size",
                value: 16,
                width: 4
            }
        );
        assert!(e.to_string().contains("qpc.log_sq_size"));
        assert_eq!(w.as_bytes(), &[0; 4], "a refused write changes nothing");
    }

    #[test]
    fn bad_placement_is_an_error() {
        let mut w = BitWriter::new(4);
        // Crosses a dword boundary.
        assert!(matches!(
            w.put(Field::new("x", 24, 16), 1),
            Err(PrmError::Placement { .. })
        ));
        // Past the end.
        assert!(matches!(
            w.put(Field::new("y", 32, 8), 1),
            Err(PrmError::Placement { .. })
        ));
        // A 64-bit field off a dword boundary.
        assert!(!Field::new("z", 16, 64).is_well_placed());
    }

    #[test]
    fn byte_arrays() {
        let mut w = BitWriter::new(24);
        let gid: [u8; 16] = core::array::from_fn(|i| i as u8 + 1);
        let f = Field::new("ads.rgid_rip", 0x20, 128);
        w.put_bytes(f, &gid).unwrap();
        assert_eq!(&w.as_bytes()[4..20], &gid);
        assert_eq!(BitReader::new(w.as_bytes()).bytes(f), &gid);
        assert!(matches!(
            w.put_bytes(f, &gid[..4]),
            Err(PrmError::Length {
                expected: 16,
                got: 4,
                ..
            })
        ));
    }

    proptest! {
        /// Any field round-trips, and writing it leaves every bit outside it untouched.
        #[test]
        fn round_trip_and_isolation(bit in 0u32..256, width in 1u32..=32, raw in any::<u64>(), fill in any::<u8>()) {
            let field = Field::new("f", bit, width);
            prop_assume!(field.is_well_placed());
            let value = raw & ((1u64 << width) - 1);
            let mut w = BitWriter::new(36);
            w.buf.iter_mut().for_each(|b| *b = fill);
            let before = w.as_bytes().to_vec();
            w.put(field, value).unwrap();
            prop_assert_eq!(BitReader::new(w.as_bytes()).get(field), value);
            for i in 0..36 * 8u32 {
                if i < field.bit || i >= field.end() {
                    let byte = (i / 8) as usize;
                    let mask = 0x80u8 >> (i % 8);
                    prop_assert_eq!(w.as_bytes()[byte] & mask, before[byte] & mask, "bit {} changed", i);
                }
            }
        }
    }
}
