//! Kubernetes-style label selectors over string attributes (offers and requests of a
//! quantity pool).
//!
//! A [`Selector`] is a conjunction (AND) of [`Requirement`]s; the empty selector matches
//! everything. The six operators and their matching rules follow Kubernetes node affinity
//! (<https://kubernetes.io/docs/concepts/scheduling-eviction/assign-pod-node/>, "operators
//! In, NotIn, Exists, DoesNotExist, Gt, Lt") as implemented by `Requirement.Matches` in
//! `k8s.io/apimachinery/pkg/labels/selector.go`:
//!
//! | operator       | text form          | matches when                                            |
//! |----------------|--------------------|---------------------------------------------------------|
//! | `In`           | `k in (a,b)`, `k=a`, `k==a` | `k` is present and its value is one of the values |
//! | `NotIn`        | `k notin (a,b)`, `k!=a` | `k` is absent, or its value is none of the values   |
//! | `Exists`       | `k`                | `k` is present (any value)                              |
//! | `DoesNotExist` | `!k`               | `k` is absent                                           |
//! | `Gt`           | `k>40`             | `k` is present, its value parses as an `i64`, and is `> 40` |
//! | `Lt`           | `k<40`             | `k` is present, its value parses as an `i64`, and is `< 40` |
//!
//! As in Kubernetes, a missing key never satisfies `Gt`/`Lt`, and neither does a value that is
//! not a base-10 `i64` (`"40GiB"`, `"4.5"`, `""`): such an attribute simply does not match;
//! it is not an error. The *operand* of `Gt`/`Lt` must be an integer, checked at parse time.
//!
//! Text form (kubectl's, plus `>`/`<`): requirements separated by `,` (commas inside
//! `( … )` separate values), blanks allowed around tokens, e.g.
//! `gpu.model in (h100,a100),mem.gib>40,!spot`. Keys are 1–253 characters of
//! `[A-Za-z0-9._/-]` starting and ending with an alphanumeric; values are 1–63 characters of
//! `[A-Za-z0-9._-]` (empty values are refused, unlike Kubernetes, so every selector has a
//! text form). At most [`MAX_REQUIREMENTS`] requirements of at most [`MAX_VALUES`] values,
//! and at most [`MAX_TEXT`] bytes of text. Bad input is a [`SelectorError`] naming the byte
//! offset; parsing never panics (a property test feeds it random strings).
//!
//! [`Selector`]'s `Display` is canonical (`in`/`notin`, values sorted and deduplicated) and
//! parses back to an equal selector; serde uses that text form.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest accepted selector text, in bytes.
pub const MAX_TEXT: usize = 4096;
/// Most requirements in one selector.
pub const MAX_REQUIREMENTS: usize = 64;
/// Most values in one `in`/`notin` list.
pub const MAX_VALUES: usize = 64;
/// Longest key (Kubernetes: 253-byte prefix domain + `/` + name; we bound the whole).
pub const MAX_KEY: usize = 253;
/// Longest value (Kubernetes label values: 63).
pub const MAX_VALUE: usize = 63;

/// The attributes an offer or request carries: key → value.
pub type Attributes = BTreeMap<String, String>;

/// How a requirement relates its key to its values.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operator {
    /// Key present with one of the values.
    In(BTreeSet<String>),
    /// Key absent, or present with none of the values.
    NotIn(BTreeSet<String>),
    /// Key present.
    Exists,
    /// Key absent.
    DoesNotExist,
    /// Key present with an integer value greater than the operand.
    Gt(i64),
    /// Key present with an integer value less than the operand.
    Lt(i64),
}

/// One `key operator values` term of a selector.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Requirement {
    key: String,
    op: Operator,
}

/// A conjunction of requirements; empty = matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Selector {
    reqs: Vec<Requirement>,
}

/// Why a selector (or a requirement built in code) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// Text longer than [`MAX_TEXT`].
    #[error("selector is {0} bytes long (at most {MAX_TEXT})")]
    TooLong(usize),
    /// More than [`MAX_REQUIREMENTS`] requirements.
    #[error("selector has more than {MAX_REQUIREMENTS} requirements")]
    TooManyRequirements,
    /// More than [`MAX_VALUES`] values in one list.
    #[error("at byte {0}: more than {MAX_VALUES} values in one list")]
    TooManyValues(usize),
    /// A key that is empty, too long or has a bad character.
    #[error("at byte {pos}: invalid key {key:?}: {why}")]
    BadKey {
        /// Byte offset in the text (0 for requirements built in code).
        pos: usize,
        /// The offending key.
        key: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A value that is empty, too long or has a bad character.
    #[error("at byte {pos}: invalid value {value:?}: {why}")]
    BadValue {
        /// Byte offset in the text.
        pos: usize,
        /// The offending value.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The operand of `>`/`<` is not a base-10 i64.
    #[error("at byte {pos}: {value:?} is not an integer (Gt/Lt need an i64 operand)")]
    NotInteger {
        /// Byte offset in the text.
        pos: usize,
        /// The operand text.
        value: String,
    },
    /// Something else than what the grammar allows here.
    #[error("at byte {pos}: expected {expected}, found {found}")]
    Unexpected {
        /// Byte offset in the text.
        pos: usize,
        /// What the grammar allows at this point.
        expected: &'static str,
        /// What was there (`end of input` or the character).
        found: String,
    },
    /// `in`/`notin` with an empty list.
    #[error("at byte {0}: in/notin need at least one value")]
    EmptyList(usize),
}

fn key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')
}

fn value_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

fn check_key(pos: usize, key: &str) -> Result<(), SelectorError> {
    let bad = |why| {
        Err(SelectorError::BadKey {
            pos,
            key: key.to_string(),
            why,
        })
    };
    if key.is_empty() {
        return bad("empty");
    }
    if key.len() > MAX_KEY {
        return bad("longer than 253 bytes");
    }
    if !key.chars().all(key_char) {
        return bad("only A-Z a-z 0-9 . _ - / allowed");
    }
    let first = key.chars().next().unwrap_or('-');
    let last = key.chars().next_back().unwrap_or('-');
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return bad("must start and end with a letter or digit");
    }
    Ok(())
}

fn check_value(pos: usize, value: &str) -> Result<(), SelectorError> {
    let bad = |why| {
        Err(SelectorError::BadValue {
            pos,
            value: value.to_string(),
            why,
        })
    };
    if value.is_empty() {
        return bad("empty");
    }
    if value.len() > MAX_VALUE {
        return bad("longer than 63 bytes");
    }
    if !value.chars().all(value_char) {
        return bad("only A-Z a-z 0-9 . _ - allowed");
    }
    Ok(())
}

impl Requirement {
    /// Builds a requirement, validating the key and the values (a list of `In`/`NotIn` must
    /// be non-empty and at most [`MAX_VALUES`] long).
    pub fn new(key: impl Into<String>, op: Operator) -> Result<Requirement, SelectorError> {
        let key = key.into();
        check_key(0, &key)?;
        if let Operator::In(vs) | Operator::NotIn(vs) = &op {
            if vs.is_empty() {
                return Err(SelectorError::EmptyList(0));
            }
            if vs.len() > MAX_VALUES {
                return Err(SelectorError::TooManyValues(0));
            }
            for v in vs {
                check_value(0, v)?;
            }
        }
        Ok(Requirement { key, op })
    }

    /// The attribute key this requirement looks at.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The operator and its operands.
    pub fn operator(&self) -> &Operator {
        &self.op
    }

    /// Whether `attrs` satisfies this requirement (Kubernetes semantics, see module docs).
    pub fn matches(&self, attrs: &Attributes) -> bool {
        let v = attrs.get(&self.key);
        match &self.op {
            Operator::In(vs) => v.is_some_and(|v| vs.contains(v)),
            Operator::NotIn(vs) => v.is_none_or(|v| !vs.contains(v)),
            Operator::Exists => v.is_some(),
            Operator::DoesNotExist => v.is_none(),
            Operator::Gt(n) => v
                .and_then(|v| v.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            Operator::Lt(n) => v
                .and_then(|v| v.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |f: &mut fmt::Formatter<'_>, vs: &BTreeSet<String>| {
            let joined: Vec<&str> = vs.iter().map(String::as_str).collect();
            write!(f, "({})", joined.join(","))
        };
        match &self.op {
            Operator::In(vs) => {
                write!(f, "{} in ", self.key)?;
                list(f, vs)
            }
            Operator::NotIn(vs) => {
                write!(f, "{} notin ", self.key)?;
                list(f, vs)
            }
            Operator::Exists => write!(f, "{}", self.key),
            Operator::DoesNotExist => write!(f, "!{}", self.key),
            Operator::Gt(n) => write!(f, "{}>{n}", self.key),
            Operator::Lt(n) => write!(f, "{}<{n}", self.key),
        }
    }
}

impl Selector {
    /// The selector that matches everything.
    pub fn everything() -> Selector {
        Selector::default()
    }

    /// A selector from requirements (ANDed).
    pub fn new(reqs: Vec<Requirement>) -> Result<Selector, SelectorError> {
        if reqs.len() > MAX_REQUIREMENTS {
            return Err(SelectorError::TooManyRequirements);
        }
        Ok(Selector { reqs })
    }

    /// The requirements, in the order given.
    pub fn requirements(&self) -> &[Requirement] {
        &self.reqs
    }

    /// True for the empty selector.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Whether `attrs` satisfies every requirement.
    pub fn matches(&self, attrs: &Attributes) -> bool {
        self.reqs.iter().all(|r| r.matches(attrs))
    }

    /// Parses the compact text form (see module docs).
    pub fn parse(text: &str) -> Result<Selector, SelectorError> {
        if text.len() > MAX_TEXT {
            return Err(SelectorError::TooLong(text.len()));
        }
        let mut p = Parser { s: text, pos: 0 };
        let mut reqs = Vec::new();
        p.skip_ws();
        if p.at_end() {
            return Ok(Selector { reqs });
        }
        loop {
            if reqs.len() == MAX_REQUIREMENTS {
                return Err(SelectorError::TooManyRequirements);
            }
            reqs.push(p.requirement()?);
            p.skip_ws();
            match p.peek() {
                None => break,
                Some(',') => p.bump(),
                Some(_) => return Err(p.unexpected("',' or end of input")),
            }
            p.skip_ws();
        }
        Ok(Selector { reqs })
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.reqs.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

impl FromStr for Selector {
    type Err = SelectorError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Selector::parse(s)
    }
}

impl TryFrom<String> for Selector {
    type Error = SelectorError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Selector::parse(&s)
    }
}

impl From<Selector> for String {
    fn from(s: Selector) -> String {
        s.to_string()
    }
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.s[self.pos..].chars().next()
    }
    fn at_end(&self) -> bool {
        self.pos >= self.s.len()
    }
    fn bump(&mut self) {
        if let Some(c) = self.peek() {
            self.pos += c.len_utf8();
        }
    }
    fn skip_ws(&mut self) {
        while self.peek().is_some_and(|c| c == ' ' || c == '\t') {
            self.bump();
        }
    }
    fn unexpected(&self, expected: &'static str) -> SelectorError {
        SelectorError::Unexpected {
            pos: self.pos,
            expected,
            found: match self.peek() {
                None => "end of input".into(),
                Some(c) => format!("{c:?}"),
            },
        }
    }
    /// Takes a run of characters that may appear in a key or a value.
    fn word(&mut self, ok: fn(char) -> bool) -> (usize, &str) {
        let start = self.pos;
        while self.peek().is_some_and(ok) {
            self.bump();
        }
        (start, &self.s[start..self.pos])
    }
    fn key(&mut self) -> Result<String, SelectorError> {
        let (start, k) = self.word(key_char);
        if k.is_empty() {
            return Err(self.unexpected("a key"));
        }
        check_key(start, k)?;
        Ok(k.to_string())
    }
    fn value(&mut self) -> Result<String, SelectorError> {
        let (start, v) = self.word(value_char);
        if v.is_empty() {
            return Err(self.unexpected("a value"));
        }
        check_value(start, v)?;
        Ok(v.to_string())
    }
    fn integer(&mut self) -> Result<i64, SelectorError> {
        let start = self.pos;
        if self.peek() == Some('-') || self.peek() == Some('+') {
            self.bump();
        }
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '.')
        {
            self.bump();
        }
        let t = &self.s[start..self.pos];
        if t.is_empty() {
            return Err(self.unexpected("an integer"));
        }
        t.parse::<i64>().map_err(|_| SelectorError::NotInteger {
            pos: start,
            value: t.to_string(),
        })
    }
    fn list(&mut self) -> Result<BTreeSet<String>, SelectorError> {
        self.skip_ws();
        if self.peek() != Some('(') {
            return Err(self.unexpected("'('"));
        }
        let open = self.pos;
        self.bump();
        let mut vs = BTreeSet::new();
        self.skip_ws();
        if self.peek() == Some(')') {
            return Err(SelectorError::EmptyList(open));
        }
        let mut n = 0usize;
        loop {
            self.skip_ws();
            let at = self.pos;
            vs.insert(self.value()?);
            n += 1;
            if n > MAX_VALUES {
                return Err(SelectorError::TooManyValues(at));
            }
            self.skip_ws();
            match self.peek() {
                Some(',') => self.bump(),
                Some(')') => {
                    self.bump();
                    return Ok(vs);
                }
                _ => return Err(self.unexpected("',' or ')'")),
            }
        }
    }
    fn requirement(&mut self) -> Result<Requirement, SelectorError> {
        if self.peek() == Some('!') {
            self.bump();
            self.skip_ws();
            let key = self.key()?;
            return Ok(Requirement {
                key,
                op: Operator::DoesNotExist,
            });
        }
        let key = self.key()?;
        self.skip_ws();
        let op = match self.peek() {
            None | Some(',') => Operator::Exists,
            Some('=') => {
                self.bump();
                if self.peek() == Some('=') {
                    self.bump();
                }
                self.skip_ws();
                Operator::In(BTreeSet::from([self.value()?]))
            }
            Some('!') => {
                self.bump();
                if self.peek() != Some('=') {
                    return Err(self.unexpected("'=' after '!'"));
                }
                self.bump();
                self.skip_ws();
                Operator::NotIn(BTreeSet::from([self.value()?]))
            }
            Some('>') => {
                self.bump();
                self.skip_ws();
                Operator::Gt(self.integer()?)
            }
            Some('<') => {
                self.bump();
                self.skip_ws();
                Operator::Lt(self.integer()?)
            }
            Some(c) if c.is_ascii_alphabetic() => {
                let at = self.pos;
                let (_, w) = self.word(|c| c.is_ascii_alphabetic());
                match w {
                    "in" => Operator::In(self.list()?),
                    "notin" => Operator::NotIn(self.list()?),
                    _ => {
                        self.pos = at;
                        return Err(self.unexpected("an operator (in, notin, =, ==, !=, >, <)"));
                    }
                }
            }
            Some(_) => {
                return Err(self.unexpected("an operator (in, notin, =, ==, !=, >, <), ',' or end"))
            }
        };
        Ok(Requirement { key, op })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn attrs(kv: &[(&str, &str)]) -> Attributes {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn sel(s: &str) -> Selector {
        Selector::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn empty_selector_matches_everything() {
        assert!(sel("").matches(&attrs(&[])));
        assert!(sel("  ").matches(&attrs(&[("a", "b")])));
        assert!(Selector::everything().is_empty());
    }

    #[test]
    fn in_operator() {
        let s = sel("gpu.model in (h100, a100)");
        assert!(s.matches(&attrs(&[("gpu.model", "h100")])));
        assert!(s.matches(&attrs(&[("gpu.model", "a100")])));
        assert!(!s.matches(&attrs(&[("gpu.model", "t4")])));
        assert!(!s.matches(&attrs(&[])), "missing key never matches In");
        assert_eq!(sel("zone=a"), sel("zone in (a)"));
        assert_eq!(sel("zone==a"), sel("zone in (a)"));
    }

    #[test]
    fn notin_operator() {
        let s = sel("zone notin (a,b)");
        assert!(!s.matches(&attrs(&[("zone", "a")])));
        assert!(s.matches(&attrs(&[("zone", "c")])));
        assert!(
            s.matches(&attrs(&[])),
            "missing key matches NotIn (Kubernetes)"
        );
        assert_eq!(sel("zone != a"), sel("zone notin (a)"));
    }

    #[test]
    fn exists_and_does_not_exist() {
        let e = sel("spot");
        let d = sel("!spot");
        let with = attrs(&[("spot", "true")]);
        let without = attrs(&[("other", "x")]);
        assert!(e.matches(&with) && !e.matches(&without));
        assert!(!d.matches(&with) && d.matches(&without));
    }

    #[test]
    fn gt_and_lt() {
        let gt = sel("mem.gib>40");
        let lt = sel("mem.gib < 40");
        assert!(gt.matches(&attrs(&[("mem.gib", "80")])));
        assert!(!gt.matches(&attrs(&[("mem.gib", "40")])), "strict");
        assert!(!lt.matches(&attrs(&[("mem.gib", "40")])), "strict");
        assert!(lt.matches(&attrs(&[("mem.gib", "-3")])));
        for v in ["80GiB", "4.5", "", "ninety", "99999999999999999999"] {
            let a = attrs(&[("mem.gib", v)]);
            assert!(!gt.matches(&a) && !lt.matches(&a), "non-integer {v:?}");
        }
        assert!(
            !gt.matches(&attrs(&[])) && !lt.matches(&attrs(&[])),
            "missing key"
        );
        assert_eq!(sel("x>-5").requirements()[0].operator(), &Operator::Gt(-5));
    }

    #[test]
    fn conjunction_of_the_example() {
        let s = sel("gpu.model in (h100,a100),mem.gib>40,!spot");
        assert!(s.matches(&attrs(&[("gpu.model", "h100"), ("mem.gib", "80")])));
        assert!(!s.matches(&attrs(&[
            ("gpu.model", "h100"),
            ("mem.gib", "80"),
            ("spot", "1")
        ])));
        assert!(!s.matches(&attrs(&[("gpu.model", "h100"), ("mem.gib", "24")])));
        assert_eq!(s.to_string(), "gpu.model in (a100,h100),mem.gib>40,!spot");
        assert_eq!(sel(&s.to_string()), s);
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let cases: &[(&str, &str)] = &[
            ("a in ()", "at least one value"),
            ("a in (x", "expected ',' or ')'"),
            ("a in x", "expected '('"),
            ("a>", "expected an integer"),
            ("a>4x", "not an integer"),
            ("a<1.5", "not an integer"),
            ("a>99999999999999999999", "not an integer"),
            ("a,,b", "expected a key"),
            ("a,", "expected a key"),
            ("-a", "start and end"),
            ("a like (x)", "expected an operator"),
            ("a!b", "'=' after '!'"),
            ("a=", "expected a value"),
            ("a=b c", "expected ',' or end"),
            ("a=é", "expected a value"),
            ("é", "expected a key"),
            ("!", "expected a key"),
        ];
        for (text, want) in cases {
            let e = Selector::parse(text).expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e:?} lacks {want:?}");
        }
        let long = "a".repeat(MAX_TEXT + 1);
        assert!(matches!(
            Selector::parse(&long),
            Err(SelectorError::TooLong(_))
        ));
        let many = vec!["k"; MAX_REQUIREMENTS + 1].join(",");
        assert_eq!(
            Selector::parse(&many),
            Err(SelectorError::TooManyRequirements)
        );
        let key = "k".repeat(MAX_KEY + 1);
        assert!(matches!(
            Selector::parse(&key),
            Err(SelectorError::BadKey { .. })
        ));
        assert!(Requirement::new("ok", Operator::In(BTreeSet::new())).is_err());
        assert!(Requirement::new("", Operator::Exists).is_err());
    }

    #[test]
    fn serde_uses_the_text_form() {
        let s = sel("a in (x,y),!b");
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(j, "\"a in (x,y),!b\"");
        let back: Selector = serde_json::from_str(&j).unwrap();
        assert_eq!(back, s);
        assert!(serde_json::from_str::<Selector>("\"a in ()\"").is_err());
    }

    fn arb_key() -> impl Strategy<Value = String> {
        "[a-z][a-z0-9./_-]{0,6}[a-z0-9]"
    }
    fn arb_value() -> impl Strategy<Value = String> {
        "[A-Za-z0-9._-]{1,8}"
    }
    fn arb_req() -> impl Strategy<Value = Requirement> {
        let set = || prop::collection::btree_set(arb_value(), 1..4);
        let op = prop_oneof![
            set().prop_map(Operator::In),
            set().prop_map(Operator::NotIn),
            Just(Operator::Exists),
            Just(Operator::DoesNotExist),
            any::<i64>().prop_map(Operator::Gt),
            any::<i64>().prop_map(Operator::Lt),
        ];
        (arb_key(), op).prop_map(|(key, op)| Requirement { key, op })
    }

    proptest! {
        #[test]
        fn random_strings_never_panic(s in "\\PC{0,64}") {
            let _ = Selector::parse(&s);
        }

        #[test]
        fn grammar_soup_never_panics(s in "[a-z0-9 ,()!=<>._/-]{0,48}") {
            if let Ok(sel) = Selector::parse(&s) {
                // whatever parses prints canonically and parses back to the same thing
                prop_assert_eq!(Selector::parse(&sel.to_string()).unwrap(), sel);
            }
        }

        #[test]
        fn display_round_trips(reqs in prop::collection::vec(arb_req(), 0..6)) {
            let s = Selector::new(reqs).unwrap();
            prop_assert_eq!(Selector::parse(&s.to_string()).unwrap(), s);
        }
    }
}
