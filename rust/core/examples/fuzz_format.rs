//! Fuzz the container decoder (`kvqrs_core::format::read`) for a stated time, on stable Rust
//! (cargo-fuzz would need a nightly toolchain in every checkout that runs it): mutate the
//! corpus of `tests/corpus/format/` and a few valid containers built here (bit flips, byte
//! overwrites, inserts, deletes, splices, length-field edits, truncation, with or without the
//! section checksums recomputed so that mutations reach the checks behind them) and require
//! that `read` never panics and either errors with `CorruptData` or returns sections that
//! `write` turns back into exactly the input bytes. One input per new distinct error message
//! (numbers and names stripped) is saved into the corpus, which
//! `rust/core/tests/format_corpus.rs` and `tests/schemes/test_format.py` replay.
//!
//! ```text
//! cargo run --release -p kvqrs-core --example fuzz_format -- --seconds 120 [--seed 0] [--save]
//! ```
//! Exit status 1 when anything was found (the inputs are written as `finding-*.bin`).

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvqrs_core::format::{read, write, Dtype, Section, MAGIC};
use kvqrs_core::KvqError;

/// xorshift64*: a small deterministic generator (the harness needs no statistical quality).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Valid containers of every dtype, an empty one, one with an empty payload and a deep shape.
fn valid_seeds() -> Vec<Vec<u8>> {
    let sec = |name: &str, dtype, shape: Vec<u64>, len: usize| Section {
        name: name.into(),
        dtype,
        shape,
        payload: (0..len).map(|i| (i * 37) as u8).collect(),
    };
    let sets = [
        vec![],
        vec![
            sec("meta", Dtype::Utf8, vec![2], 2),
            sec("codes", Dtype::U8, vec![2, 3], 6),
            sec("norms", Dtype::F16, vec![2], 4),
        ],
        vec![
            sec("a", Dtype::F32, vec![3], 12),
            sec("b", Dtype::F64, vec![1], 8),
            sec("c", Dtype::I64, vec![2, 1], 16),
            sec("d", Dtype::Bf16, vec![0, 4], 0),
        ],
        vec![sec("deep", Dtype::U8, vec![1; 16], 1)],
    ];
    sets.iter().map(|s| write(s).expect("valid seed")).collect()
}

/// Every `.bin` file of the corpus folder.
fn corpus_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "bin"))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out.into_iter()
        .filter_map(|p| std::fs::read(&p).ok().map(|b| (p, b)))
        .collect()
}

/// Rewrite every section checksum that the (lenient) walk of the header can place, so that a
/// mutation inside a section reaches the checks behind the checksum.
fn fix_checksums(b: &mut [u8]) {
    let mut pos = MAGIC.len() + 6;
    while pos < b.len() {
        let start = pos;
        let Some(&name_len) = b.get(pos) else { return };
        pos += 1 + name_len as usize + 1;
        let Some(&ndim) = b.get(pos) else { return };
        pos += 1 + 8 * ndim as usize;
        let Some(len) = b
            .get(pos..pos + 8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
        else {
            return;
        };
        pos += 8;
        let Some(end) = pos
            .checked_add(len.min(usize::MAX as u64) as usize)
            .filter(|&e| e.checked_add(4).is_some_and(|x| x <= b.len()))
        else {
            return;
        };
        let crc = crc32fast::hash(&b[start..end]);
        b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
        pos = end + 4;
    }
}

/// Offsets of the 8-byte little-endian fields (shapes, payload lengths) and the section count.
fn length_fields(b: &[u8]) -> Vec<(usize, usize)> {
    let mut out = vec![(MAGIC.len() + 2, 4)];
    let mut pos = MAGIC.len() + 6;
    while pos < b.len() {
        let Some(&name_len) = b.get(pos) else { break };
        out.push((pos, 1));
        pos += 1 + name_len as usize + 1;
        let Some(&ndim) = b.get(pos) else { break };
        out.push((pos, 1));
        out.extend((0..=ndim as usize).map(|i| (pos + 1 + 8 * i, 8)));
        pos += 1 + 8 * ndim as usize;
        let Some(len) = b
            .get(pos..pos + 8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
        else {
            break;
        };
        pos = pos
            .saturating_add(8)
            .saturating_add(len.min(usize::MAX as u64 / 2) as usize)
            .saturating_add(4);
    }
    out.retain(|&(at, n)| at + n <= b.len());
    out
}

fn mutate(data: &[u8], rng: &mut Rng, pool: &[Vec<u8>]) -> Vec<u8> {
    let mut b = data.to_vec();
    for _ in 0..[1, 1, 2, 4, 16][rng.below(5)] {
        let i = rng.below(b.len() + 1);
        let last = b.len().saturating_sub(1);
        match rng.below(8) {
            0 if !b.is_empty() => b[i.min(last)] ^= 1 << rng.below(8),
            1 if !b.is_empty() => b[i.min(last)] = rng.below(256) as u8,
            2 => {
                let n = 1 + rng.below(8);
                b.splice(i..i, (0..n).map(|_| rng.below(256) as u8));
            }
            3 => {
                let end = (i + 1 + rng.below(8)).min(b.len());
                b.drain(i.min(end)..end);
            }
            4 => b.truncate(i),
            5 => {
                let other = &pool[rng.below(pool.len())];
                let j = rng.below(other.len() + 1);
                b.truncate(i);
                b.extend_from_slice(&other[j..]);
            }
            6 => {
                // A length field (count, name length, rank, shape entry, payload length) set to
                // an edge value or nudged by one.
                let fields = length_fields(&b);
                if let Some(&(at, n)) = fields.get(rng.below(fields.len().max(1))) {
                    let mut v = [0u8; 8];
                    v[..n].copy_from_slice(&b[at..at + n]);
                    let x = u64::from_le_bytes(v);
                    let edge = [
                        0,
                        1,
                        x.wrapping_add(1),
                        x.wrapping_sub(1),
                        u64::MAX,
                        1 << 31,
                        1 << 62,
                    ][rng.below(7)];
                    b[at..at + n].copy_from_slice(&edge.to_le_bytes()[..n]);
                }
            }
            _ => {
                let fill = [0u8, 0xFF, 0x7F][rng.below(3)];
                let end = (i + 8).min(b.len());
                b[i.min(end)..end].fill(fill);
            }
        }
    }
    if rng.below(2) == 0 {
        fix_checksums(&mut b);
    }
    b
}

/// What reading `data` did: an error's kind (message with numbers and quoted names stripped),
/// or a finding.
enum Outcome {
    Read,
    Error(String),
    Finding(String),
}

fn signature(msg: &str) -> String {
    // Names are Debug-quoted (`"..."` with backslash escapes): each becomes S; shapes `[..]`;
    // digit runs N.
    let (mut out, mut quoted, mut escaped, mut list) = (String::new(), false, false, false);
    for c in msg.chars() {
        if quoted {
            quoted = escaped || c != '"';
            escaped = !escaped && c == '\\';
        } else if list {
            list = c != ']';
        } else if c == '[' {
            list = true;
            out.push_str("[..]");
        } else if c == '"' {
            (quoted, escaped) = (true, false);
            out.push('S');
        } else if !c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('N') {
            out.push('N');
        }
    }
    out
}

fn check(data: &[u8]) -> Outcome {
    match catch_unwind(AssertUnwindSafe(|| read(data))) {
        Err(_) => Outcome::Finding("panic".into()),
        Ok(Err(KvqError::CorruptData { what })) => Outcome::Error(signature(&what)),
        Ok(Err(e)) => Outcome::Finding(format!("an error other than CorruptData: {e}")),
        Ok(Ok(sections)) => match write(&sections) {
            Ok(back) if back == data => Outcome::Read,
            Ok(_) => Outcome::Finding(
                "read sections that write() does not turn back into the input".into(),
            ),
            Err(e) => Outcome::Finding(format!("read sections that write() refuses: {e}")),
        },
    }
}

struct Args {
    seconds: f64,
    seed: u64,
    corpus: PathBuf,
    save: bool,
}

fn args() -> Args {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/corpus/format");
    let mut a = Args {
        seconds: 60.0,
        seed: 0,
        corpus: root,
        save: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--seconds" => a.seconds = value().parse().expect("--seconds: a number"),
            "--seed" => a.seed = value().parse().expect("--seed: an integer"),
            "--corpus" => a.corpus = PathBuf::from(value()),
            "--save" => a.save = true,
            other => panic!(
                "unknown argument {other} (expected --seconds S, --seed N, --corpus DIR, --save)"
            ),
        }
    }
    a
}

fn main() {
    let a = args();
    std::panic::set_hook(Box::new(|_| {})); // panics are counted as findings, not printed
    let corpus = corpus_files(&a.corpus);
    let mut pool = valid_seeds();
    pool.extend(corpus.iter().map(|(_, b)| b.clone()));
    let mut known: HashSet<String> = HashSet::new();
    for (_, b) in &corpus {
        if let Outcome::Error(sig) = check(b) {
            known.insert(sig);
        }
    }
    let mut rng = Rng(a.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut runs, mut valid) = (0u64, 0u64);
    let mut new: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut findings: Vec<(String, Vec<u8>)> = Vec::new();
    let start = Instant::now();
    let limit = Duration::from_secs_f64(a.seconds);
    while start.elapsed() < limit {
        for _ in 0..256 {
            let data = mutate(&pool[rng.below(pool.len())], &mut rng, &pool);
            runs += 1;
            match check(&data) {
                Outcome::Read => valid += 1,
                Outcome::Error(sig) => {
                    if !known.contains(&sig) {
                        new.entry(sig).or_insert(data);
                    }
                }
                Outcome::Finding(what) => findings.push((what, data)),
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "fuzz_format (Rust decoder): {runs} inputs in {secs:.0} s ({:.0} inputs/s), {valid} read back identically, \
         {} known + {} new distinct error messages, {} findings",
        runs as f64 / secs,
        known.len(),
        new.len(),
        findings.len()
    );
    for sig in new.keys() {
        println!("  new error: {sig}");
    }
    for (what, data) in findings.iter().take(10) {
        println!(
            "  FINDING {what} on {} bytes: {:02x?}",
            data.len(),
            &data[..data.len().min(48)]
        );
    }
    if a.save {
        std::fs::create_dir_all(&a.corpus).expect("corpus folder");
        let save = |prefix: &str, data: &[u8]| {
            let name = format!("{prefix}{:08x}.bin", crc32fast::hash(data));
            std::fs::write(a.corpus.join(name), data).expect("write corpus file");
        };
        new.values().for_each(|d| save("rs-", d));
        findings.iter().for_each(|(_, d)| save("finding-rs-", d));
        println!(
            "corpus: {} inputs written to {}",
            new.len() + findings.len(),
            a.corpus.display()
        );
    }
    std::process::exit(i32::from(!findings.is_empty()));
}
