//! One description of the stored rows of a cache side (keys or values), generic in what
//! stands for a stored part, so that every reader instantiates the same row formats:
//!
//! - `B`: a part of bytes (packed codes, QJL signs, log codes and their exponent bytes);
//! - `S`: stored scalars, one or a few per token (norms, scales, zero points);
//! - `F`: float rows (full-precision keys or values);
//! - `T`: a table the description holds by value (a basis, a mean), not a stored part.
//!
//! The fused decode-attention kernel reads `Rows<&[u8], ScalarView, &[f32]>`
//! ([`crate::kernels::attention::CodedRows`]); the layer store declares its rows over part
//! indices ([`crate::decode_step::PartRows`]); the paged kernel over places in a page
//! ([`crate::kernels::paged::PagedRows`]); the binding over arrays, part names or page offsets.
//! A part's kind (bytes, scalars, floats) is where it sits in these types, and one [`Resolve`]
//! per reader turns a description over one stand-in into one over another ([`Rows::map`]),
//! failing (never falling back) on a part that is missing or of the wrong type.

use std::convert::Infallible;
use std::fmt;

use crate::scalars::{LogView, ScalarView};

/// The QJL sketch of the rotated residual that follows an MSE stage (`kqv` values, `qkqv`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Qjl<B, S> {
    /// heads x tokens x ceil(d'/8) packed sign bits (m = d').
    pub signs: B,
    /// heads x tokens stored `||r||`.
    pub norms: S,
    /// Seed of the sketch matrix S.
    pub seed: u64,
}

/// One run of basis columns `start .. stop` coded at `bits` bits per channel along tokens
/// (the per-channel KIVI layout of [`Rows::UniformChannels`] with `stop - start` channels).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Run<B, S> {
    /// heads x (stop - start) x packed_len(tokens, bits) bytes.
    pub codes: B,
    /// heads x (stop - start) x ceil(tokens / group) scales.
    pub scales: S,
    /// heads x (stop - start) x ceil(tokens / group) zero points.
    pub zeros: S,
    /// Bits per code (1..8).
    pub bits: u32,
    /// First basis column of the run.
    pub start: usize,
    /// One past the last basis column.
    pub stop: usize,
}

/// One run of basis columns `start .. stop` of [`Rows::TokenRuns`]: each token's codes of the
/// run packed little-endian (code i at bits `i * bits ..`), one row of bytes per token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenRun<B> {
    /// heads x tokens x packed_len(stop - start, bits) bytes.
    pub codes: B,
    /// Bits per code (1..8).
    pub bits: u32,
    /// First basis column of the run.
    pub start: usize,
    /// One past the last basis column.
    pub stop: usize,
}

/// Stored rows of one side of the cache (keys or values), `heads x tokens` vectors of
/// head_dim. The sizes below are those of compact arrays; with room per head
/// ([`crate::kernels::attention::AttentionShape::stride`]) every `tokens` along a token axis
/// reads `stride` (the first `tokens` of each head's rows held).
#[derive(Debug, Clone, PartialEq)]
pub enum Rows<B, S, F, T = F> {
    /// Norm-and-direction codes (docs/kernels.md section 5): `kv` (no rotation) and the MSE
    /// stage of `kqv` / `qkqv`, optionally followed by a QJL sketch of the rotated residual.
    Mse {
        /// heads x tokens x packed_len(code_dim, bits) bytes.
        codes: B,
        /// heads x tokens stored norms.
        norms: S,
        /// Bits of the MSE stage.
        bits: u32,
        /// Rotation seed; None for no rotation (code_dim = head_dim).
        seed: Option<u64>,
        /// QJL residual sketch.
        qjl: Option<Qjl<B, S>>,
    },
    /// Asymmetric uniform groups along each token's coordinates (docs/kernels.md section 9):
    /// KIVI values (no rotation) and `block` (rotation, groups of rotated coordinates).
    UniformTokens {
        /// heads x tokens x packed_len(n, bits) bytes, n = code_dim.
        codes: B,
        /// heads x tokens x ceil(n / group) scales.
        scales: S,
        /// heads x tokens x ceil(n / group) zero points.
        zeros: S,
        /// Bits per code.
        bits: u32,
        /// Coordinates per group.
        group: usize,
        /// Rotation seed, or None.
        seed: Option<u64>,
    },
    /// KIVI keys: per-channel groups of tokens; row `c` of head `h` holds channel `c` of every
    /// token.
    UniformChannels {
        /// heads x head_dim x packed_len(tokens, bits) bytes.
        codes: B,
        /// heads x head_dim x ceil(tokens / group) scales.
        scales: S,
        /// heads x head_dim x ceil(tokens / group) zero points.
        zeros: S,
        /// Bits per code.
        bits: u32,
        /// Tokens per group.
        group: usize,
    },
    /// Full-precision rows, heads x tokens x head_dim.
    Dense(F),
    /// Coordinates `y = x U` in an orthonormal basis `U` (the `matched` scheme), coded per
    /// channel along tokens (KIVI groups) in runs of columns of equal width; columns in no run
    /// store nothing and decode to 0. Decodes to `x_hat = y_hat U^T`.
    ChannelRuns {
        /// The coded runs, columns in increasing order, disjoint.
        runs: Vec<Run<B, S>>,
        /// Tokens per scale group (every run).
        group: usize,
        /// basis_heads x head_dim x head_dim, row-major (`U[i][c]`: input coordinate i, basis
        /// column c); head h uses basis `h % basis_heads`.
        basis: T,
        /// Number of bases (1, or a divisor of the flattened heads).
        basis_heads: usize,
    },
    /// Coordinates in a basis `B` (not necessarily orthonormal: `U diag(sigma)` with per-column
    /// scales folded in), each token's coded symmetrically in runs of columns with one scale
    /// per token (the fixed-size `matched` keys): `z_hat_i = level(bits, code_i) * s_t`,
    /// `level(b, c) = (2c - L) / L`, `L = 2^b - 1`, 0 in columns of no run; decodes to
    /// `x_hat = z_hat B^T`. A key layout.
    TokenRuns {
        /// The coded runs, columns in increasing order, disjoint.
        runs: Vec<TokenRun<B>>,
        /// heads x tokens stored scales, one per token.
        scales: S,
        /// basis_heads x head_dim x head_dim, row-major (`B[i][c]`: input coordinate i, basis
        /// column c); head h uses basis `h % basis_heads`.
        basis: T,
        /// Number of bases (1, or a divisor of the flattened heads).
        basis_heads: usize,
    },
    /// Other rows plus a per-head mean `mu`: `x_hat = inner_hat + mu`. As values the mean is
    /// added once to the output (the probabilities sum to one); as keys `q . mu` is the same for
    /// every token of a query, so it is left out of the logits (the softmax ignores it) and
    /// added to the log-sum-exp only, which another softmax part is merged with.
    Centred {
        /// The rows around the mean (any layout but another mean).
        rows: Box<Rows<B, S, F, T>>,
        /// mean_heads x head_dim; head h uses mean `h % mean_heads`.
        mean: T,
        /// Number of means (1, or a divisor of the flattened heads).
        mean_heads: usize,
    },
}

/// HeadQ side code of the keys (docs/kernels.md section 7), added in score space.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Side<B, S, T> {
    /// heads x tokens x packed_len(rank, bits) bytes.
    pub codes: B,
    /// heads x tokens stored scales.
    pub scales: S,
    /// basis_heads x head_dim x rank, row-major; head h uses basis `h % basis_heads`.
    pub basis: T,
    /// Number of bases (1, or the KV heads of the leading shape's last axis).
    pub basis_heads: usize,
    /// Rank r.
    pub rank: usize,
    /// Side bits q.
    pub bits: u32,
    /// +1, or -1 for the wrong-sign control.
    pub sign: f32,
}

/// Stored scalars described by their parts: one plane of float16 or float32 values (`P`), or
/// 8-bit log codes with one exponent byte per group (docs/kernels.md section 13), both parts
/// of bytes (`B`). What the store and the binding declare where the kernel reads a
/// [`ScalarView`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScalarParts<B, P> {
    /// A plane of float16 or float32 scalars.
    Plain(P),
    /// Log codes and their exponent bytes.
    Log {
        /// One code byte per scalar.
        codes: B,
        /// One exponent byte per group of `group` scalars of a row.
        exps: B,
        /// Scalars per exponent.
        group: usize,
    },
}

/// Where a part sits in a side's description, for errors: `keys.codes`, `values.qjl.signs`,
/// `keys.rows.runs[2].scales` (`rows` for the rows around a mean).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field<'a> {
    /// The side (`keys`, `values`, `side`).
    pub side: &'a str,
    /// Inside the rows of [`Rows::Centred`].
    pub centred: bool,
    /// The run of [`Rows::ChannelRuns`] or [`Rows::TokenRuns`], if any.
    pub run: Option<usize>,
    /// The field (`codes`, `norms`, `qjl.signs`, ...).
    pub name: &'static str,
}

impl fmt::Display for Field<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.side)?;
        if self.centred {
            f.write_str(".rows")?;
        }
        if let Some(i) = self.run {
            write!(f, ".runs[{i}]")?;
        }
        write!(f, ".{}", self.name)
    }
}

/// What one reader makes of each stand-in of a description: a part of bytes, stored scalars,
/// float rows, a table. [`Rows::map`] and [`Side::map`] call it once per field (`at` names the
/// field) and build the same description over the outputs.
pub trait Resolve<'a, B: 'a, S: 'a, F: 'a, T: 'a> {
    /// What stands for a part of bytes afterwards.
    type Bytes;
    /// What stands for stored scalars afterwards.
    type Scalars;
    /// What stands for float rows afterwards.
    type Floats;
    /// What stands for a table afterwards.
    type Table;
    /// Why a field cannot be resolved (a missing part, a part of the wrong type).
    type Error;
    /// A part of bytes.
    fn bytes(&mut self, part: &'a B, at: Field<'_>) -> Result<Self::Bytes, Self::Error>;
    /// Stored scalars.
    fn scalars(&mut self, part: &'a S, at: Field<'_>) -> Result<Self::Scalars, Self::Error>;
    /// Float rows.
    fn floats(&mut self, part: &'a F, at: Field<'_>) -> Result<Self::Floats, Self::Error>;
    /// A table (basis, mean).
    fn table(&mut self, table: &'a T, at: Field<'_>) -> Result<Self::Table, Self::Error>;
}

/// The description `Rows<B, S, F, T>` becomes under the resolver `R`.
pub type Resolved<'a, R, B, S, F, T> = Rows<
    <R as Resolve<'a, B, S, F, T>>::Bytes,
    <R as Resolve<'a, B, S, F, T>>::Scalars,
    <R as Resolve<'a, B, S, F, T>>::Floats,
    <R as Resolve<'a, B, S, F, T>>::Table,
>;

/// The side code `Side<B, S, T>` becomes under the resolver `R`.
pub type ResolvedSide<'a, R, B, S, F, T> = Side<
    <R as Resolve<'a, B, S, F, T>>::Bytes,
    <R as Resolve<'a, B, S, F, T>>::Scalars,
    <R as Resolve<'a, B, S, F, T>>::Table,
>;

impl<B, S, F, T> Rows<B, S, F, T> {
    /// The same rows with every part resolved by `r` (`side` names the fields in errors).
    /// Errors: the resolver's first error, in field order.
    pub fn map<'a, R: Resolve<'a, B, S, F, T>>(
        &'a self,
        side: &str,
        r: &mut R,
    ) -> Result<Resolved<'a, R, B, S, F, T>, R::Error> {
        self.map_in(side, false, r)
    }

    fn map_in<'a, R: Resolve<'a, B, S, F, T>>(
        &'a self,
        side: &str,
        centred: bool,
        r: &mut R,
    ) -> Result<Resolved<'a, R, B, S, F, T>, R::Error> {
        let at = |name| Field {
            side,
            centred,
            run: None,
            name,
        };
        Ok(match self {
            Rows::Mse {
                codes,
                norms,
                bits,
                seed,
                qjl,
            } => Rows::Mse {
                codes: r.bytes(codes, at("codes"))?,
                norms: r.scalars(norms, at("norms"))?,
                bits: *bits,
                seed: *seed,
                qjl: match qjl {
                    None => None,
                    Some(q) => Some(Qjl {
                        signs: r.bytes(&q.signs, at("qjl.signs"))?,
                        norms: r.scalars(&q.norms, at("qjl.norms"))?,
                        seed: q.seed,
                    }),
                },
            },
            Rows::UniformTokens {
                codes,
                scales,
                zeros,
                bits,
                group,
                seed,
            } => Rows::UniformTokens {
                codes: r.bytes(codes, at("codes"))?,
                scales: r.scalars(scales, at("scales"))?,
                zeros: r.scalars(zeros, at("zeros"))?,
                bits: *bits,
                group: *group,
                seed: *seed,
            },
            Rows::UniformChannels {
                codes,
                scales,
                zeros,
                bits,
                group,
            } => Rows::UniformChannels {
                codes: r.bytes(codes, at("codes"))?,
                scales: r.scalars(scales, at("scales"))?,
                zeros: r.scalars(zeros, at("zeros"))?,
                bits: *bits,
                group: *group,
            },
            Rows::Dense(x) => Rows::Dense(r.floats(x, at("values"))?),
            Rows::ChannelRuns {
                runs,
                group,
                basis,
                basis_heads,
            } => {
                let mut out = Vec::with_capacity(runs.len());
                for (i, run) in runs.iter().enumerate() {
                    let at = |name| Field {
                        run: Some(i),
                        ..at(name)
                    };
                    out.push(Run {
                        codes: r.bytes(&run.codes, at("codes"))?,
                        scales: r.scalars(&run.scales, at("scales"))?,
                        zeros: r.scalars(&run.zeros, at("zeros"))?,
                        bits: run.bits,
                        start: run.start,
                        stop: run.stop,
                    });
                }
                Rows::ChannelRuns {
                    runs: out,
                    group: *group,
                    basis: r.table(basis, at("basis"))?,
                    basis_heads: *basis_heads,
                }
            }
            Rows::TokenRuns {
                runs,
                scales,
                basis,
                basis_heads,
            } => {
                let mut out = Vec::with_capacity(runs.len());
                for (i, run) in runs.iter().enumerate() {
                    let at = Field {
                        run: Some(i),
                        ..at("codes")
                    };
                    out.push(TokenRun {
                        codes: r.bytes(&run.codes, at)?,
                        bits: run.bits,
                        start: run.start,
                        stop: run.stop,
                    });
                }
                Rows::TokenRuns {
                    runs: out,
                    scales: r.scalars(scales, at("scales"))?,
                    basis: r.table(basis, at("basis"))?,
                    basis_heads: *basis_heads,
                }
            }
            Rows::Centred {
                rows,
                mean,
                mean_heads,
            } => Rows::Centred {
                rows: Box::new(rows.map_in(side, true, r)?),
                mean: r.table(mean, at("mean"))?,
                mean_heads: *mean_heads,
            },
        })
    }

    /// The row class's name (`MSERows`, `UniformRows`, ...), for errors.
    pub fn class(&self) -> &'static str {
        match self {
            Rows::Mse { .. } => "MSERows",
            Rows::UniformTokens { .. } => "UniformRows",
            Rows::UniformChannels { .. } => "per-channel UniformRows",
            Rows::Dense(_) => "DenseRows",
            Rows::ChannelRuns { .. } => "ChannelRunRows",
            Rows::TokenRuns { .. } => "TokenRunRows",
            Rows::Centred { .. } => "CentredRows",
        }
    }

    /// What a key-only layout is (per-channel uniform groups, token runs), alone or around a
    /// mean, for errors; None for rows that can also be values.
    pub fn key_only(&self) -> Option<&'static str> {
        match self {
            Rows::UniformChannels { .. } => Some("per-channel uniform groups"),
            Rows::TokenRuns { .. } => Some("per-token runs in a basis (TokenRunRows)"),
            Rows::Centred { rows, .. } => rows.key_only(),
            _ => None,
        }
    }
}

impl<B, S, T> Side<B, S, T> {
    /// The same side code with every part resolved by `r` (fields named `side.codes`, ...).
    pub fn map<'a, F: 'a, R: Resolve<'a, B, S, F, T>>(
        &'a self,
        r: &mut R,
    ) -> Result<ResolvedSide<'a, R, B, S, F, T>, R::Error> {
        let at = |name| Field {
            side: "side",
            centred: false,
            run: None,
            name,
        };
        Ok(Side {
            codes: r.bytes(&self.codes, at("codes"))?,
            scales: r.scalars(&self.scales, at("scales"))?,
            basis: r.table(&self.basis, at("basis"))?,
            basis_heads: self.basis_heads,
            rank: self.rank,
            bits: self.bits,
            sign: self.sign,
        })
    }
}

/// Stored scalars held in some form (borrowed, decoded, described by parts) that the kernel
/// reads as a [`ScalarView`] without a copy.
pub trait AsScalars {
    /// The borrowed view.
    fn scalars(&self) -> ScalarView<'_>;
}

impl AsScalars for ScalarView<'_> {
    fn scalars(&self) -> ScalarView<'_> {
        *self
    }
}

impl<B: AsRef<[u8]>, P: AsScalars> AsScalars for ScalarParts<B, P> {
    /// Log codes become a [`ScalarView::Log`] whose row length the kernel sets.
    fn scalars(&self) -> ScalarView<'_> {
        match self {
            ScalarParts::Plain(p) => p.scalars(),
            ScalarParts::Log { codes, exps, group } => ScalarView::Log(LogView {
                codes: codes.as_ref(),
                exps: exps.as_ref(),
                group: *group,
                row: 0,
            }),
        }
    }
}

/// The resolver of [`Rows::view`]: borrows every part as the kernel reads it.
struct Borrow;

impl<'a, B, S, F, T> Resolve<'a, B, S, F, T> for Borrow
where
    B: AsRef<[u8]> + 'a,
    S: AsScalars + 'a,
    F: AsRef<[f32]> + 'a,
    T: AsRef<[f32]> + 'a,
{
    type Bytes = &'a [u8];
    type Scalars = ScalarView<'a>;
    type Floats = &'a [f32];
    type Table = &'a [f32];
    type Error = Infallible;
    fn bytes(&mut self, part: &'a B, _: Field<'_>) -> Result<&'a [u8], Infallible> {
        Ok(part.as_ref())
    }
    fn scalars(&mut self, part: &'a S, _: Field<'_>) -> Result<ScalarView<'a>, Infallible> {
        Ok(part.scalars())
    }
    fn floats(&mut self, part: &'a F, _: Field<'_>) -> Result<&'a [f32], Infallible> {
        Ok(part.as_ref())
    }
    fn table(&mut self, table: &'a T, _: Field<'_>) -> Result<&'a [f32], Infallible> {
        Ok(table.as_ref())
    }
}

impl<B, S, F, T> Rows<B, S, F, T>
where
    B: AsRef<[u8]>,
    S: AsScalars,
    F: AsRef<[f32]>,
    T: AsRef<[f32]>,
{
    /// The rows as the fused kernel reads them, borrowed from this description's parts.
    pub fn view(&self) -> Rows<&[u8], ScalarView<'_>, &[f32]> {
        match self.map("", &mut Borrow) {
            Ok(rows) => rows,
            Err(never) => match never {},
        }
    }
}

impl<B, S, T> Side<B, S, T>
where
    B: AsRef<[u8]>,
    S: AsScalars,
    T: AsRef<[f32]>,
{
    /// The side code as the fused kernel reads it, borrowed from this description's parts.
    pub fn view(&self) -> Side<&[u8], ScalarView<'_>, &[f32]> {
        match self.map::<T, _>(&mut Borrow) {
            Ok(side) => side,
            Err(never) => match never {},
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scalars::FloatView;

    /// Parts by index resolved to names: every field is visited once, in order, and named.
    struct Names(Vec<String>);

    impl<'a> Resolve<'a, usize, usize, usize, Vec<f32>> for Names {
        type Bytes = String;
        type Scalars = String;
        type Floats = String;
        type Table = usize;
        type Error = String;
        fn bytes(&mut self, part: &'a usize, at: Field<'_>) -> Result<String, String> {
            self.0.push(format!("{at}=b{part}"));
            Ok(format!("b{part}"))
        }
        fn scalars(&mut self, part: &'a usize, at: Field<'_>) -> Result<String, String> {
            self.0.push(format!("{at}=s{part}"));
            Ok(format!("s{part}"))
        }
        fn floats(&mut self, part: &'a usize, at: Field<'_>) -> Result<String, String> {
            Err(format!("{at}: no float part {part}"))
        }
        fn table(&mut self, table: &'a Vec<f32>, at: Field<'_>) -> Result<usize, String> {
            self.0.push(format!("{at}=t{}", table.len()));
            Ok(table.len())
        }
    }

    #[test]
    fn map_visits_and_names_every_field() {
        let run = |i: usize| Run {
            codes: 3 * i,
            scales: 3 * i + 1,
            zeros: 3 * i + 2,
            bits: 2,
            start: i,
            stop: i + 1,
        };
        let rows: Rows<usize, usize, usize, Vec<f32>> = Rows::Centred {
            rows: Box::new(Rows::ChannelRuns {
                runs: vec![run(0), run(1)],
                group: 4,
                basis: vec![0.0; 4],
                basis_heads: 1,
            }),
            mean: vec![0.0; 2],
            mean_heads: 1,
        };
        let mut names = Names(Vec::new());
        let got = rows.map("keys", &mut names).unwrap();
        assert_eq!(
            names.0,
            [
                "keys.rows.runs[0].codes=b0",
                "keys.rows.runs[0].scales=s1",
                "keys.rows.runs[0].zeros=s2",
                "keys.rows.runs[1].codes=b3",
                "keys.rows.runs[1].scales=s4",
                "keys.rows.runs[1].zeros=s5",
                "keys.rows.basis=t4",
                "keys.mean=t2",
            ]
        );
        let Rows::Centred { rows, mean: 2, .. } = got else {
            panic!("{got:?}")
        };
        assert!(
            matches!(*rows, Rows::ChannelRuns { ref runs, basis: 4, .. } if runs[1].zeros == "s5")
        );
        let mse: Rows<usize, usize, usize, Vec<f32>> = Rows::Mse {
            codes: 0,
            norms: 1,
            bits: 3,
            seed: None,
            qjl: Some(Qjl {
                signs: 2,
                norms: 3,
                seed: 5,
            }),
        };
        let mut names = Names(Vec::new());
        mse.map("values", &mut names).unwrap();
        assert_eq!(
            names.0,
            [
                "values.codes=b0",
                "values.norms=s1",
                "values.qjl.signs=b2",
                "values.qjl.norms=s3"
            ]
        );
        let token_runs: Rows<usize, usize, usize, Vec<f32>> = Rows::Centred {
            rows: Box::new(Rows::TokenRuns {
                runs: vec![
                    TokenRun {
                        codes: 4,
                        bits: 3,
                        start: 0,
                        stop: 5,
                    },
                    TokenRun {
                        codes: 6,
                        bits: 8,
                        start: 7,
                        stop: 9,
                    },
                ],
                scales: 5,
                basis: vec![0.0; 3],
                basis_heads: 1,
            }),
            mean: vec![0.0; 1],
            mean_heads: 1,
        };
        let mut names = Names(Vec::new());
        let got = token_runs.map("keys", &mut names).unwrap();
        assert_eq!(
            names.0,
            [
                "keys.rows.runs[0].codes=b4",
                "keys.rows.runs[1].codes=b6",
                "keys.rows.scales=s5",
                "keys.rows.basis=t3",
                "keys.mean=t1",
            ]
        );
        assert!(got.key_only().unwrap().contains("TokenRunRows"));
        let dense: Rows<usize, usize, usize, Vec<f32>> = Rows::Dense(7);
        assert_eq!(dense.key_only(), None);
        assert_eq!(
            dense.map("values", &mut names).unwrap_err(),
            "values.values: no float part 7"
        );
    }

    #[test]
    fn views_borrow_owned_parts_and_log_scalars() {
        let (codes, norms, exps) = (vec![1u8, 2], vec![0.5f32, 1.0], vec![127u8]);
        let owned: Rows<Vec<u8>, ScalarParts<Vec<u8>, ScalarView<'_>>, Vec<f32>> = Rows::Mse {
            codes: codes.clone(),
            norms: ScalarParts::Log {
                codes: codes.clone(),
                exps: exps.clone(),
                group: 2,
            },
            bits: 1,
            seed: None,
            qjl: Some(Qjl {
                signs: codes.clone(),
                norms: ScalarParts::Plain(ScalarView::Float(FloatView::F32(&norms))),
                seed: 1,
            }),
        };
        let want: Rows<&[u8], ScalarView<'_>, &[f32]> = Rows::Mse {
            codes: &codes,
            norms: ScalarView::Log(LogView {
                codes: &codes,
                exps: &exps,
                group: 2,
                row: 0,
            }),
            bits: 1,
            seed: None,
            qjl: Some(Qjl {
                signs: &codes,
                norms: ScalarView::Float(FloatView::F32(&norms)),
                seed: 1,
            }),
        };
        assert_eq!(owned.view(), want);
    }
}
