//! The addresses of one network attachment, the one-address case kept inline: nearly every
//! attachment lists one address, and the controller keeps every live pod's (100,000 heap
//! copies of one address are 100,000 allocations of 32 bytes).

use std::fmt;
use std::net::IpAddr;
use std::ops::Deref;

/// The addresses of one attachment, in their order; reads as a slice (made only from a list,
/// so one address is always kept inline and equality is the slices').
#[derive(Clone, PartialEq, Eq)]
pub struct AttachmentIps(Repr);

#[derive(Clone, PartialEq, Eq)]
enum Repr {
    /// Exactly one.
    One(IpAddr),
    /// None, or two or more.
    Many(Box<[IpAddr]>),
}

impl AttachmentIps {
    /// The addresses as a slice.
    pub fn as_slice(&self) -> &[IpAddr] {
        match &self.0 {
            Repr::One(ip) => std::slice::from_ref(ip),
            Repr::Many(ips) => ips,
        }
    }

    /// Whether they are kept inline (one address).
    pub fn is_inline(&self) -> bool {
        matches!(self.0, Repr::One(_))
    }
}

impl Default for AttachmentIps {
    fn default() -> AttachmentIps {
        AttachmentIps(Repr::Many(Box::default()))
    }
}

impl Deref for AttachmentIps {
    type Target = [IpAddr];
    fn deref(&self) -> &[IpAddr] {
        self.as_slice()
    }
}

impl From<Vec<IpAddr>> for AttachmentIps {
    fn from(ips: Vec<IpAddr>) -> AttachmentIps {
        AttachmentIps(match ips.as_slice() {
            [one] => Repr::One(*one),
            _ => Repr::Many(ips.into_boxed_slice()),
        })
    }
}

impl FromIterator<IpAddr> for AttachmentIps {
    fn from_iter<I: IntoIterator<Item = IpAddr>>(iter: I) -> AttachmentIps {
        iter.into_iter().collect::<Vec<_>>().into()
    }
}

impl<const N: usize> PartialEq<[IpAddr; N]> for AttachmentIps {
    fn eq(&self, other: &[IpAddr; N]) -> bool {
        self.as_slice() == other
    }
}

impl fmt::Debug for AttachmentIps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_slice(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ips(n: u8) -> Vec<IpAddr> {
        (0..n).map(|i| IpAddr::from([192, 0, 2, i])).collect()
    }

    #[test]
    fn reads_back_in_order_with_one_address_inline() {
        for n in 0..4 {
            let got = AttachmentIps::from(ips(n));
            assert_eq!(got.as_slice(), ips(n).as_slice());
            assert_eq!(got.is_inline(), n == 1);
        }
        let collected: AttachmentIps = ips(2).into_iter().collect();
        assert_eq!(collected, AttachmentIps::from(ips(2)));
        assert_eq!(AttachmentIps::default().len(), 0);
        assert_eq!(std::mem::size_of::<AttachmentIps>(), 24);
    }
}
