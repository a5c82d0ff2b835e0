//! Element types of device tensors: BF16 and FP8 e4m3 as plain bit newtypes, with exact CPU
//! conversions (round to nearest even), so no half-precision crate is needed.

use bytemuck::{Pod, Zeroable};

/// A bfloat16 value, stored as its 16 bits.
///
/// ```
/// use ep::Bf16;
/// assert_eq!(Bf16::from_f32(1.5).to_f32(), 1.5);
/// assert_eq!(Bf16::from_f32(1.0 + 2.0 / 512.0).to_f32(), 1.0); // ties to even
/// ```
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Rounds `f` to the nearest bfloat16 (ties to even); NaN stays NaN.
    pub fn from_f32(f: f32) -> Self {
        let u = f.to_bits();
        if f.is_nan() {
            return Self(((u >> 16) as u16) | 0x40);
        }
        let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1));
        Self((rounded >> 16) as u16)
    }

    /// The exact f32 value.
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// An FP8 e4m3 (OCP "E4M3FN": no infinities, one NaN pattern per sign) value, stored as its bits.
///
/// ```
/// use ep::Fp8E4M3;
/// assert_eq!(Fp8E4M3::from_f32(448.0).to_f32(), 448.0);
/// assert_eq!(Fp8E4M3::from_f32(1000.0).to_f32(), 448.0); // saturates
/// assert_eq!(Fp8E4M3::from_f32(0.0625).0, 0x18);
/// ```
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct Fp8E4M3(pub u8);

impl Fp8E4M3 {
    /// The largest finite value.
    pub const MAX: f32 = 448.0;

    /// Rounds `f` to the nearest e4m3 value (ties to even), saturating to ±448; NaN → 0x7f.
    pub fn from_f32(f: f32) -> Self {
        if f.is_nan() {
            return Self(0x7f);
        }
        let sign = if f.is_sign_negative() { 0x80u8 } else { 0 };
        let a = f.abs();
        if a >= Self::MAX {
            return Self(sign | 0x7e);
        }
        // Subnormals are multiples of 2^-9; normals have 3 mantissa bits. Scale so the step of
        // a's binade becomes 1, round to nearest even, and rebuild.
        let exp = if a == 0.0 {
            -7
        } else {
            a.log2().floor() as i32
        };
        let e = exp.max(-6); // e4m3's smallest normal exponent is -6
        let step = 2f32.powi(e - 3);
        let q = round_half_even(a / step); // value = q * step, q in [0, 16]
        let v = q * step;
        Self(sign | Self::encode_abs(v))
    }

    fn encode_abs(v: f32) -> u8 {
        if v == 0.0 {
            return 0;
        }
        let exp = v.log2().floor() as i32;
        if exp < -6 {
            // Subnormal: v = m * 2^-9, m in 1..=7.
            return (v / 2f32.powi(-9)).round() as u8;
        }
        let m = ((v / 2f32.powi(exp) - 1.0) * 8.0).round() as u8;
        (((exp + 7) as u8) << 3) | m
    }

    /// The exact f32 value (NaN for 0x7f / 0xff).
    pub fn to_f32(self) -> f32 {
        let sign = if self.0 & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((self.0 >> 3) & 0xf);
        let m = f32::from(self.0 & 0x7);
        if e == 0xf && (self.0 & 0x7) == 0x7 {
            return f32::NAN;
        }
        if e == 0 {
            sign * m * 2f32.powi(-9)
        } else {
            sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
        }
    }
}

fn round_half_even(x: f32) -> f32 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Types a [`Tensor`](crate::Tensor) can hold.
pub trait Element: Pod + sealed::Sealed + Send + Sync + 'static {
    /// A name for error messages.
    const NAME: &'static str;
}

macro_rules! element {
    ($($t:ty => $n:literal),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const NAME: &'static str = $n; }
    )*};
}
element!(Bf16 => "bf16", Fp8E4M3 => "fp8_e4m3", f32 => "f32", i32 => "i32", i64 => "i64", u8 => "u8");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 3.140625, 65280.0, 1e-20] {
            let b = Bf16::from_f32(v);
            assert_eq!(Bf16::from_f32(b.to_f32()), b, "{v}");
        }
        assert_eq!(Bf16::from_f32(1.0 + 6.0 / 512.0).0, 0x3f82); // tie rounds up to even
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }

    #[test]
    fn fp8_every_code_round_trips() {
        for code in 0u8..=255 {
            let v = Fp8E4M3(code).to_f32();
            if v.is_nan() {
                assert!(code & 0x7f == 0x7f);
                continue;
            }
            let back = Fp8E4M3::from_f32(v);
            if v == 0.0 {
                assert_eq!(back.to_f32(), 0.0);
            } else {
                assert_eq!(back, Fp8E4M3(code), "code {code:#x} value {v}");
            }
        }
    }

    #[test]
    fn fp8_rounds_to_nearest_even_and_saturates() {
        // Between 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code.
        assert_eq!(Fp8E4M3::from_f32(1.0625).0, 0x38);
        assert_eq!(Fp8E4M3::from_f32(1.07).0, 0x39);
        assert_eq!(Fp8E4M3::from_f32(-1.0e9).0, 0xfe);
        // Smallest subnormal 2^-9 and half of it (ties to even → 0).
        assert_eq!(Fp8E4M3::from_f32(2f32.powi(-9)).0, 0x01);
        assert_eq!(Fp8E4M3::from_f32(2f32.powi(-10)).0, 0x00);
        // 0.875 * 2^-6 is the largest subnormal; 2^-6 the smallest normal.
        assert_eq!(Fp8E4M3::from_f32(0.875 * 2f32.powi(-6)).0, 0x07);
        assert_eq!(Fp8E4M3::from_f32(2f32.powi(-6)).0, 0x08);
        // 464 is halfway between 448 and the (absent) 480: saturates.
        assert_eq!(Fp8E4M3::from_f32(460.0).0, 0x7e);
    }
}
