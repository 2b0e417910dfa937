//! The Kubernetes example (`deploy/kubernetes.yaml`) as an operator applies
//! it: every document parses, the router's config in it is one the router
//! accepts, and the parts agree with each other (ports, labels, the peers'
//! headless Service, readiness on warm-up, the capabilities XDP needs);
//! the same for the endpoint picker's (`deploy/inference-gateway.yaml`) and
//! its Envoy bootstrap (`deploy/envoy.yaml`, which the e2e tests run).

use prefix_router::config::Config;
use yaml_rust2::{Yaml, YamlLoader};

fn docs() -> Vec<Yaml> {
    load("kubernetes.yaml")
}

fn load(file: &str) -> Vec<Yaml> {
    let path = format!("{}/../deploy/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    YamlLoader::load_from_str(&text).expect("valid YAML")
}

fn find<'a>(docs: &'a [Yaml], kind: &str, name: &str) -> &'a Yaml {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn strs(y: &Yaml) -> Vec<&str> {
    y.as_vec()
        .map(|v| v.iter().filter_map(Yaml::as_str).collect())
        .unwrap_or_default()
}

/// The container port named `name`.
fn port(container: &Yaml, name: &str) -> i64 {
    container["ports"]
        .as_vec()
        .and_then(|ps| ps.iter().find(|p| p["name"].as_str() == Some(name)))
        .and_then(|p| p["containerPort"].as_i64())
        .unwrap_or_else(|| panic!("no container port {name}"))
}

#[test]
fn the_kubernetes_example_is_consistent_and_its_config_is_accepted() {
    let docs = docs();
    let cm = find(&docs, "ConfigMap", "prefix-router");
    let toml_text = cm["data"]["prefix-router.toml"]
        .as_str()
        .expect("the router's config");
    let cfg: Config = toml::from_str(toml_text).expect("the config parses");
    cfg.validate().expect("the router accepts the config");
    let r = &cfg.replicas;
    assert!(r.enabled() && r.key_file.is_some() && r.key.is_none());
    let stream = r.listen.expect("replicas.listen").port();

    let dep = find(&docs, "Deployment", "prefix-router");
    assert_eq!(dep["spec"]["replicas"].as_i64(), Some(3));
    let labels = &dep["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&dep["spec"]["selector"]["matchLabels"], labels);
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(port(c, "traffic"), i64::from(cfg.listen.port()));
    assert_eq!(port(c, "replica"), i64::from(stream));
    assert_eq!(port(c, "replica-snap"), i64::from(stream) + 1);
    let admin = cfg.admin.listen.expect("admin.listen");
    assert_eq!(port(c, "admin"), i64::from(admin.port()));
    assert!(
        admin.ip().is_unspecified(),
        "the kubelet probes the pod's address"
    );
    // Ready when warm, alive when the process answers.
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/ready")
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/health")
    );
    let caps = strs(&c["securityContext"]["capabilities"]["add"]);
    for need in ["BPF", "PERFMON", "NET_ADMIN"] {
        assert!(caps.contains(&need), "{need} missing from {caps:?}");
    }
    let args = strs(&c["args"]);
    let config_path = args[args
        .iter()
        .position(|a| *a == "--config")
        .expect("--config")
        + 1];
    // The config and the key file are where the volumes put them.
    let mounts = c["volumeMounts"].as_vec().expect("mounts");
    let mounted = |path: &str| {
        mounts.iter().any(|m| {
            m["mountPath"]
                .as_str()
                .is_some_and(|p| path.starts_with(p) && path[p.len()..].matches('/').count() == 1)
        })
    };
    assert!(mounted(config_path), "{config_path} is not mounted");
    let key_file = r.key_file.as_ref().unwrap().to_str().unwrap();
    assert!(mounted(key_file), "{key_file} is not mounted");

    // The peers: a headless Service over the same pods, not-ready ones
    // included (a starting replica catches up through it), on both ports,
    // named as the config's `replicas.dns`.
    let peers = find(&docs, "Service", "prefix-router-peers");
    assert_eq!(peers["spec"]["clusterIP"].as_str(), Some("None"));
    assert_eq!(
        peers["spec"]["publishNotReadyAddresses"].as_bool(),
        Some(true)
    );
    assert_eq!(&peers["spec"]["selector"], labels);
    let dns = r.dns.as_deref().expect("replicas.dns");
    let ns = peers["metadata"]["namespace"].as_str().unwrap();
    assert_eq!(dns, format!("prefix-router-peers.{ns}.svc.cluster.local"));
    assert_eq!(r.dns_port, Some(stream));
    let peer_ports: Vec<i64> = peers["spec"]["ports"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert_eq!(peer_ports, [i64::from(stream), i64::from(stream) + 1]);

    // The traffic Service reaches the traffic port only.
    let svc = find(&docs, "Service", "prefix-router");
    assert_eq!(&svc["spec"]["selector"], labels);
    let targets = svc["spec"]["ports"].as_vec().unwrap();
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0]["targetPort"].as_str(), Some("traffic"));
}

#[test]
fn the_inference_gateway_example_is_consistent_and_its_config_is_accepted() {
    let docs = load("inference-gateway.yaml");
    let cm = find(&docs, "ConfigMap", "prefix-router-epp");
    let toml_text = cm["data"]["prefix-router.toml"]
        .as_str()
        .expect("the picker's config");
    let cfg: Config = toml::from_str(toml_text).expect("the config parses");
    cfg.validate().expect("the router accepts the config");
    let epp = cfg.epp.listen.expect("epp.listen");
    assert!(
        epp.ip().is_unspecified(),
        "the gateway reaches the pod's address"
    );
    assert!(
        cfg.listen.ip().is_loopback(),
        "the HTTP front is not exposed"
    );

    let dep = find(&docs, "Deployment", "prefix-router-epp");
    let labels = &dep["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&dep["spec"]["selector"]["matchLabels"], labels);
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(port(c, "grpc"), i64::from(epp.port()));
    // gRPC health as the protocol names its services.
    assert_eq!(
        c["readinessProbe"]["grpc"]["service"].as_str(),
        Some("readiness")
    );
    assert_eq!(
        c["livenessProbe"]["grpc"]["service"].as_str(),
        Some("liveness")
    );
    assert_eq!(
        c["readinessProbe"]["grpc"]["port"].as_i64(),
        Some(i64::from(epp.port()))
    );

    let svc = find(&docs, "Service", "prefix-router-epp");
    assert_eq!(&svc["spec"]["selector"], labels);
    let svc_port = &svc["spec"]["ports"][0];
    assert_eq!(svc_port["appProtocol"].as_str(), Some("http2"));

    // The pool: the engines the picker discovers, its picker this Service.
    let pool = find(&docs, "InferencePool", "vllm");
    assert_eq!(
        pool["apiVersion"].as_str(),
        Some("inference.networking.k8s.io/v1")
    );
    let picker = &pool["spec"]["endpointPickerRef"];
    assert_eq!(picker["name"].as_str(), Some("prefix-router-epp"));
    assert_eq!(picker["port"]["number"], svc_port["port"]);
    assert!(matches!(
        picker["failureMode"].as_str(),
        Some("FailClose" | "FailOpen")
    ));
    let engines = find(&docs, "Service", "vllm");
    assert_eq!(engines["spec"]["clusterIP"].as_str(), Some("None"));
    assert_eq!(
        &engines["spec"]["selector"],
        &pool["spec"]["selector"]["matchLabels"]
    );
    let dns = &cfg.discovery.dns[0];
    assert_eq!(dns.name, "vllm.inference.svc.cluster.local");
    assert_eq!(
        pool["spec"]["targetPorts"][0]["number"].as_i64(),
        dns.port.map(i64::from)
    );

    let route = find(&docs, "HTTPRoute", "vllm");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["kind"].as_str(), Some("InferencePool"));
    assert_eq!(backend["name"].as_str(), Some("vllm"));
}

#[test]
fn the_envoy_bootstrap_asks_the_picker_in_the_protocol_s_streaming_mode() {
    let docs = load("envoy.yaml");
    let boot = &docs[0];
    let hcm =
        &boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_vec().expect("filters");
    let names: Vec<&str> = filters.iter().filter_map(|f| f["name"].as_str()).collect();
    let at = |n: &str| {
        names
            .iter()
            .position(|x| *x == n)
            .unwrap_or_else(|| panic!("no {n}"))
    };
    // Clients cannot name the endpoint; the picker runs before the router.
    assert!(at("envoy.filters.http.header_mutation") < at("envoy.filters.http.ext_proc"));
    assert!(at("envoy.filters.http.ext_proc") < at("envoy.filters.http.router"));
    let ext = &filters[at("envoy.filters.http.ext_proc")]["typed_config"];
    let mode = &ext["processing_mode"];
    for k in ["request_body_mode", "response_body_mode"] {
        assert_eq!(mode[k].as_str(), Some("FULL_DUPLEX_STREAMED"), "{k}");
    }
    assert_eq!(ext["failure_mode_allow"].as_bool(), Some(false));
    assert_eq!(ext["route_cache_action"].as_str(), Some("CLEAR"));
    // The picked endpoint's cluster reads the protocol's header.
    let clusters = boot["static_resources"]["clusters"]
        .as_vec()
        .expect("clusters");
    let pool = clusters
        .iter()
        .find(|c| c["type"].as_str() == Some("ORIGINAL_DST"))
        .expect("an ORIGINAL_DST cluster");
    assert_eq!(
        pool["original_dst_lb_config"]["http_header_name"].as_str(),
        Some("x-gateway-destination-endpoint")
    );
    // The picker's cluster is the port the Kubernetes example listens on.
    let epp = clusters
        .iter()
        .find(|c| c["name"].as_str() == Some("epp"))
        .expect("the picker's cluster");
    let sock = &epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    let k8s = load("inference-gateway.yaml");
    let cm = find(&k8s, "ConfigMap", "prefix-router-epp");
    let cfg: Config = toml::from_str(cm["data"]["prefix-router.toml"].as_str().unwrap()).unwrap();
    assert_eq!(
        sock["port_value"].as_i64(),
        cfg.epp.listen.map(|a| i64::from(a.port()))
    );
}
