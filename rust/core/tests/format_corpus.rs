//! Replays the fuzz corpus (`tests/corpus/format/`, written by `benches/fuzz_format.py` and
//! `rust/core/examples/fuzz_format.rs`) through the Rust container decoder: no input may panic,
//! and each is either rejected with `CorruptData` or read into sections that `write` turns back
//! into exactly its bytes (some inputs are well-formed containers that only the Python layer
//! rejects, e.g. for a missing `meta` section).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use kvqrs_core::format::{read, write};
use kvqrs_core::KvqError;

#[test]
fn every_corpus_input_is_a_clean_error() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/corpus/format");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus folder {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "the fuzz corpus in {} is missing",
        dir.display()
    );
    for path in files {
        let bytes = std::fs::read(&path).expect("read corpus file");
        let outcome = catch_unwind(AssertUnwindSafe(|| read(&bytes)));
        match outcome {
            Err(_) => panic!("{}: the decoder panicked", path.display()),
            Ok(Err(KvqError::CorruptData { .. })) => {}
            Ok(Err(e)) => panic!("{}: an error other than CorruptData: {e}", path.display()),
            Ok(Ok(s)) => assert_eq!(
                write(&s).expect("write what was read"),
                bytes,
                "{}: not read back identically",
                path.display()
            ),
        }
    }
}
