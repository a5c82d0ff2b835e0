//! Big-endian integers: the only place the crate converts between host and wire byte order.
//!
//! Each type holds the wire bytes; [`new`](Be32::new) converts from a host value and
//! [`get`](Be32::get) back. They are `Pod`, so segments built from them can be cast to bytes.

use bytemuck::{Pod, Zeroable};
use core::fmt;

macro_rules! be_int {
    ($(#[$doc:meta])* $name:ident, $int:ty, $bytes:literal) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
        pub struct $name($int);

        impl $name {
            /// Zero (the same in both byte orders).
            pub const ZERO: Self = Self(0);

            /// The wire form of host value `v`.
            #[inline]
            pub const fn new(v: $int) -> Self {
                Self(v.to_be())
            }

            /// The host value.
            #[inline]
            pub const fn get(self) -> $int {
                <$int>::from_be(self.0)
            }

            /// The value from its wire bytes (most significant first).
            #[inline]
            pub const fn from_bytes(b: [u8; $bytes]) -> Self {
                Self(<$int>::from_ne_bytes(b))
            }

            /// The wire bytes (most significant first).
            #[inline]
            pub const fn to_bytes(self) -> [u8; $bytes] {
                self.0.to_ne_bytes()
            }
        }

        impl From<$int> for $name {
            fn from(v: $int) -> Self {
                Self::new(v)
            }
        }

        impl From<$name> for $int {
            fn from(v: $name) -> Self {
                v.get()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:#x})", stringify!($name), self.get())
            }
        }
    };
}

be_int!(
    /// A big-endian `u16` as it lies on the wire.
    Be16, u16, 2
);
be_int!(
    /// A big-endian `u32` as it lies on the wire.
    Be32, u32, 4
);
be_int!(
    /// A big-endian `u64` as it lies on the wire.
    Be64, u64, 8
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_most_significant_first() {
        assert_eq!(Be16::new(0x1234).to_bytes(), [0x12, 0x34]);
        assert_eq!(Be32::new(0x1234_5678).to_bytes(), [0x12, 0x34, 0x56, 0x78]);
        assert_eq!(
            Be64::new(0x0102_0304_0506_0708).to_bytes(),
            [1, 2, 3, 4, 5, 6, 7, 8]
        );
        assert_eq!(
            bytemuck::bytes_of(&Be32::new(0xdead_beef)),
            &[0xde, 0xad, 0xbe, 0xef]
        );
    }

    #[test]
    fn round_trips() {
        for v in [0u64, 1, 0xff, 0x1234_5678_9abc_def0, u64::MAX] {
            assert_eq!(Be64::new(v).get(), v);
            assert_eq!(Be64::from_bytes(Be64::new(v).to_bytes()), Be64::new(v));
            assert_eq!(Be32::new(v as u32).get(), v as u32);
            assert_eq!(Be16::new(v as u16).get(), v as u16);
        }
    }
}
