//! The decision: given a request's matches and a snapshot of the fleet's
//! load, a ranked choice of backends. Pure: no I/O, no clock, no globals.

pub mod select;
