//! Test ground for prefix-router.
