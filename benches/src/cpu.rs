//! CPU time of processes from the kernel's own accounting.
//!
//! `/proc/PID/task/*/schedstat` gives each live thread's time on CPU in ns
//! (io_uring's `iou-wrk` workers included); `/proc/PID/stat` fields 14 and 15
//! (utime, stime) cover every thread, exited ones too, in 10 ms ticks. A
//! multi-process server (nginx) is its master plus the processes whose parent
//! it is (`/proc/*/stat` field 4).

use std::fs;

/// Clock ticks per second of the stat fields.
fn ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// (ppid, utime + stime in ticks) of `pid`.
fn stat(pid: u32) -> Option<(u32, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    let ppid = f.get(1)?.parse().ok()?;
    let ut: u64 = f.get(11)?.parse().ok()?;
    let st: u64 = f.get(12)?.parse().ok()?;
    Some((ppid, ut + st))
}

/// Nanoseconds on CPU of the live threads of `pid`
/// (`/proc/PID/task/*/schedstat`, first field): precise, but blind to
/// threads that already exited.
fn tasks_ns(pid: u32) -> u64 {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    dir.flatten()
        .filter_map(|t| fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// CPU seconds `pid` has used (all its threads): the precise per-thread
/// figure, or the tick-grained process total when exited threads make that
/// one larger.
pub fn process_cpu_s(pid: u32) -> f64 {
    let coarse = stat(pid).map_or(0.0, |(_, t)| t as f64 / ticks_per_s());
    let fine = tasks_ns(pid) as f64 * 1e-9;
    if coarse > fine + 2.0 / ticks_per_s() {
        coarse
    } else {
        fine
    }
}

/// CPU seconds of `pid` and its direct children (nginx's master and workers).
pub fn tree_cpu_s(pid: u32) -> f64 {
    let mut total = process_cpu_s(pid);
    if let Ok(dir) = fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if stat(child).is_some_and(|(ppid, _)| ppid == pid) {
                total += process_cpu_s(child);
            }
        }
    }
    total
}

/// CPU seconds the calling thread has used.
pub fn thread_cpu_s() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe {
        libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_grows() {
        let me = std::process::id();
        let a = process_cpu_s(me);
        let t0 = std::time::Instant::now();
        let mut x = 0u64;
        while t0.elapsed().as_millis() < 60 {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        assert!(process_cpu_s(me) > a);
        assert!(thread_cpu_s() > 0.0);
    }
}
