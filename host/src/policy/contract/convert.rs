//! Direct conversions between the host's model and a contract version's
//! bindings: `Down` for what the host gives a guest, `Up` for what a guest
//! answers. Each version's module declares its types' shapes with the
//! macros below; a field or case one side lacks fails to compile, so a
//! mismatch is found when the bindings change, not when a guest calls.

/// Host value → the guest's binding (by reference: the host keeps its own).
pub(crate) trait Down<T> {
    fn down(&self) -> T;
}

/// The guest's binding → host value.
pub(crate) trait Up<T> {
    fn up(self) -> T;
}

macro_rules! same {
    ($($t:ty),*) => {$(
        impl Down<$t> for $t {
            fn down(&self) -> $t {
                self.clone()
            }
        }
        impl Up<$t> for $t {
            fn up(self) -> $t {
                self
            }
        }
    )*};
}
same!(String, bool, u8, u32);

impl<A: Down<B>, B> Down<Vec<B>> for Vec<A> {
    fn down(&self) -> Vec<B> {
        self.iter().map(Down::down).collect()
    }
}
impl<A: Down<B>, B> Down<Vec<B>> for [A] {
    fn down(&self) -> Vec<B> {
        self.iter().map(Down::down).collect()
    }
}
impl<A: Down<B>, B> Down<Option<B>> for Option<A> {
    fn down(&self) -> Option<B> {
        self.as_ref().map(Down::down)
    }
}
impl<A: Up<B>, B> Up<Vec<B>> for Vec<A> {
    fn up(self) -> Vec<B> {
        self.into_iter().map(Up::up).collect()
    }
}
impl<A: Up<B>, B> Up<Option<B>> for Option<A> {
    fn up(self) -> Option<B> {
        self.map(Up::up)
    }
}
impl<A: Up<B>, B, E: Up<F>, F> Up<Result<B, F>> for Result<A, E> {
    fn up(self) -> Result<B, F> {
        self.map(Up::up).map_err(Up::up)
    }
}

/// A record, field by field, both ways; `default` fields are the model's
/// and not in the binding (an older contract): left out going down,
/// defaulted coming up.
macro_rules! record {
    ($t:ident { $($f:ident),* $(,)? } $(default { $($d:ident),* })?) => {
        impl $crate::policy::contract::convert::Down<a::$t> for m::$t {
            fn down(&self) -> a::$t {
                a::$t { $($f: $crate::policy::contract::convert::Down::down(&self.$f)),* }
            }
        }
        impl $crate::policy::contract::convert::Up<m::$t> for a::$t {
            fn up(self) -> m::$t {
                m::$t {
                    $($f: $crate::policy::contract::convert::Up::up(self.$f),)*
                    $($($d: Default::default(),)*)?
                }
            }
        }
    };
}

/// A record only a guest answers, coming up.
macro_rules! record_up {
    ($t:ident { $($f:ident),* $(,)? } $(default { $($d:ident),* })?) => {
        impl $crate::policy::contract::convert::Up<m::$t> for a::$t {
            fn up(self) -> m::$t {
                m::$t {
                    $($f: $crate::policy::contract::convert::Up::up(self.$f),)*
                    $($($d: Default::default(),)*)?
                }
            }
        }
    };
}

/// An enum or variant, case by case, both ways: unit cases, then cases
/// with a payload.
macro_rules! cases {
    ($t:ident [$($u:ident),* $(,)?] $(($($p:ident),* $(,)?))?) => {
        impl $crate::policy::contract::convert::Down<a::$t> for m::$t {
            #[allow(unused_imports)]
            fn down(&self) -> a::$t {
                use $crate::policy::contract::convert::Down as _;
                match self {
                    $(m::$t::$u => a::$t::$u,)*
                    $($(m::$t::$p(x) => a::$t::$p(x.down()),)*)?
                }
            }
        }
        impl $crate::policy::contract::convert::Up<m::$t> for a::$t {
            #[allow(unused_imports)]
            fn up(self) -> m::$t {
                use $crate::policy::contract::convert::Up as _;
                match self {
                    $(a::$t::$u => m::$t::$u,)*
                    $($(a::$t::$p(x) => m::$t::$p(x.up()),)*)?
                }
            }
        }
    };
}

/// Cases only one way: a guest answers them (`up`), or the host asks them
/// (`down`), and the other side has more cases than this contract.
macro_rules! cases_up {
    ($t:ident [$($u:ident),* $(,)?] $(($($p:ident),* $(,)?))?) => {
        impl $crate::policy::contract::convert::Up<m::$t> for a::$t {
            #[allow(unused_imports)]
            fn up(self) -> m::$t {
                use $crate::policy::contract::convert::Up as _;
                match self {
                    $(a::$t::$u => m::$t::$u,)*
                    $($(a::$t::$p(x) => m::$t::$p(x.up()),)*)?
                }
            }
        }
    };
}

pub(crate) use {cases, cases_up, record, record_up};
