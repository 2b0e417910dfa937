//! The prompt extractor and the one-pass scanner on arbitrary bodies for
//! every endpoint: neither panics, an accepted body extracts the same way
//! twice (the scratch buffers reused carry nothing over), and a body both
//! accept reads the same (seed, user, canonical prompt) in both.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::prompt::extract::{Endpoint, Extractor};
use prefix_router::prompt::scan::{Canonical, scan};

fuzz_target!(|data: &[u8]| {
    let mut ex = Extractor::default();
    for ep in [Endpoint::Chat, Endpoint::Completions, Endpoint::Generate] {
        let mut first = Vec::new();
        let a = ex.extract(ep, data, &mut first);
        let mut second = Vec::new();
        let b = ex.extract(ep, data, &mut second);
        match (a, b) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b);
                assert_eq!(first, second);
            }
            (Err(a), Err(b)) => assert_eq!(a.status(), b.status()),
            (a, b) => panic!("extraction is not deterministic: {a:?} vs {b:?}"),
        }
        let mut canon = Canonical::default();
        if let (Ok(reference), Ok(scanned)) = (ex.extract(ep, data, &mut first), scan(ep, data, &mut canon)) {
            assert_eq!(reference, scanned);
            canon.write_to(data, &mut second);
            assert_eq!(first, second, "the scanner's canonical prompt differs");
        }
    }
});
