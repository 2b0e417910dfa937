//! Loading the eBPF object, attaching its programs, and the `EbpfLoad` handle.

use std::net::SocketAddr;

use aya::maps::{HashMap, MapData, PerCpuArray};
use aya::programs::{
    ProgramError, SchedClassifier, TcAttachType, TestRun, TestRunOptions, Xdp, tc,
    xdp::XdpMode as AyaXdpMode,
};
use router_common::{
    BACKEND_COUNTERS_MAP, BACKENDS_MAP, BackendCounters as CpuCounters, BackendKey,
    GLOBAL_COUNTERS_MAP, TC_PROGRAM, XDP_PROGRAM,
};

use super::{EbpfConfig, EbpfError, EbpfMode, OBJECT, XdpMode, privilege_hint, routes};

/// The loaded programs (XDP and TC ingress), their maps and their links. Dropping it detaches the
/// program from every interface (links are owned here, nothing is pinned).
pub struct EbpfLoad {
    /// Backend ip:port -> dense index (`router-common`'s `BACKENDS`).
    pub(super) registry: HashMap<MapData, BackendKey, u32>,
    /// Per-CPU counters per dense index.
    pub(super) counters: PerCpuArray<MapData, CpuCounters>,
    /// Per-CPU global counters at the `GLOBAL_*` offsets.
    pub(super) globals: PerCpuArray<MapData, u64>,
    /// Position = dense index, as last given to `set_backends`.
    pub(super) backends: Vec<SocketAddr>,
    /// Interfaces attached and the mode each took (`Native`, `Tc` or `Skb`).
    attached: Vec<(String, XdpMode)>,
    /// Resolve interfaces from backend routes (config gave none).
    follow_routes: bool,
    xdp_mode: XdpMode,
    /// Owns the program and its links; declared last so the maps go first.
    ebpf: aya::Ebpf,
}

impl std::fmt::Debug for EbpfLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfLoad")
            .field("backends", &self.backends)
            .field("attached", &self.attached)
            .finish_non_exhaustive()
    }
}

impl EbpfLoad {
    /// Loads the program, registers `backends` (dense index = position) and
    /// attaches to the configured interfaces, or to those routing to the
    /// backends when none are configured.
    ///
    /// `Ok(None)` when the mode is `Off`, or `Auto` and eBPF is unavailable (not
    /// root, no object in this build, attach refused), after ONE warning saying
    /// why. With `Required` that reason is the error.
    pub fn start(cfg: &EbpfConfig, backends: &[SocketAddr]) -> Result<Option<Self>, EbpfError> {
        let result = match cfg.mode {
            EbpfMode::Off => return Ok(None),
            EbpfMode::Auto | EbpfMode::Required => Self::start_inner(cfg, backends),
        };
        match result {
            Ok(load) => {
                tracing::info!(attached = ?load.attached, backends = backends.len(), "eBPF load signal on");
                Ok(Some(load))
            }
            Err(e) if cfg.mode == EbpfMode::Auto => {
                tracing::warn!("eBPF load signal off (ebpf.mode = auto): {e}");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn start_inner(cfg: &EbpfConfig, backends: &[SocketAddr]) -> Result<Self, EbpfError> {
        let mut load = Self::load_unattached(backends)?;
        load.follow_routes = cfg.interfaces.is_empty();
        load.xdp_mode = cfg.xdp_mode;
        let ifaces = if load.follow_routes {
            routes::backend_interfaces(backends)
        } else {
            cfg.interfaces.clone()
        };
        if ifaces.is_empty() {
            return Err(EbpfError::NoInterface);
        }
        load.attach_all(&ifaces)?;
        Ok(load)
    }

    /// Loads the program and registers `backends` without attaching it anywhere:
    /// for packet tests through `test_run`, and the first step of `start`.
    pub fn load_unattached(backends: &[SocketAddr]) -> Result<Self, EbpfError> {
        let object = OBJECT.ok_or(EbpfError::NoObject)?;
        raise_memlock_limit();
        let mut ebpf = aya::Ebpf::load(object).map_err(|source| EbpfError::Load {
            hint: privilege_hint(),
            source: Box::new(source),
        })?;
        let load_err = |source| EbpfError::Program {
            hint: privilege_hint(),
            source: Box::new(source),
        };
        program_mut::<Xdp>(&mut ebpf, XDP_PROGRAM)?
            .load()
            .map_err(load_err)?;
        program_mut::<SchedClassifier>(&mut ebpf, TC_PROGRAM)?
            .load()
            .map_err(load_err)?;
        let mut take = |name: &'static str| ebpf.take_map(name).ok_or(EbpfError::Missing(name));
        let registry = HashMap::try_from(take(BACKENDS_MAP)?)?;
        let counters = PerCpuArray::try_from(take(BACKEND_COUNTERS_MAP)?)?;
        let globals = PerCpuArray::try_from(take(GLOBAL_COUNTERS_MAP)?)?;
        let mut load = Self {
            registry,
            counters,
            globals,
            backends: Vec::new(),
            attached: Vec::new(),
            follow_routes: false,
            xdp_mode: XdpMode::Auto,
            ebpf,
        };
        load.set_backends(backends)?;
        Ok(load)
    }

    /// Interfaces the program is attached to, with the mode each took.
    pub fn attached(&self) -> &[(String, XdpMode)] {
        &self.attached
    }

    /// Runs the program once on `frame` through `BPF_PROG_TEST_RUN` (the frame
    /// must hold at least an Ethernet header) and returns its XDP action. The
    /// run updates the counters like a received frame would.
    pub fn test_run(&self, frame: &[u8]) -> Result<u32, EbpfError> {
        let opts = TestRunOptions {
            data_in: Some(frame),
            ..TestRunOptions::default()
        };
        let out = self
            .program()?
            .test_run(opts)
            .map_err(|source| EbpfError::Program {
                hint: "",
                source: Box::new(source),
            })?;
        Ok(out.return_value)
    }

    fn program(&self) -> Result<&Xdp, EbpfError> {
        self.ebpf
            .program(XDP_PROGRAM)
            .ok_or(EbpfError::Missing(XDP_PROGRAM))?
            .try_into()
            .map_err(|_| EbpfError::Missing(XDP_PROGRAM))
    }

    /// Attaches to the interfaces routing to `backends` not attached yet (only
    /// when the config named no interfaces). Called by `set_backends`.
    pub(super) fn follow_backend_routes(
        &mut self,
        backends: &[SocketAddr],
    ) -> Result<(), EbpfError> {
        if !self.follow_routes {
            return Ok(());
        }
        let new: Vec<String> = routes::backend_interfaces(backends)
            .into_iter()
            .filter(|i| !self.attached.iter().any(|(a, _)| a == i))
            .collect();
        self.attach_all(&new)
    }

    fn attach_all(&mut self, ifaces: &[String]) -> Result<(), EbpfError> {
        for iface in ifaces {
            let mode = self.attach(iface)?;
            tracing::info!(interface = %iface, ?mode, "eBPF: counters attached");
            self.attached.push((iface.clone(), mode));
        }
        Ok(())
    }

    /// Attaches to one interface; `Auto` tries native XDP, then TC ingress,
    /// then generic XDP.
    fn attach(&mut self, iface: &str) -> Result<XdpMode, EbpfError> {
        let want = self.xdp_mode;
        let err = |mode, source| EbpfError::Attach {
            interface: iface.to_owned(),
            mode,
            source: Box::new(source),
        };
        if matches!(want, XdpMode::Auto | XdpMode::Native) {
            match self.xdp()?.attach(iface, AyaXdpMode::Driver) {
                Ok(_) => return Ok(XdpMode::Native),
                Err(e) if want == XdpMode::Native => return Err(err("native", e)),
                Err(e) => {
                    tracing::debug!(interface = %iface, "eBPF: native XDP refused ({e}); trying TC ingress")
                }
            }
        }
        if matches!(want, XdpMode::Auto | XdpMode::Tc) {
            match attach_tc(self.classifier()?, iface) {
                Ok(()) => return Ok(XdpMode::Tc),
                Err(e) if want == XdpMode::Tc => return Err(err("tc", e)),
                Err(e) => {
                    tracing::debug!(interface = %iface, "eBPF: TC ingress refused ({e}); trying generic XDP")
                }
            }
        }
        self.xdp()?
            .attach(iface, AyaXdpMode::Skb)
            .map(|_| XdpMode::Skb)
            .map_err(|e| err("skb", e))
    }

    fn xdp(&mut self) -> Result<&mut Xdp, EbpfError> {
        program_mut(&mut self.ebpf, XDP_PROGRAM)
    }

    fn classifier(&mut self) -> Result<&mut SchedClassifier, EbpfError> {
        program_mut(&mut self.ebpf, TC_PROGRAM)
    }
}

/// The program `name` in `ebpf`, as the kind `P` it must be.
fn program_mut<'a, P>(ebpf: &'a mut aya::Ebpf, name: &'static str) -> Result<&'a mut P, EbpfError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program>,
{
    ebpf.program_mut(name)
        .ok_or(EbpfError::Missing(name))?
        .try_into()
        .map_err(|_| EbpfError::Missing(name))
}

/// Attaches the classifier at TC ingress: a `tcx` link from kernel 6.6, else
/// a filter on the interface's `clsact` qdisc, added when missing (and left
/// in place at exit: it is empty once the filter goes).
fn attach_tc(classifier: &mut SchedClassifier, iface: &str) -> Result<(), ProgramError> {
    if let Err(first) = classifier.attach(iface, TcAttachType::Ingress) {
        // Before tcx, a filter needs the clsact qdisc; it may exist already.
        if let Err(e) = tc::qdisc_add_clsact(iface) {
            tracing::debug!(interface = %iface, "eBPF: adding a clsact qdisc: {e}");
        }
        classifier
            .attach(iface, TcAttachType::Ingress)
            .map_err(|_| first)?;
    }
    Ok(())
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; lift it so the maps
/// fit. Later kernels account them to the memory cgroup and ignore it.
fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct we pass by reference and keeps no pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        tracing::debug!(
            "eBPF: cannot lift RLIMIT_MEMLOCK: {}",
            std::io::Error::last_os_error()
        );
    }
}
