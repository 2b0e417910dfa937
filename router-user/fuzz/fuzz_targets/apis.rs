//! The Anthropic Messages and OpenAI Responses readers, and the stored
//! response id scanner, on arbitrary bytes: nothing panics, a body reads
//! the same twice (the scratch reused carries nothing over), an accepted
//! body's canonical prompt is a sequence of messages, and the id found in
//! an answer does not depend on how its bytes were split across reads.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::fleet::stored::IdScanner;
use prefix_router::prompt::extract::Endpoint;
use prefix_router::prompt::scan::{Canonical, scan};

fuzz_target!(|data: &[u8]| {
    let mut canon = Canonical::default();
    for ep in [Endpoint::Messages, Endpoint::Responses] {
        let a = scan(ep, data, &mut canon);
        let mut first = Vec::new();
        canon.write_to(data, &mut first);
        let b = scan(ep, data, &mut canon);
        let mut second = Vec::new();
        canon.write_to(data, &mut second);
        match (a, b) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b);
                assert_eq!(first, second);
                assert!(first.is_empty() || first[0] == 0x1e, "starts with a message");
            }
            (Err(a), Err(b)) => assert_eq!(a.status(), 400, "{}", b.message),
            (a, b) => panic!("reading is not deterministic: {a:?} vs {b:?}"),
        }
    }
    let Some((&cut, answer)) = data.split_first() else {
        return;
    };
    let mut whole = IdScanner::default();
    whole.feed(answer);
    let cut = usize::from(cut).min(answer.len());
    let mut split = IdScanner::default();
    split.feed(&answer[..cut]);
    split.feed(&answer[cut..]);
    assert_eq!(whole.id(), split.id());
});
