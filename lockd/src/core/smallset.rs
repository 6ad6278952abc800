//! [`SmallSet`]: an ordered set that is a sorted vector while small, a `BTreeSet` beyond.
//!
//! A session holds or waits for one or two resources almost always; a `BTreeSet` of one
//! element still allocates a whole leaf node (11 slots: 280 bytes for `String`s, 100 for
//! `u64`s), and a session has four of these sets. A sorted `Vec` allocates room for what it
//! holds (and nothing while empty); lookups are binary searches, inserts and removals shift at
//! most [`SMALL_MAX`] elements. Past that the set moves to a `BTreeSet`, so a session holding
//! thousands of leases keeps O(log n) operations; it moves back once it has shrunk to half.

use std::borrow::Borrow;
use std::collections::{btree_set, BTreeSet};

/// Most elements kept in the sorted vector.
pub(super) const SMALL_MAX: usize = 16;

/// An ordered set of `T`: a sorted vector up to [`SMALL_MAX`] elements, a `BTreeSet` above.
#[derive(Debug, Clone)]
pub(super) enum SmallSet<T> {
    /// Sorted, no duplicates, at most [`SMALL_MAX`] elements.
    Small(Vec<T>),
    /// More than [`SMALL_MAX`] elements (until it shrinks to half that). Boxed, so that the
    /// set takes no more room than a `Vec` (a session has four).
    #[allow(clippy::box_collection)] // deliberate: 8 bytes here, not 24, for a rare case
    Large(Box<BTreeSet<T>>),
}

impl<T> Default for SmallSet<T> {
    fn default() -> Self {
        SmallSet::Small(Vec::new())
    }
}

impl<T: Ord> SmallSet<T> {
    /// An empty set (allocates nothing).
    pub fn new() -> Self {
        SmallSet::default()
    }

    /// Number of elements.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn len(&self) -> usize {
        match self {
            SmallSet::Small(v) => v.len(),
            SmallSet::Large(s) => s.len(),
        }
    }

    /// No element.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `x` is in the set.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn contains<Q>(&self, x: &Q) -> bool
    where
        T: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        match self {
            SmallSet::Small(v) => v.binary_search_by(|e| e.borrow().cmp(x)).is_ok(),
            SmallSet::Large(s) => s.contains(x),
        }
    }

    /// Add `x`; false if it was there already.
    pub fn insert(&mut self, x: T) -> bool {
        match self {
            SmallSet::Small(v) => match v.binary_search(&x) {
                Ok(_) => false,
                Err(i) if v.len() < SMALL_MAX => {
                    if v.capacity() == 0 {
                        // Most sets hold one element: room for exactly that.
                        v.reserve_exact(1);
                    }
                    v.insert(i, x);
                    true
                }
                Err(_) => {
                    let mut s: BTreeSet<T> = std::mem::take(v).into_iter().collect();
                    s.insert(x);
                    *self = SmallSet::Large(Box::new(s));
                    true
                }
            },
            SmallSet::Large(s) => s.insert(x),
        }
    }

    /// Remove `x`; false if it was not there.
    pub fn remove<Q>(&mut self, x: &Q) -> bool
    where
        T: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        match self {
            SmallSet::Small(v) => match v.binary_search_by(|e| e.borrow().cmp(x)) {
                Ok(i) => {
                    v.remove(i);
                    if v.is_empty() {
                        // An idle session holds no memory for its sets.
                        *v = Vec::new();
                    }
                    true
                }
                Err(_) => false,
            },
            SmallSet::Large(s) => {
                let removed = s.remove(x);
                if s.len() <= SMALL_MAX / 2 {
                    let v: Vec<T> = std::mem::take(&mut **s).into_iter().collect();
                    *self = SmallSet::Small(v);
                }
                removed
            }
        }
    }

    /// The elements in ascending order.
    pub fn iter(&self) -> Iter<'_, T> {
        match self {
            SmallSet::Small(v) => Iter::Small(v.iter()),
            SmallSet::Large(s) => Iter::Large(s.iter()),
        }
    }
}

/// The iterator of a [`SmallSet`] (ascending order; no boxing).
#[derive(Debug, Clone)]
pub(super) enum Iter<'a, T> {
    /// Over the sorted vector.
    Small(std::slice::Iter<'a, T>),
    /// Over the `BTreeSet`.
    Large(btree_set::Iter<'a, T>),
}

impl<'a, T> Iterator for Iter<'a, T> {
    type Item = &'a T;

    fn next(&mut self) -> Option<&'a T> {
        match self {
            Iter::Small(i) => i.next(),
            Iter::Large(i) => i.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            Iter::Small(i) => i.size_hint(),
            Iter::Large(i) => i.size_hint(),
        }
    }
}

impl<T> DoubleEndedIterator for Iter<'_, T> {
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            Iter::Small(i) => i.next_back(),
            Iter::Large(i) => i.next_back(),
        }
    }
}

impl<T> ExactSizeIterator for Iter<'_, T> {}

impl<'a, T: Ord> IntoIterator for &'a SmallSet<T> {
    type Item = &'a T;
    type IntoIter = Iter<'a, T>;

    fn into_iter(self) -> Iter<'a, T> {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8),
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        // A small key space, so that removals hit and sets cross SMALL_MAX both ways.
        prop_oneof![
            3 => (0u8..48).prop_map(Op::Insert),
            2 => (0u8..48).prop_map(Op::Remove),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// Every operation answers as `BTreeSet`'s does, and the contents, order, length and
        /// representation (vector while at most SMALL_MAX) agree after each one.
        #[test]
        fn behaves_as_a_btreeset(ops in proptest::collection::vec(op(), 0..400)) {
            let mut s: SmallSet<u64> = SmallSet::new();
            let mut model: BTreeSet<u64> = BTreeSet::new();
            for o in ops {
                match o {
                    Op::Insert(x) => prop_assert_eq!(s.insert(u64::from(x)), model.insert(u64::from(x))),
                    Op::Remove(x) => prop_assert_eq!(s.remove(&u64::from(x)), model.remove(&u64::from(x))),
                }
                prop_assert_eq!(s.len(), model.len());
                prop_assert_eq!(s.is_empty(), model.is_empty());
                prop_assert!(s.iter().eq(model.iter()));
                prop_assert!(s.iter().rev().eq(model.iter().rev()));
                prop_assert_eq!(s.iter().len(), model.len());
                for k in 0..48u64 {
                    prop_assert_eq!(s.contains(&k), model.contains(&k));
                }
                if model.len() <= SMALL_MAX / 2 {
                    prop_assert!(matches!(s, SmallSet::Small(_)), "small sets are vectors");
                }
                if model.len() > SMALL_MAX {
                    prop_assert!(matches!(s, SmallSet::Large(_)), "large sets are trees");
                }
            }
        }
    }

    #[test]
    fn a_set_takes_the_room_of_a_vec() {
        assert_eq!(
            std::mem::size_of::<SmallSet<String>>(),
            std::mem::size_of::<Vec<String>>()
        );
    }

    #[test]
    fn strings_are_found_by_str_and_an_empty_set_holds_no_memory() {
        let mut s: SmallSet<String> = SmallSet::new();
        assert!(s.insert("b".into()));
        let SmallSet::Small(v) = &s else {
            panic!("{s:?}")
        };
        assert_eq!(v.capacity(), 1, "one element: room for one");
        assert!(s.insert("a".into()));
        assert!(!s.insert("a".into()));
        assert!(s.contains("a") && !s.contains("c"));
        assert_eq!(s.iter().cloned().collect::<Vec<_>>(), ["a", "b"]);
        assert!(s.remove("a") && s.remove("b") && !s.remove("b"));
        let SmallSet::Small(v) = &s else {
            panic!("{s:?}")
        };
        assert_eq!(v.capacity(), 0, "emptied: its buffer is freed");
    }
}
